"""relax-scale's questions about external engines, as the controller answers them (Elastic over its real control
socket's Channel): --drain waits for the task holding the engine and never tells it to stop, the run's own engines
are not drained this way, the end of the run drains every external engine, and one that dies is dropped, not
restarted."""

from __future__ import annotations

import pytest

from ctl_helpers import TOKEN, make_run
from relax_hpc.backends import LocalBackend
from relax_hpc.controller.channel import Channel
from relax_hpc.controller.elastic import Elastic
from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.controller.protocol import Client
from relax_hpc.controller.state import RunState
from relax_hpc.launch import attach
from relax_hpc.recipe import load_recipe, role_steps

URL = "http://127.0.0.1:7"  # an external engine's address (nothing here calls it: no snapshot is ever due)


@pytest.fixture
def ch():
    c = Channel(TOKEN, bind_host="127.0.0.1")
    yield c
    c.close()


@pytest.fixture
def el(tmp_path, ch):
    run = make_run(tmp_path)
    recipe = load_recipe(run.recipe)
    state = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={})
    reg = EngineRegistry()
    reg.add("engine0", "http://127.0.0.1:1", origin="initial", state="ready", weight_version="3")
    reg.add("ext0", URL, origin="external", state="ready", weight_version="3", job_id="external")
    held: set[str] = set()
    e = Elastic(recipe, run, reg, state, ch, LocalBackend(), holds=lambda n: n in held, on_change=lambda: None,
                assign=ch.assign, capacity=attach)
    e.external.keys["ext0"] = "/nonexistent"  # as a join leaves it (the key file is read only for calls)
    e.started = True
    e.held = held
    return e


def ask(el, **kw):
    return el.ask({"type": "scale", "target": "external", "attach": None, "cancel": None, "by": "test", **kw})


def test_drain_url_waits_for_the_task_then_leaves_it_running(el, ch):
    el.held.add("ext0")
    r = ask(el, drain_url=URL + "/")
    assert r["accepted"] and "external: it keeps running" in r["message"], r
    assert el.registry.engines["ext0"].state == "draining" and el.run.read_json(el.run.draining) == ["ext0"]
    el.tick()
    assert el.registry.engines["ext0"].state == "draining"  # a generate still holds it
    el.held.clear()
    el.tick()
    e = el.registry.engines["ext0"]
    assert e.state == "gone" and e.left.startswith("drained in") and "it keeps running" in e.left
    host = Client("127.0.0.1", ch.port, TOKEN)
    try:
        assert host.next_task("engine:ext0", 0, wait_s=0.2) is None  # never a stop: the run does not own it
    finally:
        host.close()
    el.tick()
    assert el.ops[-1].state == "done" and el.run.read_json(el.run.draining) == []
    assert "ext0" not in el.external.keys  # out of the rollout role's key file


def test_drain_url_refuses_the_runs_own_and_unknown_engines(el):
    r = ask(el, drain_url="http://127.0.0.1:1")
    assert not r["accepted"] and "the run's own (initial)" in r["message"] and "rollout=-N" in r["message"]
    r = ask(el, drain_url="http://127.0.0.1:9")
    assert not r["accepted"] and "no engine of this run serves at" in r["message"]
    assert "expected http://HOST:PORT" in ask(el, drain_url="gpu-box:30000")["message"]
    assert "expected {url, key_file}" in ask(el, external={"url": URL})["message"]
    el.started = False
    assert "not ready for scaling" in ask(el, drain_url=URL)["message"]


def test_the_end_of_the_run_drains_external_engines_and_never_stops_them(el, ch):
    el.finish()
    e = el.registry.engines["ext0"]
    assert e.state == "gone" and "drained at the end of the run; it keeps running" in e.left
    assert any(ev["event"] == "engine_gone" and "still running" in ev["detail"] for ev in el.state.doc["events"])
    host = Client("127.0.0.1", ch.port, TOKEN)
    try:
        assert host.next_task("engine:ext0", 0, wait_s=0.2) is None
    finally:
        host.close()


def test_a_dead_external_engine_is_gone_with_the_reason_and_not_restarted(el):
    started: list = []
    el.start_step = lambda *a, **k: started.append(a)
    el.lost("ext0", "found dead: connection refused")
    e = el.registry.engines["ext0"]
    assert e.state == "gone" and e.left == "found dead: connection refused" and started == []
    assert "ext0" not in el.external.keys


def test_the_recipes_external_engines_are_joined_once_the_run_is_started(el, tmp_path):
    key = tmp_path / "k"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    el.external.configured = [{"url": "http://127.0.0.1:9", "key_file": str(key)}]  # rollout.external_engines
    el.started = False
    el.tick()
    assert el.external.configured  # not before the run's own engines are up
    el.started = True
    el.tick()
    assert not el.external.configured
    ev = el.state.doc["events"][-1]
    assert ev["event"] == "engine_external" and "(rollout.external_engines) not used" in ev["detail"]
    assert el.registry.engines["engine0"].state == "ready"  # the run goes on with its own
