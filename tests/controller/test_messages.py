"""The task and result messages: every kind round-trips through its dict (the wire keys), and a missing field, a
field the kind does not have or a value of the wrong type is a MessageError naming the message and the field."""

import json

import pytest

from relax_hpc.controller import messages as M

CHUNK = {"path": "/run/exchange/step_3/rollout-0.h5", "step": 3, "n": 4, "fields": ["tokens"], "checksum": "ab",
         "size": 100, "attrs": {}, "sides": []}
SIDE = {"chunk": "3/rollout-0", "writer": "reference", "file": "x.h5", "fields": ["ref_log_probs"], "checksum": "cd",
        "size": 10}
ENGINES = {"engine0": "http://127.0.0.1:8000", "engine1": "http://127.0.0.1:8001"}

JUDGES = {"judge0": "http://10.0.0.3:8002"}
TEACHERS = {"teacher0": "http://10.0.0.4:8003"}

# one instance of every kind, with every field set (and the wire dict it must give)
TASKS = [
    (M.StartEnginesTask(id=1), {"id": 1, "kind": "start_engines"}),
    (M.ConnectTask(id=2, engines=ENGINES, load=None, followers={"actor_fwd": "http://n4:9"}),
     {"id": 2, "kind": "connect", "engines": ENGINES, "load": None, "followers": {"actor_fwd": "http://n4:9"}}),
    (M.GenerateTask(id=3, step=3, engines=ENGINES, seq=2, data_state={"epoch": 0, "offset": 8}, judges=JUDGES,
                    teachers=TEACHERS),
     {"id": 3, "kind": "generate", "step": 3, "engines": ENGINES, "seq": 2, "data_state": {"epoch": 0, "offset": 8},
      "judges": JUDGES, "teachers": TEACHERS}),
    (M.LogprobsTask(id=4, chunks=[CHUNK]), {"id": 4, "kind": "logprobs", "chunks": [CHUNK]}),
    (M.LogprobsTask(id=4, chunks=[CHUNK], field="log_probs"),
     {"id": 4, "kind": "logprobs", "chunks": [CHUNK], "field": "log_probs"}),
    (M.LogprobsTask(id=4, chunks=[CHUNK], version="2"), {"id": 4, "kind": "logprobs", "chunks": [CHUNK], "version": "2"}),
    (M.FollowTask(id=11), {"id": 11, "kind": "follow"}),
    (M.LoadTask(id=5, path="/run/checkpoints"), {"id": 5, "kind": "load", "path": "/run/checkpoints"}),
    (M.TrainTask(id=6, step=3, chunks=[CHUNK]), {"id": 6, "kind": "train", "step": 3, "chunks": [CHUNK]}),
    (M.SyncTask(id=7, version="3", engines=ENGINES), {"id": 7, "kind": "sync", "version": "3", "engines": ENGINES}),
    (M.CheckpointTask(id=8, extra={"step": 3, "data": None}),
     {"id": 8, "kind": "checkpoint", "extra": {"step": 3, "data": None}}),
    (M.EvalTask(id=10, step=4, judges=JUDGES, engines=ENGINES),
     {"id": 10, "kind": "eval", "step": 4, "judges": JUDGES, "engines": ENGINES}),
    (M.StopTask(id=9), {"id": 9, "kind": "stop"}),
    # streaming within a step: a generate given again names the chunks streamed before; the actor's early π_old
    (M.GenerateTask(id=12, step=3, engines=ENGINES, seq=2, data_state=None, streamed=[0, 2]),
     {"id": 12, "kind": "generate", "step": 3, "engines": ENGINES, "seq": 2, "data_state": None, "judges": {},
      "teachers": {}, "streamed": [0, 2]}),
    (M.StageTask(id=13, step=3, chunks=[CHUNK]), {"id": 13, "kind": "stage", "step": 3, "chunks": [CHUNK]}),
]
RESULTS = [
    (M.StartEnginesResult(engines=ENGINES, pids={"engine0": 11, "engine1": 12},
                          nodes={"engine0": "n1", "engine1": "n2"}, data_state={"epoch": 0}),
     {"engines": ENGINES, "pids": {"engine0": 11, "engine1": 12}, "nodes": {"engine0": "n1", "engine1": "n2"},
      "data_state": {"epoch": 0}}),
    (M.ConnectResult(engines=["engine0", "engine1"], loaded_step=4, weights="over a nccl group"),
     {"engines": ["engine0", "engine1"], "loaded_step": 4, "weights": "over a nccl group"}),
    (M.GenerateResult(metrics={"rollout/raw_reward": 0.5}, chunks=[CHUNK], n=4, weight_versions=["2"],
                      data_state={"epoch": 0}, reward_failures=[{"index": 1, "error": "boom"}],
                      engine_failures=[{"name": "engine1", "url": "http://x", "error": "gone"}],
                      dead_engines={"engine1": "gone"}, engine_requests={"engine0": 32}),
     {"chunks": [CHUNK], "metrics": {"rollout/raw_reward": 0.5}, "n": 4, "weight_versions": ["2"],
      "data_state": {"epoch": 0}, "reward_failures": [{"index": 1, "error": "boom"}],
      "engine_failures": [{"name": "engine1", "url": "http://x", "error": "gone"}],
      "dead_engines": {"engine1": "gone"}, "engine_requests": {"engine0": 32}}),
    (M.LogprobsResult(sides=[SIDE], metrics={"perf/ref_log_probs_time": 1.5}),
     {"sides": [SIDE], "metrics": {"perf/ref_log_probs_time": 1.5}}),
    (M.FollowResult(url="http://n4:9"), {"url": "http://n4:9"}),
    (M.LoadResult(step=4), {"step": 4}),
    (M.TrainResult(metrics={"train/loss": 0.25, "perf/train_time": 3}, skipped=["optimizer step 3: loss = nan"]),
     {"metrics": {"train/loss": 0.25, "perf/train_time": 3}, "skipped": ["optimizer step 3: loss = nan"]}),
    (M.SyncResult(metrics={"weights/versions_ok": 1.0}, engine_versions={"engine0": "3", "engine1": None},
                  checks={"engine0": {"fingerprint_equal": True}}, dead_engines={}, follower_versions={"actor_fwd": "3"}),
     {"metrics": {"weights/versions_ok": 1.0}, "engine_versions": {"engine0": "3", "engine1": None},
      "checks": {"engine0": {"fingerprint_equal": True}}, "dead_engines": {}, "follower_versions": {"actor_fwd": "3"}}),
    (M.CheckpointResult(path="/run/checkpoints/step_3", metrics={"perf/save_model_time": 0.1}),
     {"path": "/run/checkpoints/step_3", "metrics": {"perf/save_model_time": 0.1}}),
    (M.EvalResult(metrics={"eval/arith": 0.5, "eval/arith-pass@2": 0.75, "perf/eval_time": 2}),
     {"metrics": {"eval/arith": 0.5, "eval/arith-pass@2": 0.75, "perf/eval_time": 2}}),
    (M.StopResult(), {}),
    (M.StageResult(metrics={"perf/actor_stage_time": 0.5}), {"metrics": {"perf/actor_stage_time": 0.5}}),
]


def test_every_kind_has_a_task_and_a_result():
    assert set(M.TASKS) == set(M.RESULTS) == {"generate", "logprobs", "train", "sync", "checkpoint", "load", "connect",
                                              "start_engines", "eval", "stop", "follow", "stage"}
    assert {type(t).kind for t, _ in TASKS} == set(M.TASKS)
    assert {type(r).kind for r, _ in RESULTS} == set(M.RESULTS)


@pytest.mark.parametrize("task,wire", TASKS, ids=lambda x: getattr(x, "kind", ""))
def test_tasks_round_trip_through_their_wire_dict(task, wire):
    assert task.to_dict() == wire
    assert list(task.to_dict())[:2] == ["id", "kind"]
    back = json.loads(json.dumps(task.to_dict()))  # what the role's next_task gets
    assert M.decode_task(back) == task
    assert type(task).from_dict(back) == task


@pytest.mark.parametrize("result,wire", RESULTS, ids=lambda x: getattr(x, "kind", ""))
def test_results_round_trip_through_their_wire_dict(result, wire):
    kind = type(result).kind
    assert result.to_dict() == wire
    assert M.encode_result(kind, result) == wire
    back = json.loads(json.dumps(wire))  # what the controller's task_done gets
    assert M.decode_result(kind, back) == result


def test_an_error_result_decodes_as_task_error_whatever_the_kind():
    for kind in M.RESULTS:
        assert M.decode_result(kind, {"error": "RuntimeError: boom", "restartable": True}) == \
            M.TaskError(error="RuntimeError: boom", restartable=True)
    assert M.decode_result("train", {"error": "X: y"}).restartable is False
    with pytest.raises(M.MessageError, match="'restartable': expected bool, got str"):
        M.decode_result("train", {"error": "X: y", "restartable": "yes"})


def _fields(cls):
    import dataclasses

    return [f for f in dataclasses.fields(cls) if f.name != "id"]


def _required(cls):
    import dataclasses

    return [f.name for f in _fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


WITH_REQUIRED = [(m, w) for m, w in TASKS + RESULTS if _required(type(m))]


@pytest.mark.parametrize("msg,wire", WITH_REQUIRED, ids=lambda x: getattr(x, "kind", ""))
def test_a_missing_field_names_the_message_and_the_field(msg, wire):
    cls = type(msg)
    for name in _required(cls):
        bad = {k: v for k, v in wire.items() if k != name}
        with pytest.raises(M.MessageError) as e:
            cls.from_dict(bad)
        assert (e.value.message, e.value.field) == (f"{cls.kind} {cls.what}", name)
        assert f"malformed {cls.kind} {cls.what}: field {name!r}" in str(e.value) and "missing" in str(e.value)


def test_a_missing_task_id_or_kind():
    with pytest.raises(M.MessageError, match="malformed train task: field 'id': expected int, got nothing"):
        M.decode_task({"kind": "train", "step": 3, "chunks": []})
    with pytest.raises(M.MessageError, match="malformed task: field 'kind': expected one of start_engines, .*got null"):
        M.decode_task({"id": 1, "step": 3, "chunks": []})
    with pytest.raises(M.MessageError, match="field 'kind': expected one of .*got str 'fly'"):
        M.decode_task({"id": 1, "kind": "fly"})
    with pytest.raises(M.MessageError, match="malformed sync task: field 'kind': expected 'sync', got str 'train'"):
        M.SyncTask.from_dict({"id": 1, "kind": "train", "version": "1", "engines": {}})
    with pytest.raises(M.MessageError, match="malformed task: .*expected a JSON object, got list"):
        M.decode_task([1, 2])


@pytest.mark.parametrize("msg,wire", TASKS + RESULTS, ids=lambda x: getattr(x, "kind", ""))
def test_an_unknown_field_names_the_message_and_the_field(msg, wire):
    cls = type(msg)
    with pytest.raises(M.MessageError) as e:
        cls.from_dict({**wire, "stepp": 3})
    assert (e.value.message, e.value.field) == (f"{cls.kind} {cls.what}", "stepp")
    assert "no such field" in str(e.value) and "got int 3" in str(e.value)


def _wrong_value(tp):
    """A JSON value that is not of annotation ``tp`` (every field's annotation has one)."""
    for candidate in ("x", 1.5, [], {}, True, None, 7):
        if not M._fits(candidate, tp):
            return candidate
    raise AssertionError(tp)


@pytest.mark.parametrize("msg,wire", [(m, w) for m, w in TASKS + RESULTS if _fields(type(m))],
                         ids=lambda x: getattr(x, "kind", ""))
def test_a_wrong_type_names_the_message_the_field_and_the_expected_type(msg, wire):
    import typing

    cls = type(msg)
    hints = typing.get_type_hints(cls)
    for f in _fields(cls):
        if hints[f.name] is typing.Any:
            continue
        value = _wrong_value(hints[f.name])
        with pytest.raises(M.MessageError) as e:
            cls.from_dict({**wire, f.name: value})
        assert (e.value.message, e.value.field) == (f"{cls.kind} {cls.what}", f.name)
        assert e.value.got.startswith("null" if value is None else type(value).__name__)
        with pytest.raises(M.MessageError):  # made in code: the same check
            cls(**{**{k: v for k, v in wire.items() if k not in ("kind",)}, f.name: value})


def test_wrong_types_inside_containers_and_bools_for_ints():
    good = M.GenerateTask(id=1, step=2, engines=ENGINES, seq=0, data_state=None).to_dict()
    with pytest.raises(M.MessageError, match=r"field 'engines': expected dict\[str, str\], got dict"):
        M.decode_task({**good, "engines": {"engine0": 8000}})
    with pytest.raises(M.MessageError, match="field 'step': expected int, got bool True"):
        M.decode_task({**good, "step": True})
    with pytest.raises(M.MessageError, match=r"field 'data_state': expected dict \| None, got str"):
        M.decode_task({**good, "data_state": "cursor"})
    with pytest.raises(M.MessageError, match=r"'chunks': expected list\[ChunkRef\], got list \['a'\]"):
        M.decode_result("generate", {"chunks": ["a"]})
    assert M.decode_result("train", {"metrics": {"train/loss": 1}}) == M.TrainResult(metrics={"train/loss": 1})
    with pytest.raises(M.MessageError, match=r"malformed eval result: field 'metrics': expected dict\[str, float\]"):
        M.decode_result("eval", {"metrics": {"eval/arith": "high"}})  # eval metrics are numbers
    with pytest.raises(M.MessageError, match="malformed eval task: field 'step': expected int, got float"):
        M.decode_task({"id": 1, "kind": "eval", "step": 2.0})


def test_message_error_is_a_value_error_with_a_clear_text():
    with pytest.raises(ValueError) as e:
        M.decode_task({"id": 1, "kind": "load", "path": None})
    assert str(e.value).startswith("malformed load task: field 'path': expected str, got null")
    assert e.value.expected == "str" and e.value.got == "null"


def test_optional_fields_may_be_absent_and_omit_none_ones_are_not_sent():
    assert M.decode_result("start_engines", {"engines": ENGINES}) == M.StartEnginesResult(engines=ENGINES)
    assert M.decode_result("connect", {"engines": []}).loaded_step is None
    assert "field" not in M.LogprobsTask(id=1, chunks=[]).to_dict()  # sent only when set
    assert M.decode_task({"id": 1, "kind": "logprobs", "chunks": []}).field is None
    # nullable but always sent: the controller's generate and connect carry an explicit null
    assert M.GenerateTask(id=1, step=1, engines={}, seq=0, data_state=None).to_dict()["data_state"] is None
    with pytest.raises(M.MessageError, match="'data_state'.*missing"):
        M.decode_task({"id": 1, "kind": "generate", "step": 1, "engines": {}, "seq": 0})


def test_encode_result_checks_the_kind_and_fills_the_empty_result():
    assert M.encode_result("stop", None) == {}
    assert M.encode_result("eval", None) == {"metrics": {}}
    assert M.encode_result("logprobs", None) == {"sides": [], "metrics": {}}
    with pytest.raises(M.MessageError, match="malformed load result: .*expected LoadResult, got None"):
        M.encode_result("load", None)  # a result with a required field must be returned
    with pytest.raises(M.MessageError, match="malformed train result: .*expected TrainResult, got SyncResult"):
        M.encode_result("train", M.SyncResult())
    with pytest.raises(M.MessageError, match="expected TrainResult, got dict"):
        M.encode_result("train", {"metrics": {}})


def test_chunk_and_side_refs_are_decoded_once_into_their_types():
    """Nested refs arrive typed (every reader gets ChunkRef/SideRef, no hand decoding) and leave as the same JSON."""
    from relax_hpc.exchange.chunk import ChunkRef, SideRef

    side_in = {**SIDE, "chunk": "step_3/rollout-0"}
    task = M.decode_task({"id": 6, "kind": "train", "step": 3, "chunks": [{**CHUNK, "sides": [side_in]}]})
    (ref,) = task.chunks
    assert isinstance(ref, ChunkRef) and ref.n == 4 and isinstance(ref.sides[0], SideRef)
    assert ref.all_fields == {"tokens", "ref_log_probs"}
    assert task.to_dict()["chunks"] == [{**CHUNK, "sides": [side_in]}]  # the wire dict, unchanged
    assert M.TrainTask(id=6, step=3, chunks=[ref]) == task  # made in code from the typed ref: the same message
    res = M.decode_result("logprobs", {"sides": [SIDE]})
    assert res.sides == [SideRef.from_dict(SIDE)] and json.loads(json.dumps(res.to_dict())) == {"sides": [SIDE],
                                                                                               "metrics": {}}
    assert M.decode_result("generate", {"chunks": [CHUNK]}).chunks == [ChunkRef.from_dict(CHUNK)]


def test_a_malformed_ref_names_the_field_and_what_it_lacks():
    with pytest.raises(M.MessageError, match=r"malformed train task: field 'chunks': expected list\[ChunkRef\], "
                                             r"got list .*\(KeyError: 'checksum'\)"):
        M.decode_task({"id": 1, "kind": "train", "step": 3, "chunks": [{k: v for k, v in CHUNK.items()
                                                                        if k != "checksum"}]})
    with pytest.raises(M.MessageError, match=r"malformed logprobs result: field 'sides': expected list\[SideRef\]"):
        M.decode_result("logprobs", {"sides": [{"chunk": "c"}]})
    with pytest.raises(M.MessageError, match=r"field 'sides': expected list\[SideRef\], got list \[7\]"):
        M.LogprobsResult(sides=[7])
