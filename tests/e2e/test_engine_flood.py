"""Issue 47's whole-run probe: a local user without the run's key floods its reference engine (1,000 idle connections
held open, then a burst of every kind of keyless connection that goes on until the run ends). The run's own keyed
requests (generates, weight syncs, health checks) are served all along: it completes with no step restarted and no
engine started again. Before: the flood took the engine's 1,024 slots, the actor's weight-sync connect got 503,
the run FAILED and restarted in place."""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import pytest

from relax_hpc.controller import run_controller
from tests.e2e.conftest import held_at, hold, make_run, metrics, state, wait_until
from tests.engines.flood import Flood, fds_for


@pytest.mark.slow
def test_a_flood_without_the_key_does_not_stop_or_restart_the_run(tmp_path, tiny_model, local_executor):
    fds_for(2000)
    run = make_run(tmp_path, tiny_model, "run.steps=4", name="flood")
    hold(run, 0)  # no step starts before the flood is in place
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(final=run_controller(run.path)), daemon=True)
    t.start()
    flood, released = None, 0
    try:
        url = wait_until(lambda: held_at(run, 0) and state(run).get("engines", {}).get("engine0", {}).get("url"),
                         300, what="the run held before step 1, its engine up")
        flood = Flood(urlsplit(url).port, keep=1000)
        flood.hold(1000)
        flood.start()
        flood.wait_made(1000)  # 2,000 connections made: now the steps run, the burst going on
        released = flood.made
    finally:
        (run.path / "pause").unlink(missing_ok=True)
        t.join(600)
        if flood is not None:
            flood.stop()
    assert result["final"]["state"] == "COMPLETED", result
    st = state(run)
    events = [ev["event"] for ev in st["events"]]
    assert "step_restarted" not in events and "engine_restart" not in events, st["events"]
    assert st["engines"]["engine0"]["restarts"] == 0
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    assert flood.made > released  # the burst went on while the steps ran (its connects fail once the engine stops)
