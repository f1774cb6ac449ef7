"""actor_fwd started again alone while the actor's sync is in flight (the role tier; the loop driven by hand,
:mod:`loop_sim`): the sync's report still names the weights the dead follower had taken, and those are not the new
ranks'. The loop counts actor_fwd as holding the model on disk until the actor has the new follower in its group and
a catch-up sync reached it; only then does actor_fwd get the next step's log-probs, with those weights."""

from __future__ import annotations

from loop_sim import answer, deliver_joins, sim_loop, sim_recipe, sim_run

from relax_hpc.controller import messages as M


def side(task: dict) -> dict:
    c = task["chunks"][0]
    name = c["path"].rsplit("/", 1)[1][: -len(".h5")]
    return {"chunk": f"step_{c['step']}/{name}", "writer": "actor_fwd", "file": f"{name}.actor_fwd.h5",
            "fields": ["log_probs"], "checksum": "s", "size": 1}


def test_a_follower_restarted_during_a_sync_is_not_taken_for_one_that_has_its_weights(tmp_path):
    recipe = sim_recipe(tmp_path, "run.steps=2", "roles.actor_fwd.enabled=true")
    loop, ch = sim_loop(recipe, sim_run(tmp_path, recipe))
    deliver_joins(loop, ch)
    urls = iter(["http://n4:9001", "http://n4:9002"])  # the follower's URL, then its new ranks'
    given: list[tuple[str, dict]] = []

    def step(until) -> dict:
        """Answer the tasks in the order handed out until ``until(role, task)``: that task, unanswered."""
        while True:
            role, task = ch.queue.pop(0)
            given.append((role, task))
            if until(role, task):
                return task
            if task["kind"] == "follow":
                res = M.FollowResult(url=next(urls))
            elif task["kind"] == "logprobs":
                res = M.LogprobsResult(sides=[side(task)])
            elif task["kind"] == "sync":
                res = M.SyncResult(engine_versions={"engine0": task["version"]},
                                   follower_versions={"actor_fwd": task["version"]})
            else:
                res = answer(loop, task, role)
            loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0, "result": res.to_dict()})
            deliver_joins(loop, ch)

    sync1 = step(lambda role, t: t["kind"] == "sync" and t["version"] == "1")
    assert loop.fwd["actor_fwd"] == 0  # before step 1's sync: the model on disk (step 0's weights)
    ch.drop = lambda role: [t for r, t in ch.queue if r == role]  # (FakeChannel has no queue per role; none held)
    loop.role_restarted("actor_fwd")  # killed while the actor pushes step 1's weights
    # the sync's report: the follower had taken them (its old ranks did), then died
    loop.on_message({"type": "task_done", "task_id": sync1["id"], "rank": 0, "result": M.SyncResult(
        engine_versions={"engine0": "1"}, follower_versions={"actor_fwd": "1"}).to_dict()})
    assert loop.fwd["actor_fwd"] == 0 and loop.refollow == "follow"  # the new ranks hold the model on disk
    assert not [t for r, t in ch.queue if t["kind"] == "logprobs"]  # no step 2 log-probs on weights it lacks
    lp2 = step(lambda role, t: t["kind"] == "logprobs" and t["chunks"][0]["step"] == 2)
    kinds = [(r, t["kind"], t.get("version")) for r, t in given]
    first, again = [i for i, k in enumerate(kinds) if k == ("actor_fwd", "follow", None)]
    assert first < kinds.index(("actor", "sync", "1")) < again  # the new ranks' follow, after the sync went out
    reconnect = kinds.index(("actor", "connect", None), again)
    assert ("actor", "sync", "1") in kinds[reconnect:]  # the catch-up sync to the new follower, after the reconnect
    connect = next(t for r, t in given[reconnect:] if t["kind"] == "connect")
    assert connect["followers"] == {"actor_fwd": "http://n4:9002"}
    assert lp2["version"] == "1" and loop.fwd["actor_fwd"] == 1
    loop.finish()
