"""Engines from anywhere: a reference engine started by hand, with a key of its own, joins a running fully-async
quickstart through ``relax-scale --attach-url URL --key-file FILE``, loads the run's weights from the snapshot the
actor writes (no weight-sync group: its version rises with the steps), serves requests, is drained on request
(``relax-scale --drain URL``) and, joined again, at the end of the run; it is never stopped: it still runs and
answers after the run ends.

The run is held at a step (``RUN_DIR/pause``) while the engine is asked for, as tests/e2e/test_elastic.py does, so
the joins land at known points; the rest waits for events in ``state.json``, never for wall time.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.engines.client import EngineClient
from relax_hpc.exchange.audit import exactly_once
from relax_hpc.launch import attach
from relax_hpc.rundir import write_json

from .conftest import REPO, hold, make_run, metrics, state, wait_until

STEPS = 6  # held at 2 (the join) and 4 (the drain and the second join), then two steps


def _engine(run, name):
    return (state(run).get("engines") or {}).get(name) or {}


def _scale(run, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "relax-scale"), run.name, *args, "--runs-root",
                           str(run.path.parent), "--json"], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_an_engine_started_by_hand_joins_gets_the_weights_serves_and_outlives_the_run(tmp_path, tiny_model,
                                                                                      local_executor):
    key = tmp_path / "engine.key"  # the engine's own key, not the run's
    key.write_text(secrets.token_urlsafe(24) + "\n")
    key.chmod(0o600)
    ready = tmp_path / "engine.url"
    log = open(tmp_path / "engine.log", "w")
    engine = subprocess.Popen([sys.executable, "-m", "relax_hpc.engines.cpu_engine", "--model", str(tiny_model),
                               "--api-key-file", str(key), "--ready-file", str(ready), "--threads", "1",
                               "--seed", "0"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        url = wait_until(lambda: ready.exists() and ready.read_text().strip(), 180, what="the engine started by hand")
        client = EngineClient(url, api_key=key.read_text().strip(), retries=0)
        assert client.weight_version() == "default"  # what it serves before it joins
        run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", recipe=REPO / "recipes" / "quickstart-async.yaml",
                       name="external")
        write_json(run.job, {"run": run.name, "run_dir": str(run.path), "executor": "local", "job_id": "local",
                             "pid": os.getpid(), "host": socket.gethostname()})  # as relax-submit --local writes it
        hold(run, 2)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(final=run_controller(run.path, capacity=attach)),
                             daemon=True)
        t.start()
        try:
            wait_until(lambda: state(run).get("phase") == "paused" and state(run).get("step", 0) >= 1, 300,
                       what="the run held at step 2")
            loose = tmp_path / "loose.key"  # a key others can read is refused before anything is asked
            loose.write_text(key.read_text())
            loose.chmod(0o644)
            p = _scale(run, "--attach-url", url, "--key-file", str(loose))
            assert p.returncode != 0 and "mode 0644" in p.stderr and f"chmod 600 {loose}" in p.stderr, p.stderr
            wrong = tmp_path / "wrong.key"  # the run's key, or any other, is not this engine's
            wrong.write_text("not-the-key\n")
            wrong.chmod(0o600)
            p = _scale(run, "--attach-url", url, "--key-file", str(wrong))
            assert p.returncode != 0 and "refused the key" in p.stdout, (p.stdout, p.stderr)

            p = _scale(run, "--attach-url", url, "--key-file", str(key))
            assert p.returncode == 0 and '"accepted": true' in p.stdout, (p.stdout, p.stderr)
            # the actor writes a snapshot with a catch-up sync; the engine loads it and is then ready
            wait_until(lambda: _engine(run, "ext0").get("state") == "ready", 300, what="ext0 ready")
            e = _engine(run, "ext0")
            assert e["origin"] == "external" and e["url"] == url and e["job_id"] == "external", e
            first = int(e["weight_version"])
            assert client.weight_version() == str(first) and first >= state(run)["step"] - 1

            hold(run, 4)  # steps 3-4 generate with two engines
            wait_until(lambda: _engine(run, "ext0").get("requests", 0) > 0 and state(run).get("phase") == "paused"
                       and state(run).get("step", 0) >= 3, 600, what="ext0 served requests")
            # it got the weights of the steps since: its version rose (the registry's: loaded and checked)
            wait_until(lambda: int(_engine(run, "ext0").get("weight_version") or 0) > first, 300,
                       what="ext0 loaded a newer snapshot")
            assert int(client.weight_version()) >= int(_engine(run, "ext0")["weight_version"]) > first
            p = _scale(run, "--drain", url)
            assert p.returncode == 0, (p.stdout, p.stderr)
            wait_until(lambda: _engine(run, "ext0").get("state") == "gone", 300, what="ext0 drained")
            assert "drained" in _engine(run, "ext0")["left"] and engine.poll() is None
            p = _scale(run, "--attach-url", url, "--key-file", str(key))  # again, for the rest of the run
            assert p.returncode == 0, (p.stdout, p.stderr)
            wait_until(lambda: _engine(run, "ext1").get("state") == "ready", 300, what="ext1 ready")
            (run.path / "pause").unlink()
            t.join(900)
        finally:
            (run.path / "pause").unlink(missing_ok=True)
            t.join(900)
        assert result["final"]["state"] == "COMPLETED"
        e = _engine(run, "ext1")
        assert e["state"] == "gone" and "end of the run" in e["left"], e
        assert engine.poll() is None and client.is_healthy()  # never stopped: it outlives the run
        assert int(client.weight_version()) >= 4
        rows = metrics(run)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert max(r["rollout/engines"] for r in rows) == 2
        assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train"]) == []
        assert len(list((run.path / "weights").glob("step-*"))) <= 2  # old snapshots are removed
    finally:
        engine.terminate()  # the test started it: the test stops it
        engine.wait(30)
        log.close()
