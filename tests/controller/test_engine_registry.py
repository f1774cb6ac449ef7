"""The controller's engine registry: its state machine, who gets requests, who gets syncs, what state.json shows."""

import pytest

from relax_hpc.controller.engines import EngineError, EngineRegistry


def registry() -> EngineRegistry:
    r = EngineRegistry()
    r.add("engine0", "http://a:1", node="n1", pid=11, job_id="40", step_id="1", state="ready", weight_version="0")
    r.add("engine1", "http://b:1", node="n2", pid=12, job_id="40", step_id="1", state="syncing", weight_version="0")
    return r


def test_only_ready_engines_within_the_staleness_bound_take_requests():
    r = registry()
    assert r.routable() == {"engine0": "http://a:1"}  # engine1 still serves the model on disk of a resumed run
    assert r.live() == {"engine0": "http://a:1", "engine1": "http://b:1"}  # but it gets the syncs
    r.synced({"engine0": "3", "engine1": "3"})
    assert r.engines["engine1"].state == "ready" and r.routable(min_version=3) == r.live()
    r.synced({"engine0": "4", "engine1": None})  # engine1 did not report the new version: it stays at 3
    assert r.routable(min_version=4) == {"engine0": "http://a:1"}
    assert r.routable(min_version=3) == r.live()


def test_dead_engines_get_nothing_and_keep_their_reason():
    r = registry()
    assert r.mark_dead("engine0", "connection refused") and not r.mark_dead("engine0", "again")
    assert r.routable() == {} and r.live() == {"engine1": "http://b:1"}
    r.synced({"engine0": "5"})  # a late report from a dead engine changes nothing
    e = r.to_state()["engine0"]
    assert (e["state"], e["dead"], e["weight_version"]) == ("dead", "connection refused", "0")
    assert r.count("dead") == 1 and r.count("ready", "syncing") == 1


def test_the_state_machine_refuses_what_it_does_not_know():
    r = registry()
    with pytest.raises(EngineError, match="ready → starting is not a transition"):
        r.move("engine0", "starting")
    with pytest.raises(EngineError, match="registered already"):
        r.add("engine0", "http://a:2")
    with pytest.raises(EngineError, match="origin 'borrowed'"):
        r.add("engine9", "http://c:1", origin="borrowed")
    r.move("engine0", "draining")
    r.move("engine0", "gone")
    assert "engine0" not in r.live() and r.add("engine0", "http://a:3", origin="step").state == "starting"


def test_state_json_keeps_the_keys_tools_read():
    e = registry().to_state()["engine1"]  # tools/chaos and the e2e tests read url, pid, node and dead
    assert {"url", "pid", "node", "dead", "origin", "state", "weight_version", "job_id", "step_id"} <= set(e)
