"""The rollout role's logic (relax_hpc.rollout.generator) in this process, on a real run directory, with the real
chunk writer and a real driver against stub engines over HTTP (and, for partial rollout's generate-again path, a CPU
engine): the task's rollout state wins over the generator's memory; a buffer nothing can name any more is deleted,
and none while a checkpoint is being written; MoE routing replay's rows; prompt attrs; OPD's teacher. The entry point
(task in, reply out) is tests/roles/test_rollout.py."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from relax_hpc.algo.config import OPDConfig
from relax_hpc.exchange.audit import chunk_prompts
from relax_hpc.recipe import recipe_from_dict
from relax_hpc.rollout.generator import MAX_PROMPT_ATTRS, Generator, NoMorePrompts, Outlets
from relax_hpc.rollout.state import BufferRef, DataState
from relax_hpc.rundir import create_run_dir
from relax_hpc.rollout.write import write_step
from relax_hpc.train.latest import complete
from relax_hpc.train.samples import read_samples
from tests.engines.stub_http import StubHandler, StubServer
from tests.rollout.conftest import import_source, tiny_llama  # noqa: F401 - a fixture, used by name

PROMPTS = 8


class Engine:
    """A stub SGLang engine: every ``POST /generate`` gets a valid two-token answer with weight version 3 (asked
    ``return_routed_experts``: SGLang's ids for every token it ran, 2 layers × top-2, token t's all t % 4)."""

    def __init__(self) -> None:
        self.calls = 0
        outer = self

        class Handler(StubHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/generate":
                    return self.send_json(200, b"{}")
                outer.calls += 1
                meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                        "completion_tokens": 2, "output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None]],
                        "weight_version": "3"}
                req = json.loads(body or b"{}")
                if req.get("return_routed_experts"):
                    ran = len(req["input_ids"]) + 2 - 1
                    ids = np.repeat(np.arange(ran, dtype="<i4") % 4, 4)
                    meta.update(prompt_tokens=len(req["input_ids"]),
                                routed_experts=base64.b64encode(ids.tobytes()).decode())
                return self.send_json(200, json.dumps({"text": "ab", "output_ids": [5, 6],
                                                       "meta_info": meta}).encode())

            def do_GET(self):
                self.send_json(200, b"{}")

        self.http = StubServer(Handler)
        self.url = self.http.url


class Teacher:
    """A stub SGLang teacher answering scoring requests: response position j (from 1) gets log-prob -0.1·j
    (``mode`` "bad": +0.5, a log-prob above 0; "down": every call a 503). Records each call's API key."""

    def __init__(self, mode: str = "ok") -> None:
        self.calls, self.keys = 0, []
        outer = self

        class Handler(StubHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                outer.calls += 1
                outer.keys.append(self.headers.get("Authorization"))
                if mode == "down":
                    return self.send_json(503, b"{}")
                out = []
                for ids, k in zip(body["input_ids"], body["logprob_start_len"]):
                    rows = [[None, ids[k], None]] + [[0.5 if mode == "bad" else -0.1 * j, ids[k + j], None]
                                                     for j in range(1, len(ids) - k)]
                    out.append({"text": "", "output_ids": [], "meta_info": {
                        "id": "t", "finish_reason": {"type": "length", "length": 0}, "input_token_logprobs": rows,
                        "weight_version": "0"}})
                return self.send_json(200, json.dumps(out).encode())

        self.http = StubServer(Handler)
        self.url = self.http.url


def stubs(cls):
    made: list = []

    def make(*args):
        made.append(cls(*args))
        return made[-1]

    return made, make


@pytest.fixture
def engines():
    made, make = stubs(Engine)
    yield make
    for e in made:
        e.http.close()


@pytest.fixture
def teachers():
    made, make = stubs(Teacher)
    yield make
    for t in made:
        t.http.close()


def outlets() -> Outlets:
    """The role's outlets, the real writer and checkpoint list; no streaming here, so nothing is announced."""
    def announce(task_id, ref):
        raise AssertionError(f"announced {ref} without streaming")

    return Outlets(write_step=write_step, announce=announce, complete=complete)


def make_generator(recipe, run) -> Generator:
    moved: list[int] = []
    gen = Generator(recipe, run, outlets(), resolve=str, progress=lambda n=1: moved.append(n))
    gen.moved = moved  # the progress the role's heartbeats would show
    return gen


@pytest.fixture
def role(tmp_path, tiny_llama):  # noqa: F811 - the fixture imported above
    """``make(**rollout)``: a Generator on a run directory of its own (a recipe with ``PROMPTS`` prompts)."""
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(PROMPTS):
            f.write(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n")
    names = itertools.count()

    def make(train: dict | None = None, **rollout) -> Generator:
        recipe = recipe_from_dict({
            "train": train or {},
            "model": {"path": str(tiny_llama)},
            "data": {"path": str(tmp_path / "p.jsonl"), "input_key": "q", "label_key": "a"},
            # the stub engines answer one prompt per request: a group goes sample by sample
            "rollout": {"rm_type": "math", "n_samples_per_prompt": 2, "rollout_batch_size": 2,
                        "max_response_len": 2, "batch_group_requests": False, **rollout},
            **({"mode": "fully_async", "max_staleness": 1} if rollout.get("partial_rollout") else {})})
        return make_generator(recipe, create_run_dir(tmp_path / "runs", f"r{next(names)}"))

    return make


_seq = itertools.count(1)


def step(gen: Generator, n: int, engines: dict[str, str], start: DataState | None, **kw):
    return gen.generate(n, seq=next(_seq), engines=engines, start=start, **kw)


def groups(result) -> list[int]:
    return chunk_prompts(result.chunks[0].attrs)[1]


def test_a_step_is_generated_on_the_engines_it_is_given_and_the_start_state_wins(role, engines):
    a, b = engines(), engines()
    gen = role()
    s0 = gen.state(0)
    assert s0.sample_group_index == 0 and s0.partial is None and gen.current == s0

    r1 = step(gen, 1, {"a": a.url, "b": b.url}, s0)
    assert r1.n == 4 and r1.weight_versions == ["3"] and r1.engine_failures == [] and r1.dead_engines == {}
    assert sum(r1.engine_requests.values()) == a.calls + b.calls == 4 and set(r1.engine_requests) <= {"a", "b"}
    assert chunk_prompts(r1.chunks[0].attrs) == (PROMPTS, [0, 1])  # the audit counts prompts per epoch with it
    got = read_samples(r1.chunks, ("tokens", "group_index"))
    assert sorted(s["group_index"] for s in got) == [0, 0, 1, 1] and all(list(s["tokens"][-2:]) == [5, 6] for s in got)
    assert r1.state == gen.current and r1.state.cursor() == gen.data.state_dict() and r1.state.sample_group_index == 2
    assert sum(gen.moved) >= 4  # its heartbeats show the work moving (a stalled task is taken for hung)
    assert {"rollout/queue_per_engine", "perf/exchange_write_time", "perf/rollout_time"} <= set(r1.metrics)

    asked_a = a.calls
    r2 = step(gen, 2, {"b": b.url}, None)  # a left the registry; no state: where the generator stands
    assert r2.engine_requests == {"b": 4} and a.calls == asked_a and groups(r2) == [2, 3]
    r3 = step(gen, 3, {}, None)  # no engine named: the last ones
    assert r3.engine_requests == {"b": 4} and groups(r3) == [4, 5]

    again = step(gen, 2, {"a": a.url}, r1.state)  # step 2 again (its chunk damaged): its prompts
    assert groups(again) == [2, 3] and again.state == r2.state and again.engine_requests == {"a": 4}
    with pytest.raises(ValueError, match="an eval task came, but there is no eval set"):
        gen.evaluate(3, engines=None)


def test_with_routing_replay_the_chunk_carries_each_token_s_engine_experts(role, engines):
    """``train.routing_replay``: the generator asks for the routed experts and its chunk carries, per sample, one
    row of ids per token but the last: the engine's where it ran the token, -1 where no engine did (the placeholder
    token of a sample failed before any generation: the step goes on)."""
    from relax_hpc.rollout.sample import SampleStatus

    e = engines()
    gen = role(train={"routing_replay": True})
    r1 = step(gen, 1, {"e": e.url}, gen.state(0))
    got = read_samples(r1.chunks, ("tokens", "routed_experts"))
    assert len(got) == 4 and gen.routed_width == 4
    for s in got:
        ran = len(s["tokens"]) - 1
        assert s["routed_experts"].tolist() == np.repeat(np.arange(ran) % 4, 4).tolist()

    steps = gen.driver.generate_rollout_sync

    def one_failed(groups, **kw):  # the first sample fails before its engine call (an env error, a bad image)
        res = steps(groups, **kw)
        s = res.samples[0]
        s.reset_response(s.tokens[: s.prompt_length])
        s.append_response([0], "", [0.0], loss_mask_value=0)
        s.status = SampleStatus.FAILED
        return res

    gen.driver.generate_rollout_sync = one_failed
    got = read_samples(step(gen, 2, {"e": e.url}, None).chunks, ("tokens", "routed_experts"))
    assert got[0]["routed_experts"].reshape(-1, 4).tolist() == [[-1] * 4] * (len(got[0]["tokens"]) - 1)
    assert (got[1]["routed_experts"] >= 0).all()
    assert "routed_experts" not in step(role(), 1, {"e": e.url}, None).chunks[0].fields  # key off


def test_the_given_state_wins_and_a_buffer_without_partial_rollout_is_dropped_loudly(role, caplog):
    gen = role()
    s0 = gen.state(0)
    gen.data.get_samples(3)
    s1 = gen.state(1)
    assert s1.sample_group_index == 3
    gen.restore(s0)  # a step generated again, or a restarted role: where the task says, not where it stood
    assert gen.data.state_dict() == s0.cursor() and gen.current == s0
    buffer = BufferRef(file="partial_rollout/after_00000001_0123456789abcdef.json", groups=2, samples=4)
    with caplog.at_level(logging.WARNING, logger="relax_hpc.rollout"):
        gen.restore(dataclasses.replace(s1, partial=buffer))  # saved by a run with partial rollout, resumed without
    assert gen.data.state_dict()["sample_group_index"] == 3
    assert "rollout.partial_rollout is off: the 2 prompt groups of the buffer saved with the data cursor " \
           "(partial_rollout/after_00000001_0123456789abcdef.json) are dropped, never trained" in caplog.text


def test_saved_buffers_are_deleted_once_nothing_can_name_them(role):
    """max_staleness 1: after step s, the buffers of steps below s - 3 go, unless a complete checkpoint names one
    (as its cursor's, or, staleness_mode fixed, as the kept cursor's); none goes while a checkpoint is half written
    or one's meta.json cannot be read here."""
    gen = role(partial_rollout=True, over_sampling_batch_size=4)
    run = gen.run.path
    (run / "partial_rollout").mkdir(exist_ok=True)
    files = {n: run / "partial_rollout" / f"after_{n:08d}_{n:016x}.json" for n in range(1, 8)}
    for f in files.values():
        f.write_text("{}")
    gen.made = {n: None for n in files}

    def named(n: int) -> dict:
        return {"partial": {"file": f"partial_rollout/{files[n].name}", "groups": 1}}

    def left() -> list[int]:
        return [n for n, f in files.items() if f.exists()]

    ckpts = run / "checkpoints"
    (ckpts / "step_00000002").mkdir(parents=True)
    (ckpts / "step_00000002" / "meta.json").write_text(json.dumps({"extra_state": {"data": named(1)}}))
    (ckpts / "step_00000003").mkdir()  # being written: which buffer it names is not known yet
    gen.state(6)
    assert left() == list(files) and set(gen.made) == set(files)

    (ckpts / "step_00000003" / "meta.json").write_text(json.dumps({"extra_state": "pickled"}))
    gen.state(6)  # a meta.json this role cannot read: keep everything
    assert left() == list(files)

    (ckpts / "step_00000003" / "meta.json").write_text(json.dumps({"extra_state": {"kept": {"data": named(2)}}}))
    gen.state(7)  # 1 and 2 named; 3 the last one below 7 - 3
    assert left() == [1, 2, 4, 5, 6, 7] and set(gen.made) == {4, 5, 6, 7}
    assert gen.current.to_dict() == {**gen.data.state_dict(), "partial": {"groups": 0, "samples": 0}}  # empty


def test_a_step_generated_again_draws_no_prompt_of_its_own():
    assert NoMorePrompts().get_samples(0) == []
    with pytest.raises(RuntimeError, match="asked for 1 more prompt groups: it may use only its own"):
        NoMorePrompts().get_samples(1)


def test_prompt_attrs_too_large_for_a_chunk_are_left_out(role, caplog):
    gen = role()
    assert gen._prompt_attrs([SimpleNamespace(group_index=g) for g in (3, 0, 1)]) == \
        {"prompts": {"per_epoch": PROMPTS, "groups": [[0, 2], [3, 4]]}}
    scattered = [SimpleNamespace(group_index=g) for g in range(0, 8 * MAX_PROMPT_ATTRS // 10, 2)]
    with caplog.at_level(logging.WARNING, logger="relax_hpc.rollout"):
        assert gen._prompt_attrs(scattered) == {}
    assert "relax-status --audit cannot count its prompts" in caplog.text


def test_with_opd_the_teacher_scores_every_response_token_and_the_chunk_carries_them(role, engines, teachers):
    """``opd:`` on (set past validation, which refuses it until the objective is in the training step): after the
    reward, the step's teachers score each sample's response tokens; the chunk carries them as teacher_log_probs
    and the step's metrics opd/*. A teacher that fails for good, or gives no good numbers, fails the step."""
    from relax_hpc.errors import is_permanent
    from relax_hpc.rollout.teacher import TeacherError

    a, t = engines(), teachers()
    gen = role()
    gen.recipe = dataclasses.replace(gen.recipe, opd=OPDConfig(teacher_model_path="/t", teacher_timeout_s=3.0))
    r = step(gen, 1, {"a": a.url}, None, teachers={"teacher0": t.url})
    got = read_samples(r.chunks, ("response_length", "teacher_log_probs"))
    assert len(got) == 4 and all(list(s["teacher_log_probs"]) == pytest.approx([-0.1, -0.2]) for s in got)
    assert r.metrics["opd/teacher_calls"] == t.calls >= 1 and r.metrics["opd/teacher_bad_samples"] == 0
    assert set(t.keys) == {f"Bearer {gen.run.api_key()}"}  # the run's own teacher engines want its key

    ext = teachers()  # opd.teacher_url: a server outside the run never gets the run's key
    step(gen, 2, {"a": a.url}, None, teachers={"opd.teacher_url": ext.url})
    assert ext.calls >= 1 and set(ext.keys) == {None}

    with pytest.raises(TeacherError, match="gave no answer .* within teacher timeout_s"):
        step(gen, 3, {"a": a.url}, None, teachers={"teacher0": teachers("down").url})
    with pytest.raises(TeacherError, match="gave 4 of 4 samples no usable log-probs.*is 0.5 > 0") as bad:
        step(gen, 3, {"a": a.url}, None, teachers={"teacher0": teachers("bad").url})
    assert is_permanent(bad.value)  # the same tokens would get the same numbers: no restart
    with pytest.raises(ValueError, match="names no teacher"):
        step(gen, 3, {"a": a.url}, None)
    assert not list((gen.run.path / "exchange" / "step_3").glob("*.h5"))  # no step without teacher numbers
    gen.close()


REWARDS = '''
    def reward_func(args, sample, **kwargs):
        """Prompts with an even i: every sample scores 0; odd i: 0 or 1."""
        i = sample.metadata["i"]
        return 0.0 if i % 2 == 0 else float(sample.index % 2)
'''


@pytest.fixture
def partial(tmp_path, tiny_llama, cpu_engine, monkeypatch):  # noqa: F811 - the fixture imported above
    """A Generator with partial rollout on the module's CPU engine; ``make()`` builds another, as a restarted role
    would."""
    from relax_hpc.recipe.schema import ModelConfig, Recipe
    from relax_hpc.rollout.config import DataConfig, RolloutConfig

    import_source(tmp_path, monkeypatch, "gen_plugins", REWARDS)
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"q": f"{i}+1=", "a": str(i + 1), "metadata": {"i": i}}) + "\n")
    recipe = Recipe(model=ModelConfig(path=str(tiny_llama)), mode="fully_async", max_staleness=1,
                    data=DataConfig(path=str(tmp_path / "p.jsonl"), input_key="q", label_key="a"),
                    rollout=RolloutConfig(custom_rm_path="gen_plugins.reward_func", n_samples_per_prompt=2,
                                          rollout_batch_size=2, over_sampling_batch_size=4, max_response_len=64,
                                          stop_token_ids=list(range(0, 128, 32)), partial_rollout=True,
                                          mask_offpolicy_in_partial_rollout=True))
    run = create_run_dir(tmp_path / "runs", "r")
    return lambda: make_generator(recipe, run)


def test_generate_restores_the_buffer_its_cursor_names(partial, cpu_engine):
    """The buffer travels with the data cursor (a file the state names): a generator whose memory is elsewhere
    takes the given state; a step generated again (its chunk damaged) trains the same prompts as before and
    leaves the buffer the steps after it went on from; and a restarted role given the state after step 1
    continues step 1's buffered samples from their partial tokens, losing no group."""
    from relax_hpc.rollout.sample import SampleStatus

    def run(gen, n, start):
        return step(gen, n, {"e0": cpu_engine.url}, start)

    def continued(got, before):  # each sample of a buffered group goes on from the tokens it had
        for s in got:
            b = next(b for b in before[s["group_index"]] if b.index == s["index"])
            assert list(s["tokens"][:len(b.tokens)]) == b.tokens and len(s["tokens"]) > len(b.tokens)

    gen = partial()
    run(gen, 1, gen.state(0))
    for g in gen.partial.buffer:  # where timing ended step 1 varies: as if 3 tokens into each response
        for s in g:
            s.tokens, s.response, s.response_length = s.tokens[:s.prompt_length + 3], "", 3
            s.loss_mask, s.rollout_log_probs = [0] * 3, s.rollout_log_probs[:3]
            s.status, s.abort_count, s.reward, s.weight_versions = SampleStatus.ABORTED, 1, None, ["0"]
    s1 = gen.state(1)
    buffered = {g[0].group_index: [s.copy() for s in g] for g in gen.partial.buffer}  # step 2 continues them
    assert s1.partial.groups == 2 and s1.sample_group_index == 4
    r2 = run(gen, 2, s1)
    after2 = gen.run.path / r2.state.partial.file
    inode = after2.stat().st_ino

    gen.restore(s1)  # the given state wins over the generator's memory (which is after step 2)
    assert {g[0].group_index: g for g in gen.partial.buffer} == buffered
    assert gen.data.state_dict() == s1.cursor()

    redo = run(gen, 2, s1)  # step 2 again, as after a damaged chunk: its prompts, all finished
    assert groups(redo) == groups(r2) and redo.state == r2.state
    continued([s for s in read_samples(redo.chunks, ("tokens", "index", "group_index"))
               if s["group_index"] in buffered], buffered)
    assert after2.stat().st_ino == inode  # the buffer step 3 went on from is left as it was
    assert gen.current == r2.state and len(gen.partial.buffer) == r2.state.partial.groups

    fresh = partial()  # a restarted role: its own start state, then the controller's state after step 1
    fresh.state(0)
    again = run(fresh, 2, DataState.from_dict(json.loads(json.dumps(s1.to_dict()))))  # as it comes over the wire
    kept = read_samples(again.chunks, ("tokens", "index", "group_index"))
    left = [{"group_index": s.group_index, "index": s.index, "tokens": s.tokens} for g in fresh.partial.buffer
            for s in g if s.group_index in buffered]
    assert set(groups(again)) | {g[0].group_index for g in fresh.partial.buffer} == set(buffered) | {4, 5}
    continued([s for s in kept if s["group_index"] in buffered], buffered)  # trained: finished from there
    assert all(list(s["tokens"][:len(b.tokens)]) == b.tokens for s in left
               for b in buffered[s["group_index"]] if b.index == s["index"])  # or back in the buffer, no shorter
    assert again.metrics["rollout/partial_resumed_groups"] == len(set(groups(again)) & set(buffered))
