"""train.overlap_sync in the training loop, driven by hand (:mod:`loop_sim`): where the staleness bound allows it the
actor answers step N's sync at its snapshot and trains step N+1 while the push is on its way; the step counts as synced
(its lease acked, the staleness gate moved, its row logged) only when the push's landing is reported. And the rule:
which recipes may overlap, and ``true`` refused where the mode does not allow it."""

from __future__ import annotations

import pytest

from loop_sim import answer, deliver_joins, metrics, sim_loop, sim_recipe, sim_run, what
from relax_hpc.controller import messages as M
from relax_hpc.recipe import RecipeError
from relax_hpc.train.config import overlap_sync

ASYNC = ["mode=fully_async", "max_staleness=1", "run.steps=5"]


def drive_behind(loop, ch):
    """Answer every task in order, as an actor that pushes behind its next train would: a sync with ``land`` is
    answered at once (``landing``), and its landing is reported when the actor is handed its next train (or when
    nothing else is left). Returns the landings as (step, the events before it)."""
    landed, pending = [], None  # pending: (land id, step, version)

    def land():
        nonlocal pending
        tid, n, version = pending
        pending = None
        landed.append((n, list(ch.events), loop.step))
        loop.on_message({"type": "task_done", "task_id": tid, "rank": 0,
                         "result": M.SyncResult(engine_versions={"engine0": version}).to_dict()})
        deliver_joins(loop, ch)

    deliver_joins(loop, ch)
    while (ch.queue or pending) and loop.outcome is None:
        if not ch.queue:
            land()
            continue
        role, task = ch.queue.pop(0)
        if pending and task["kind"] == "train":
            land()  # the push lands while the actor trains the next step
        if task["kind"] == "sync" and task.get("land") is not None:
            assert pending is None, "one push in flight"
            pending = (task["land"], int(task["version"]), task["version"])
            res = M.SyncResult(landing=True, metrics={"perf/weight_pack_ahead_time": 0.01})
        else:
            res = answer(loop, task, role)
        ch.events.append(("-", *what(task)))
        loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0, "result": res.to_dict()})
        assert loop.state.running or task["kind"] == "stop", loop.state.doc["reason"]
        deliver_joins(loop, ch)
    return landed


def test_the_next_train_starts_before_the_push_lands_and_the_step_counts_only_when_it_lands(tmp_path):
    recipe = sim_recipe(tmp_path, *ASYNC)
    loop, ch = sim_loop(recipe, sim_run(tmp_path, recipe))
    landed = drive_behind(loop, ch)
    assert [n for n, _, _ in landed] == [1, 2, 3, 4], "the last step's sync (its checkpoint follows) goes in series"
    for n, events, synced in landed:
        assert ("+", "train", str(n + 1)) in events, f"train {n + 1} was handed out before sync {n} landed"
        assert synced == n - 1, "not synced before it landed"
        # max_staleness 1: step n+2 may not be generated before step n's weights are on the engines
        assert ("+", "generate", str(n + 2)) not in events, (n, events)
    assert [t.kind for t in loop.tasks.pending.values()] == [], "every landing was taken"
    rows = metrics(loop.run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    overlapped = [r["step"] for r in rows if r.get("perf/weight_sync_overlapped") == 1.0]
    assert overlapped == [2, 3, 4, 5]
    assert all("perf/weight_pack_ahead_time" in r for r in rows[:4])
    loop.finish()


def test_off_the_sync_is_one_task_in_series(tmp_path):
    recipe = sim_recipe(tmp_path, *ASYNC, "train.overlap_sync=false")
    loop, ch = sim_loop(recipe, sim_run(tmp_path, recipe))
    landed = drive_behind(loop, ch)
    assert landed == [] and not any("perf/weight_sync_overlapped" in r for r in metrics(loop.run))
    loop.finish()


def test_a_sync_the_actor_pushes_in_series_after_all_drops_its_landing(tmp_path):
    """The actor may push in series though asked to push behind (adapters by directory, several sending ranks): the
    controller then expects no landing, and the run goes on as without overlap."""
    recipe = sim_recipe(tmp_path, *ASYNC)
    loop, ch = sim_loop(recipe, sim_run(tmp_path, recipe))
    assert drive_behind_in_series(loop, ch) == 5
    assert [r["step"] for r in metrics(loop.run)] == [1, 2, 3, 4, 5]
    assert not loop.tasks.pending and loop.landing is None
    loop.finish()


def drive_behind_in_series(loop, ch) -> int:
    from loop_sim import drive

    return sum(1 for k, _ in drive(loop, ch) if k == "sync")


@pytest.mark.parametrize("over, allowed", [
    (["mode=fully_async", "max_staleness=1"], True),
    (["mode=fully_async", "max_staleness=2"], True),
    (["mode=fully_async", "max_staleness=0"], False),
    (["mode=fully_async", "max_staleness=1", "staleness_mode=fixed"], False),
    (["mode=colocate"], False),
    (["mode=fully_async", "max_staleness=1", "train.overlap_sync=false"], False),
])
def test_auto_overlaps_where_the_staleness_bound_allows_it(tmp_path, over, allowed):
    assert overlap_sync(sim_recipe(tmp_path, *over)) is allowed


@pytest.mark.parametrize("over, why", [
    (["mode=colocate"], "mode is colocate"),
    (["mode=fully_async", "max_staleness=0"], "max_staleness is 0"),
    (["mode=fully_async", "max_staleness=1", "staleness_mode=fixed"], "staleness_mode is fixed"),
])
def test_true_is_refused_where_the_mode_does_not_allow_it(tmp_path, over, why):
    with pytest.raises(RecipeError) as e:
        sim_recipe(tmp_path, *over, "train.overlap_sync=true")
    text = str(e.value)
    assert "train.overlap_sync" in text and why in text and "Fix: overlap_sync: auto" in text, text
    assert overlap_sync(sim_recipe(tmp_path, *over, "train.overlap_sync=true", *(
        ["mode=fully_async", "max_staleness=1", "staleness_mode=bounded"]))) is True
