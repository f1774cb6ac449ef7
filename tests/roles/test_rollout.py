"""The rollout role's entry point (relax_hpc.roles.rollout) in this process, with a real RoleContext (the run's
recipe, run directory and controller channel): a generate task goes through the generator and back as the reply,
its data_state a plain JSON dict on the wire both ways, a malformed one refused by name. The announcement of streamed
chunks (``chunk_ready`` over the real control socket) is tests/rollout/test_driver_stream.py; the generator's own
logic is tests/rollout/test_generator.py."""

from __future__ import annotations

import itertools
import json

import pytest

from relax_hpc.controller.channel import Channel
from relax_hpc.controller.messages import GenerateTask, decode_task, encode_result
from relax_hpc.exchange.audit import chunk_prompts
from relax_hpc.recipe import dump_recipe, recipe_from_dict
from relax_hpc.roles.rollout import generate, make_generator
from relax_hpc.roles.runtime import RoleContext
from relax_hpc.rundir import create_run_dir, write_json, write_private
from tests.rollout.conftest import tiny_llama  # noqa: F401 - a fixture, used by name
from tests.rollout.test_generator import Engine

PROMPTS = 8


@pytest.fixture
def role(tmp_path, tiny_llama, monkeypatch):  # noqa: F811 - the fixture imported above
    """A rollout role's context and generator on a run directory of its own (a recipe with ``PROMPTS`` prompts, a
    controller channel the context's client and the announcer reach)."""
    monkeypatch.setenv("RELAX_RANK", "0")
    monkeypatch.setenv("RELAX_WORLD_SIZE", "1")
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(PROMPTS):
            f.write(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n")
    recipe = recipe_from_dict({
        "model": {"path": str(tiny_llama)},
        "data": {"path": str(tmp_path / "p.jsonl"), "input_key": "q", "label_key": "a"},
        "rollout": {"rm_type": "math", "n_samples_per_prompt": 2, "rollout_batch_size": 2, "max_response_len": 2,
                    "batch_group_requests": False}})
    rd = create_run_dir(tmp_path / "runs", "r")
    write_private(rd.recipe, dump_recipe(recipe))
    ch = Channel(rd.token(), "127.0.0.1")
    write_json(rd.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    ctx = RoleContext("rollout", rd.path)
    yield ctx, ch
    ctx.close()
    ch.close()


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.http.close()


_ids = itertools.count(1)


def wire(state: dict | None, engines: dict[str, str], step: int) -> GenerateTask:
    """A generate task as the role receives it: encoded by the controller, decoded by the task loop."""
    n = next(_ids)
    sent = GenerateTask(id=n, step=step, engines=engines, seq=n, data_state=state).to_dict()
    return decode_task(json.loads(json.dumps(sent)))


def test_a_generate_task_is_answered_with_its_chunk_and_the_state_after_it_as_plain_json(role, engine):
    ctx, _ = role
    gen = make_generator(ctx)
    start = gen.state(0).to_dict()  # start_engines' reply: a fresh run's step 1 starts from it
    assert start == gen.data.state_dict()  # without partial rollout the state is the data cursor, nothing more

    r1 = generate(gen, wire(start, {"e": engine.url}, 1))
    reply = json.loads(json.dumps(encode_result("generate", r1)))
    assert reply["data_state"] == gen.data.state_dict() and reply["data_state"]["sample_group_index"] == 2
    assert reply["n"] == 4 and reply["weight_versions"] == ["3"] and reply["engine_requests"] == {"e": 4}
    assert chunk_prompts(r1.chunks[0].attrs)[1] == [0, 1]
    assert ctx.progress_count >= 4  # the role's heartbeats show the work moving

    r2 = generate(gen, wire(reply["data_state"], {"e": engine.url}, 2))
    again = generate(gen, wire(reply["data_state"], {"e": engine.url}, 2))  # the reply's state, sent back
    assert chunk_prompts(again.chunks[0].attrs)[1] == chunk_prompts(r2.chunks[0].attrs)[1] == [2, 3]
    assert again.data_state == r2.data_state


def test_a_malformed_data_state_fails_the_task_naming_the_key(role, engine):
    ctx, _ = role
    gen = make_generator(ctx)
    state = {k: v for k, v in gen.state(0).to_dict().items() if k != "epoch"}  # the old code: a bare KeyError
    with pytest.raises(ValueError, match=r"data_state: epoch = None is not an integer.*Fix: resume from a checkpoint"):
        generate(gen, wire(state, {"e": engine.url}, 1))
