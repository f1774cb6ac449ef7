"""Streaming within a step (``rollout.stream_groups``), the loop's side, driven by hand (:mod:`loop_sim`): chunks
reported by ``chunk_ready`` while the generate runs are announced at once, the reference gets them one chunk a task
and the idle actor its π_old pass (``stage``) before the step's last response; the train task takes the step's
chunks in seq order whatever order they landed in; a report of a generate no longer in flight is dropped; a
generate given again to a rollout role started alone names the chunks already announced; with one optimizer step a
rollout step no π_old pass is staged (the update's own forward is π_old)."""

from __future__ import annotations

from loop_sim import answer, deliver_joins, sim_loop, sim_recipe, sim_run

from relax_hpc.controller import messages as M
from relax_hpc.exchange.fields import PRODUCER, task_fields

# two optimizer steps a rollout step: π_old is a pass of its own before the first (with one, it is the update's own
# forward and nothing is staged: the last test)
STREAM = ("rollout.stream_groups=2", "rollout.rollout_batch_size=8", "algorithm.use_kl_loss=true",
          "roles.reference.enabled=true", "run.steps=2", "train.num_steps_per_rollout=2")


def chunk(loop, n: int, seq: int) -> dict:
    return {"path": str(loop.broker.root / f"step_{n}" / f"chunk_{PRODUCER}_{seq}.h5"), "step": n, "n": 4,
            "fields": list(task_fields("train", (PRODUCER,))), "checksum": f"c{seq}", "size": 1, "attrs": {},
            "sides": []}


def side(c: dict, writer: str) -> dict:
    name = c["path"].rsplit("/", 1)[1][: -len(".h5")]
    return {"chunk": f"step_{c['step']}/{name}", "writer": writer, "file": f"{name}.{writer}.h5",
            "fields": ["ref_log_probs"], "checksum": "s", "size": 1}


def done(loop, task: dict, res: M.ResultMessage) -> None:
    loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0, "result": res.to_dict()})


def take(ch, kind: str) -> tuple[str, dict]:
    i = next(i for i, (_, t) in enumerate(ch.queue) if t["kind"] == kind)
    return ch.queue.pop(i)


def started(tmp_path, *over: str):
    """A loop of the recipe with ``over``, its run started (engines, connect): (loop, channel, the first generate)."""
    recipe = sim_recipe(tmp_path, *over)
    loop, ch = sim_loop(recipe, sim_run(tmp_path, recipe))
    deliver_joins(loop, ch)
    for kind in ("start_engines", "connect"):
        role, t = take(ch, kind)
        done(loop, t, answer(loop, t, role))
    return loop, ch, take(ch, "generate")[1]


def test_streamed_chunks_start_the_forward_passes_before_the_step_is_whole(tmp_path):
    loop, ch, gen = started(tmp_path, *STREAM)
    n, seq = gen["step"], gen["seq"]
    chunks = [chunk(loop, n, seq + k) for k in range(4)]
    # a report of no generate in flight (a task id the loop never gave out): dropped, nothing announced
    loop.on_message({"type": "chunk_ready", "role": "rollout", "rank": 0, "task_id": 999, "chunk": chunks[3]})
    assert loop.broker.chunks(n) == []
    for k in (2, 0):  # landed out of order: chunk 2's groups were done first
        loop.on_message({"type": "chunk_ready", "role": "rollout", "rank": 0, "task_id": gen["id"], "chunk": chunks[k]})
    assert [c.name for c in loop.broker.chunks(n)] == [f"chunk_{PRODUCER}_{seq + k}" for k in (2, 0)]
    # before the generate's result: the reference and the actor (its π_old pass) have the first chunk that landed,
    # each idle when it came; the second goes to each once it is done with the first
    _, ref = take(ch, "logprobs")
    assert [c["path"] for c in ref["chunks"]] == [chunks[2]["path"]]
    _, stage = take(ch, "stage")
    assert stage["step"] == n and [c["path"] for c in stage["chunks"]] == [chunks[2]["path"]]
    done(loop, ref, M.LogprobsResult(sides=[side(chunks[2], "reference")]))
    done(loop, stage, M.StageResult(metrics={"perf/actor_stage_time": 0.5}))
    _, stage = take(ch, "stage")
    assert [c["path"] for c in stage["chunks"]] == [chunks[0]["path"]]
    # a chunk the early pass could not read does not end the run: the train task reads it again and reports it
    done(loop, stage, M.TaskError(error="DamagedChunk: chunk_rollout_0.h5: checksum", restartable=False))
    assert loop.state.running and not any(t["kind"] == "stage" for _, t in ch.queue)
    _, ref = take(ch, "logprobs")
    assert [c["path"] for c in ref["chunks"]] == [chunks[0]["path"]]
    done(loop, ref, M.LogprobsResult(sides=[side(chunks[0], "reference")]))
    assert not any(t["kind"] == "train" for _, t in ch.queue)  # the step is not whole yet
    # the generate's result lists every chunk (the two streamed again: idempotent) and the step ends
    done(loop, gen, M.GenerateResult(chunks=chunks, n=16, weight_versions=["0"], data_state={"offset": 8}))
    for k in (1, 3):
        _, ref = take(ch, "logprobs")
        assert [c["path"] for c in ref["chunks"]] == [chunks[k]["path"]]
        done(loop, ref, M.LogprobsResult(sides=[side(chunks[k], "reference")]))
    _, train = take(ch, "train")
    assert [c["path"] for c in train["chunks"]] == [c["path"] for c in chunks]  # seq order, not landing order
    assert loop.rows.cur[n]["perf/actor_stage_time"] == 0.5


def test_a_generate_given_again_names_the_chunks_already_streamed(tmp_path):
    loop, ch, gen = started(tmp_path, *STREAM)
    n, seq = gen["step"], gen["seq"]
    for k in (1, 3):
        loop.on_message({"type": "chunk_ready", "role": "rollout", "rank": 0, "task_id": gen["id"],
                         "chunk": chunk(loop, n, seq + k)})
    def drop(role: str) -> list[dict]:  # the channel's queue of the role restarted alone (FakeChannel has none)
        mine = [t for r, t in ch.queue if r == role]
        ch.queue[:] = [(r, t) for r, t in ch.queue if r != role]
        return mine

    ch.drop = drop
    loop.role_restarted("rollout")
    again = next(t for r, t in ch.queue if r == "rollout" and t["kind"] == "generate" and t["id"] != gen["id"])
    assert again["step"] == n and again["seq"] == seq and again["streamed"] == [1, 3]
    # the dead attempt's late report is of no task now: dropped
    loop.on_message({"type": "chunk_ready", "role": "rollout", "rank": 0, "task_id": gen["id"],
                     "chunk": chunk(loop, n, seq + 0)})
    assert sorted(c.name for c in loop.broker.chunks(n)) == [f"chunk_{PRODUCER}_{seq + k}" for k in (1, 3)]


def test_one_optimizer_step_a_rollout_step_stages_no_old_log_prob_pass(tmp_path):
    """π_old of a one-update step is the update's own forward (relax_hpc.train.config.old_from_train_forward): the
    idle actor gets no stage task for the landed chunks; the reference still takes them one by one."""
    loop, ch, gen = started(tmp_path, *STREAM[:-1])  # num_steps_per_rollout unset: one step
    n, seq = gen["step"], gen["seq"]
    for k in (0, 1):
        loop.on_message({"type": "chunk_ready", "role": "rollout", "rank": 0, "task_id": gen["id"],
                         "chunk": chunk(loop, n, seq + k)})
    _, ref = take(ch, "logprobs")
    assert [c["path"] for c in ref["chunks"]] == [chunk(loop, n, seq)["path"]]
    assert loop._idle("actor") and not any(t["kind"] == "stage" for _, t in ch.queue)
