"""``staleness_mode: fixed``: a fully-async run that follows one trajectory, uninterrupted or requeued.

``recipes/quickstart-slurm.yaml`` (4 groups: actor, rollout, reference, actor_fwd; fully async, k = 1), run with
the local executor: step N is generated with exactly the weights of step N − 1 − k, so two runs of the same seed
log the same per-step rewards and losses, bit for bit, whatever the timing. A third run is stopped by SIGUSR2 (the
time-limit warning) with a trained step whose sync waits for rollout; it checkpoints, is requeued, resumes and ends
with the same rows. The step generated before the checkpoint on older weights is kept and trained after the resume,
not generated again (the journal shows it started once).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from relax_hpc.exchange.audit import exactly_once
from relax_hpc.exchange.journal import iter_ops, replay
from relax_hpc.launch.cancel import cancel

from .conftest import REPO, held_at, hold, metrics, reference_rows, state, submit_detached, wait_until
from .test_eval import answer, deliver_joins, drive, sim_loop, sim_recipe, sim_run, what

RECIPE = REPO / "recipes" / "quickstart-slurm.yaml"
STEPS = 6
K = 1  # the recipe's max_staleness
KEYS = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/grad_norm")
FIXED = (f"run.steps={STEPS}", "staleness_mode=fixed", "checkpoint.interval=2", "rollout.rollout_batch_size=8")


# ------------------------------------------------------------------------------ the loop, by hand ---


def by_hand(tmp_path, mode: str, steps: int = 5):
    recipe = sim_recipe(tmp_path, f"run.steps={steps}", "mode=fully_async", "max_staleness=1",
                        f"staleness_mode={mode}", "checkpoint.interval=2")
    run = sim_run(tmp_path, recipe)
    loop, ch = sim_loop(recipe, run)
    seen: dict[int, str] = {}  # generate(n) -> the engines' weight version when it was handed out
    assign = ch.assign

    def watch(role: str, task: dict) -> None:
        if task["kind"] == "generate":
            seen[task["step"]] = loop.registry.engines["engine0"].weight_version
        assign(role, task)

    ch.assign = watch
    return run, loop, ch, seen


def drive_answering(loop, ch, special) -> None:
    """Like ``drive``, but ``special(task)`` may answer a task instead (None: the usual answer)."""
    deliver_joins(loop, ch)
    while ch.queue and loop.outcome is None:
        role, task = ch.queue.pop(0)
        res = special(task) or answer(loop, task)
        ch.events.append(("-", *what(task)))
        loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0, "result": res.to_dict()})
        assert loop.state.running or task["kind"] == "stop", loop.state.doc["reason"]
        deliver_joins(loop, ch)


@pytest.mark.parametrize("mode", ["bounded", "fixed"])
def test_fixed_holds_each_sync_until_rollout_made_the_last_step_on_older_weights(tmp_path, mode):
    """Every task answered in the order handed out (an interleaving a real run may take): bounded syncs step 1 while
    step 2 is generated, so step 2 may see either version; fixed holds sync(n) until generate(n+1) is done."""
    run, loop, ch, seen = by_hand(tmp_path, mode)
    drive(loop, ch)
    ev = ch.events.index
    if mode == "bounded":
        assert ev(("+", "sync", "1")) < ev(("-", "generate", "2"))
        return
    for n in range(1, 6):
        assert seen[n] == str(max(0, n - 2)), (n, seen)  # exactly the weights of step n-1-k
        assert ev(("-", "generate", str(min(n + 1, 5)))) < ev(("+", "sync", str(n)))


@pytest.mark.parametrize("crashed", [False, True])
def test_a_resume_trains_the_kept_step_and_does_not_generate_it_again(tmp_path, crashed):
    """A stop after step 2's checkpoint: the checkpoint carries step 3 (generated on step 1's weights, which a
    resume no longer has); the next attempt trains it and generates from step 4 on. An attempt that trained step 3
    and crashed before the next checkpoint leaves nothing to keep: step 3 is generated again, and an event says so."""
    run, loop, ch, seen = by_hand(tmp_path, "fixed", steps=6)
    extras = {}
    assign = ch.assign

    def stop_at_checkpoint(role: str, task: dict) -> None:  # relax-cancel --requeue as step 2 is checkpointed
        if task["kind"] == "checkpoint":
            extras[task["extra"]["step"]] = task["extra"]
            if not crashed:
                loop.stop_request = ("requeue", "test")
        assign(role, task)

    ch.assign = stop_at_checkpoint
    drive(loop, ch)
    assert loop.outcome == ("requeue" if not crashed else None) and sorted(extras) == ([2] if not crashed else [2, 4, 6])
    if crashed:  # as if it died after step 3's sync, before the checkpoint of step 4
        for m in (4, 6):
            extras.pop(m)
        (run.path / "metrics.jsonl").write_text("".join(line + "\n" for line in
                                                        (run.path / "metrics.jsonl").read_text().splitlines()[:3]))
    extra = extras[2]
    assert extra["kept"]["generated"] == 3 and extra["kept"]["data"] == {"offset": 3}
    assert extra["kept"]["metrics"]["3"]["rollout/raw_reward"] == pytest.approx(0.3)
    loop.finish()
    d = run.path / "checkpoints" / "step_00000002"  # what the actor would have saved
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": 2, "extra_state": extra}))
    (run.path / "checkpoints" / "latest").write_text(d.name)

    loop2, ch2 = sim_loop(loop.recipe, run)  # the next attempt: resumes from step 2, step 3 kept
    events = [e["event"] for e in loop2.state.doc["events"]]
    if crashed:
        assert loop2.generated == 2 and "fixed_staleness_broken" in events
    else:
        assert loop2.generated == 3 and 3 in loop2.ready and "fixed_staleness_broken" not in events
    done = drive(loop2, ch2)
    assert (("generate", "3") in done) == crashed and ("train", "3") in done and ("generate", "4") in done
    rows = {r["step"]: r for r in metrics(run)}
    assert sorted(rows) == list(range(1, 7))
    assert rows[3]["rollout/raw_reward"] == pytest.approx(0.3) and rows[3]["train/loss"] == 3.0


def test_a_step_voided_for_damage_is_generated_again_on_newer_weights(tmp_path):
    """A damaged chunk found when train(3) reads it: step 3's weights (version 1) are gone from the engines by then,
    so its regeneration takes the ones they serve (an event says the trajectory left the fixed one) instead of
    waiting for ever."""
    from relax_hpc.controller import messages as M

    run, loop, ch, seen = by_hand(tmp_path, "fixed")
    damaged = []

    def train_3_damaged(task: dict):
        if task["kind"] == "train" and task["step"] == 3 and not damaged:
            damaged.append(task["id"])  # the chunk file is not there: the broker's own check quarantines it
            return M.TaskError(error="DamagedChunk: step_3/chunk_rollout_2.h5: checksum mismatch")
        return None

    drive_answering(loop, ch, train_3_damaged)
    assert damaged and loop.step == 5, (loop.step, loop.state.doc.get("phase"))
    assert sum(1 for e in ch.events if e == ("-", "generate", "3")) == 2  # generated twice
    events = [e["event"] for e in loop.state.doc["events"]]
    assert "chunk_quarantined" in events and "fixed_staleness_broken" in events


def test_an_engine_restarted_under_a_held_sync_does_not_stop_the_run(tmp_path):
    """The only engine found dead at sync(1) is started again (the model on disk). train(2) takes the actor, so no
    catch-up sync; sync(2) is then held for generate(3), which needs step 1's weights, which no engine holds any
    more. The held sync goes out instead, step 3 is generated on step 2's weights, and the run completes."""
    from relax_hpc.controller import messages as M

    run, loop, ch, seen = by_hand(tmp_path, "fixed")
    killed = []

    def engine_dead_at_sync_1(task: dict):
        if task["kind"] == "sync" and task["version"] == "1" and not killed:
            killed.append(task["id"])
            return M.SyncResult(dead_engines={"engine0": "connection refused"})
        return None

    drive_answering(loop, ch, engine_dead_at_sync_1)
    assert killed and loop.step == 5, (loop.step, loop.state.doc.get("phase"))
    assert seen[3] == "2" and seen[4] == "2" and seen[5] == "3"  # step 3 off the fixed trajectory, then back on it
    assert "fixed_staleness_broken" in [e["event"] for e in loop.state.doc["events"]]


# -------------------------------------------------------------------------------- real local runs ---


@pytest.fixture(scope="module")
def first(tmp_path_factory, tiny_model) -> dict[int, dict]:
    return reference_rows(tmp_path_factory.mktemp("fixed"), tiny_model, *FIXED, name="fixed", steps=STEPS,
                          recipe=RECIPE)


@pytest.mark.slow
def test_two_fixed_runs_of_one_seed_are_identical(first, tmp_path, tiny_model):
    second = reference_rows(tmp_path, tiny_model, *FIXED, name="fixed2", steps=STEPS, recipe=RECIPE)
    for n in range(1, STEPS + 1):
        # exactly the weights of step n-1-k: never newer (bounded would use whatever was synced), never older
        assert first[n]["rollout/weight_version"] == first[n]["rollout/weight_version_min"] == max(0, n - 1 - K)
        for key in KEYS:
            assert second[n][key] == first[n][key], (n, key, second[n][key], first[n][key])


@pytest.mark.slow
def test_a_requeued_fixed_run_follows_the_same_trajectory(first, tmp_path, tiny_model):
    run = submit_detached(tmp_path, tiny_model, *FIXED, recipe=RECIPE)
    try:
        # rollout held after step 3: step 2 synced (it waited for step 3's generate), step 3 trained, its sync
        # waiting for step 4's generate, which the pause holds back
        hold(run, 3)
        wait_until(lambda: held_at(run, 2), 600, every=0.1, what="step 3 trained, its sync held, the run paused")
        os.kill(run.read_json(run.controller_addr)["pid"], signal.SIGUSR2)
        # the stop lets step 4 be generated (the held sync needs it), syncs and checkpoints step 3, keeping step 4
        wait_until(lambda: state(run).get("attempt") == 1 and held_at(run, 3), 600, what="attempt 1 resumed, held")
        st = state(run)
        assert st["history"][-1]["state"] == "REQUEUED" and st["last_checkpoint"]["step"] == 3
        (run.path / "pause").unlink()
        wait_until(lambda: state(run).get("state") not in (None, "RUNNING", "REQUEUED"), 600, every=0.5,
                   what="the run's end")
    finally:
        if state(run).get("state") in (None, "RUNNING", "REQUEUED"):
            cancel(run, grace_s=5)
    assert state(run)["state"] == "COMPLETED", state(run).get("reason")
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step logged twice or missing"
    for r in rows:
        for key in KEYS:
            assert r[key] == pytest.approx(first[r["step"]][key], abs=1e-6), (r["step"], key)
    journal = run.path / "exchange" / "journal.jsonl"
    starts = [s["step"] for s in iter_ops(replay(journal), "start")]
    assert starts.count(4) == 1, f"step 4 (kept across the requeue) was generated again: {starts}"
    assert exactly_once(journal, ["train"]) == []

