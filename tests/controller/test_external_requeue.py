"""Engines attached with ``relax-scale --attach-url`` across attempts (a requeue, ``relax-submit --resume``, a restart
of every step): the attempt keeps them in ``state.json`` (``attached_engines``: url, key file, who; never the key),
the next attempt attaches them again once its own engines are up, and one no longer reachable is dropped with the
reason (an ``engine_external`` event, relax-status shows it). The end of every attempt drains them, never stops them.
Real parts: RunState and state.json, Elastic over a real control socket's Channel, real reference engines with keys
of their own."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ctl_helpers import TINY, TOKEN, make_run
from relax_hpc.backends import LocalBackend
from relax_hpc.controller.channel import Channel
from relax_hpc.controller.elastic import Elastic
from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.controller.state import RunState
from relax_hpc.engines.client import EngineClient
from relax_hpc.engines.launcher import start_engine
from relax_hpc.launch import attach
from relax_hpc.rollout import external as X
from relax_hpc.recipe import load_recipe, role_steps
from tests.rollout.conftest import ENGINE_ARGS, tiny_llama  # noqa: F401 - a fixture, used by name

KEY = "key-of-the-engine-not-the-run"


def _engine(tmp_path, model, name):
    d = tmp_path / name
    d.mkdir()
    h = start_engine("cpu", model, log_path=d / "engine.log", extra_args=ENGINE_ARGS, api_key=KEY)
    key = d / "engine.key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    return h, str(key)


def _attempt(run, ch) -> Elastic:
    """One attempt's controller side: the state (from the earlier attempt's state.json) and Elastic, its own engine
    ready and the run started (what the training loop says once the resume sync is done)."""
    recipe = load_recipe(run.recipe)
    state = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={})
    reg = EngineRegistry()
    reg.add("engine0", "http://127.0.0.1:1", origin="initial", state="ready", weight_version="0")
    el = Elastic(recipe, run, reg, state, ch, LocalBackend(), holds=lambda n: False, on_change=lambda: None,
                 assign=ch.assign, capacity=attach)
    el.started = True
    return el


def _ready(el, name, timeout=120.0):
    """Tick until ``name`` loaded the weights from disk (ready) and its attach operation ended."""
    deadline = time.monotonic() + timeout
    while (el.registry.engines[name].state != "ready" or el.running() is not None) and time.monotonic() < deadline:
        el.tick()
        time.sleep(0.05)
    assert el.registry.engines[name].state == "ready" and el.running() is None, el.registry.engines[name]


def _attach(el, url, key_file):
    return el.ask({"type": "scale", "target": "external", "attach": None, "cancel": None, "by": "alice",
                   "external": {"url": url, "key_file": key_file}})


@pytest.fixture
def held_loads(monkeypatch):
    """The external engines' ``/update_weights_from_disk`` (real, on the real engine) held until the test lets it go:
    how fast a tiny model loads must not decide whether the test sees the engine ``syncing``."""
    gate = threading.Event()
    real = X.load_from_disk

    def held(*a, **kw):
        gate.wait(120)
        return real(*a, **kw)

    monkeypatch.setattr(X, "load_from_disk", held)
    gate.set()  # open unless a test closes it
    yield gate
    gate.set()


@pytest.fixture
def ch():
    c = Channel(TOKEN, bind_host="127.0.0.1")
    yield c
    c.close()


def test_attached_engines_are_attached_again_by_the_next_attempt_or_dropped_with_why(tmp_path, ch, tiny_llama,
                                                                                      held_loads):
    run = make_run(tmp_path, {**TINY, "model": {"path": str(tiny_llama)}})  # version 0: the model on disk
    stays, stays_key = _engine(tmp_path, tiny_llama, "stays")
    leaves, leaves_key = _engine(tmp_path, tiny_llama, "leaves")
    try:
        stays.wait_ready(120)
        leaves.wait_ready(120)
        first = _attempt(run, ch)
        assert _attach(first, stays.url, stays_key)["accepted"]
        _ready(first, "ext0")
        assert _attach(first, leaves.url, leaves_key)["accepted"]
        _ready(first, "ext1")
        first.finish()  # a requeue's end: drained, never stopped, kept for the next attempt
        first.state.write()
        doc = json.loads(run.state.read_text())
        assert [(a["url"], a["key_file"], a["by"]) for a in doc["attached_engines"]] == \
            [(stays.url, stays_key, "alice"), (leaves.url, leaves_key, "alice")]
        assert KEY not in run.state.read_text()  # the key file's path, never the key
        assert EngineClient(stays.url, api_key=KEY, retries=0).weight_version() is not None  # still running
        leaves.stop()  # gone before the next attempt

        held_loads.clear()  # the next attempts' loads wait until the test has looked at the engine syncing
        second = _attempt(run, ch)
        assert not second.registry.engines.keys() - {"engine0"}  # not before the run's own engines are up
        second.tick()
        (name,) = second.external.names()
        e = second.registry.engines[name]
        assert e.url == stays.url and e.origin == "external" and e.state == "syncing"  # the weights from disk first
        ev = [x["detail"] for x in second.state.doc["events"] if x["event"] == "engine_external"]
        assert any(f"{leaves.url} (attached with relax-scale before this attempt) not used: " in d for d in ev), ev
        assert [a["url"] for a in second.state.doc["attached_engines"]] == [stays.url]  # the unreachable one dropped

        held_loads.set()
        _ready(second, name)  # it loaded the run's weights from disk: it serves this attempt
        held_loads.clear()
        second.finish()
        second.state.write()

        # a third attempt: attached again, and drained on request while it still loads the weights (syncing: no
        # request was sent to it): gone at once, and the next attempt does not attach it again
        third = _attempt(run, ch)
        third.tick()
        (name,) = third.external.names()
        assert third.registry.engines[name].state == "syncing"
        assert third.ask({"type": "scale", "target": "external", "attach": None, "cancel": None, "by": "bob",
                          "drain_url": stays.url})["accepted"]
        assert third.registry.engines[name].state == "gone" and third.state.doc["attached_engines"] == []
        held_loads.set()
        third.tick()
        assert third.running() is None  # the drain operation is done
        assert EngineClient(stays.url, api_key=KEY, retries=0).weight_version() is not None  # never stopped
    finally:
        stays.stop()
        leaves.stop()
