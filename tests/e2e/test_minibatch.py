"""Mini-batch updates (``train.num_steps_per_rollout``): k optimizer steps per rollout step, π_old fixed before
the first, so from the second update on the ratio moves off 1 and clipping acts; and a run requeued mid-way
(SIGUSR2, the time-limit warning) redoes its steps exactly as the uninterrupted run did."""

from __future__ import annotations

import os
import signal

import pytest

from relax_hpc.exchange.audit import exactly_once
from relax_hpc.launch.cancel import cancel

from .conftest import held_at, hold, metrics, reference_rows, state, submit_detached, wait_until

STEPS = 6
K = 4
KEYS = ("train/loss", "train/pg_loss", "train/grad_norm", "train/pg_clipfrac", "train/ppo_kl", "rollout/raw_reward")
SMALL = (f"run.steps={STEPS}", f"train.num_steps_per_rollout={K}", "rollout.rollout_batch_size=8",
         "checkpoint.interval=0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model) -> dict[int, dict]:
    return reference_rows(tmp_path_factory.mktemp("mb"), tiny_model, *SMALL, name="mb", steps=STEPS)


def test_k_updates_per_rollout_step_move_the_ratio_off_one(reference):
    rows = list(reference.values())
    assert all(r["train/num_steps"] == K for r in rows)
    assert all(r["train/num_samples"] == 64 for r in rows)  # the k mini-batches together: the whole step
    assert rows[-1]["train/step"] == K * STEPS  # optimizer steps
    # with one update per rollout step the ratio is exactly 1 and both are 0; here the later updates see a
    # policy that moved since π_old
    assert max(r["train/pg_clipfrac"] for r in rows) > 0
    assert all(abs(r["train/ppo_kl"]) > 0 for r in rows)
    for r in rows:  # Relax's rollout/* means and perf/* rates (docs/metrics.md)
        assert r["rollout/log_probs"] < 0 and r["rollout/rollout_log_probs"] < 0
        assert abs(r["rollout/log_probs"] - r["rollout/rollout_log_probs"]) < 1e-4  # same weights, two engines
        assert r["rollout/advantages"] == r["rollout/returns"]
        assert r["perf/tokens_per_gpu_per_sec"] > 0 and r["perf/longest_sample_tokens_per_sec"] > 0


@pytest.mark.slow
def test_a_requeued_mini_batch_run_matches_the_uninterrupted_one(reference, tmp_path, tiny_model, local_executor):
    run = submit_detached(tmp_path, tiny_model, *SMALL)

    try:
        hold(run, 3)  # no step after 3 starts: SIGUSR2 lands between steps
        wait_until(lambda: held_at(run, 3), 300, every=0.05, what="step 3 done, the run held")
        os.kill(run.read_json(run.controller_addr)["pid"], signal.SIGUSR2)
        wait_until(lambda: state(run).get("attempt") == 1 and held_at(run, 3), 300, what="attempt 1 running")
        assert state(run)["last_checkpoint"]["step"] == 3
        (run.path / "pause").unlink()
        wait_until(lambda: state(run).get("state") not in (None, "RUNNING", "REQUEUED"), 600, every=0.5,
                   what="the run's end")
    finally:
        if state(run).get("state") in (None, "RUNNING", "REQUEUED"):
            cancel(run, grace_s=5)
    assert state(run)["state"] == "COMPLETED", state(run).get("reason")
    got = metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got:
        for k in KEYS:
            assert r[k] == pytest.approx(reference[r["step"]][k], abs=1e-6), (r["step"], k)
    assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train"]) == []
