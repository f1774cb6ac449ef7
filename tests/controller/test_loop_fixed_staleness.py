"""``staleness_mode: fixed`` in the training loop, driven by hand (:mod:`loop_sim`): held syncs, a resume that keeps
the step generated before its checkpoint, and the ways off the fixed trajectory (damage, an engine started again)
that must not stop the run. The real runs are in tests/e2e/test_fixed_staleness.py."""

from __future__ import annotations

import pytest

from loop_sim import drive, fake_checkpoint, metrics, sim_loop, sim_recipe, sim_run
from relax_hpc.controller import messages as M


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
                loop.stop.request = ("requeue", "test")
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
    fake_checkpoint(run, 2, extra)  # what the actor would have saved

    loop2, ch2 = sim_loop(loop.recipe, run)  # the next attempt: resumes from step 2, step 3 kept
    events = [e["event"] for e in loop2.state.doc["events"]]
    if crashed:
        assert loop2.gen.generated == 2 and "fixed_staleness_broken" in events
        assert loop2.resume.kept is None and loop2.fixed.unfixed_upto == 3  # step 3 on step 2's weights
    else:
        assert loop2.gen.generated == 3 and 3 in loop2.ready and "fixed_staleness_broken" not in events
        assert loop2.resume.kept is not None and loop2.fixed.unfixed_upto == 0
    done = drive(loop2, ch2)
    assert (("generate", "3") in done) == crashed and ("train", "3") in done and ("generate", "4") in done
    rows = {r["step"]: r for r in metrics(run)}
    assert sorted(rows) == list(range(1, 7))
    assert rows[3]["rollout/raw_reward"] == pytest.approx(0.3) and rows[3]["train/loss"] == 3.0


def test_a_step_voided_for_damage_is_generated_again_on_newer_weights(tmp_path):
    """A damaged chunk found when train(3) reads it: step 3's weights (version 1) are gone from the engines by then,
    so its regeneration takes the ones they serve (an event says the trajectory left the fixed one) instead of
    waiting for ever."""
    run, loop, ch, seen = by_hand(tmp_path, "fixed")
    damaged = []

    def train_3_damaged(task: dict):
        if task["kind"] == "train" and task["step"] == 3 and not damaged:
            damaged.append(task["id"])  # the chunk file is not there: the broker's own check quarantines it
            return M.TaskError(error="DamagedChunk: step_3/chunk_rollout_2.h5: checksum mismatch")
        return None

    drive(loop, ch, special=train_3_damaged)
    assert damaged and loop.step == 5, (loop.step, loop.state.doc.get("phase"))
    assert sum(1 for e in ch.events if e == ("-", "generate", "3")) == 2  # generated twice
    events = [e["event"] for e in loop.state.doc["events"]]
    assert "chunk_quarantined" in events and "fixed_staleness_broken" in events


def test_an_engine_restarted_under_a_held_sync_does_not_stop_the_run(tmp_path):
    """The only engine found dead at sync(1) is started again (the model on disk). train(2) takes the actor, so no
    catch-up sync; sync(2) is then held for generate(3), which needs step 1's weights, which no engine holds any
    more. The held sync goes out instead, step 3 is generated on step 2's weights, and the run completes."""
    run, loop, ch, seen = by_hand(tmp_path, "fixed")
    killed = []

    def engine_dead_at_sync_1(task: dict):
        if task["kind"] == "sync" and task["version"] == "1" and not killed:
            killed.append(task["id"])
            return M.SyncResult(dead_engines={"engine0": "connection refused"})
        return None

    drive(loop, ch, special=engine_dead_at_sync_1)
    assert killed and loop.step == 5, (loop.step, loop.state.doc.get("phase"))
    assert seen[3] == "2" and seen[4] == "2" and seen[5] == "3"  # step 3 off the fixed trajectory, then back on it
    assert "fixed_staleness_broken" in [e["event"] for e in loop.state.doc["events"]]
