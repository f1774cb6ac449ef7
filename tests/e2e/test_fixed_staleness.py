"""``staleness_mode: fixed``: a fully-async run that follows one trajectory, uninterrupted or requeued.

``recipes/quickstart-slurm.yaml`` (4 groups: actor, rollout, reference, actor_fwd; fully async, k = 1), run with
the local executor: step N is generated with exactly the weights of step N − 1 − k, so two runs of the same seed
log the same per-step rewards and losses, bit for bit, whatever the timing: the second run here is even stopped by
SIGUSR2 (the time-limit warning) with a trained step whose sync waits for rollout; it checkpoints, is requeued,
resumes and ends with the same rows as the first, bit for bit (:mod:`interrupt`; one run proves both, the timing of
a requeue being as different as timing gets). The step generated before the checkpoint on older weights is kept and
trained after the resume, not generated again (the journal shows it started once). Streaming within a step
(``rollout.stream_groups``) changes when the forward roles get a step's groups, not what is trained: the streamed
run, requeued, ends with the rows of the same uninterrupted one-chunk-per-step run, bit for bit (one reference run
for both). The loop's side of it, driven by hand, is tests/controller/test_loop_fixed_staleness.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from relax_hpc.exchange.audit import exactly_once
from relax_hpc.exchange.journal import iter_ops, replay

from . import interrupt
from .conftest import REPO, metrics
from .interrupt import Hit

RECIPE = REPO / "recipes" / "quickstart-slurm.yaml"
STEPS = 5  # the requeued attempt trains the kept step 4, held before it generates step 5
K = 1  # the recipe's max_staleness
KEYS = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/grad_norm")
FIXED = (f"run.steps={STEPS}", "staleness_mode=fixed", "checkpoint.interval=2", "rollout.rollout_batch_size=8")


# streaming within a step (rollout.stream_groups): each step as 4 chunks of 2 groups, announced as they are written;
# the reference and actor_fwd take them one by one while rollout writes the rest
STREAMED = (*FIXED, "rollout.stream_groups=2")


@pytest.fixture(scope="module", params=[FIXED, STREAMED], ids=["one_chunk_per_step", "streamed"])
def overrides(request) -> tuple[str, ...]:
    return request.param


@pytest.fixture(scope="module")
def first(uninterrupted) -> dict[int, dict]:
    """The uninterrupted run, one chunk per step: what both requeued runs, streamed or not, must equal."""
    return uninterrupted(*FIXED, steps=STEPS, recipe=RECIPE)


@pytest.mark.slow
def test_two_fixed_runs_of_one_seed_are_identical_even_when_one_is_requeued(first, overrides, tmp_path, tiny_model,
                                                                            local_executor):
    # rollout held after step 3: step 2 synced (it waited for step 3's generate), step 3 trained, its sync waiting
    # for step 4's generate, which the pause holds back. The stop lets step 4 be generated (the held sync needs it),
    # syncs and checkpoints step 3, keeping step 4; attempt 1 resumes, held after step 3.
    run = interrupt.interrupted_run(tmp_path, tiny_model, overrides,
                                    (Hit("requeue", hold=3, held=2, after=3, checkpoint=3),), recipe=RECIPE)
    interrupt.same_steps(run, first, KEYS, STEPS)
    second = {r["step"]: r for r in metrics(run)}
    for n in range(1, STEPS + 1):
        # exactly the weights of step n-1-k: never newer (bounded would use whatever was synced), never older
        for rows in (first, second):
            assert rows[n]["rollout/weight_version"] == rows[n]["rollout/weight_version_min"] == max(0, n - 1 - K)
        for key in KEYS:  # bit for bit
            assert second[n][key] == first[n][key], (n, key, second[n][key], first[n][key])
    starts = [s["step"] for s in iter_ops(replay(run.path / "exchange" / "journal.jsonl"), "start")]
    assert starts.count(4) == 1, f"step 4 (kept across the requeue) was generated again: {starts}"
    journal = run.path / "exchange" / "journal.jsonl"
    assert exactly_once(journal, ["train", "reference", "actor_fwd"]) == []
    if overrides == STREAMED:  # every step in 4 chunks, each forward role given them one chunk a task
        produced = list(iter_ops(replay(journal), "produced"))
        assert sorted(Counter(p["step"] for p in produced).values()) == [4] * STEPS, produced
        leases = [x for x in iter_ops(replay(journal), "leased") if x["task"] in ("reference", "actor_fwd")]
        assert leases and all(len(x["chunks"]) == 1 for x in leases), leases
