"""Local end to end: the controller starts the roles as processes, they bootstrap, and the run ends.

Each test starts 5 Python processes that import torch (a few seconds on a small machine).
"""

import json
import os
import signal
import threading
import time

import psutil
import pytest

from ctl_helpers import make_run
from relax_hpc.controller import RunFailed, run_controller


@pytest.fixture(autouse=True)
def local_executor(monkeypatch):
    monkeypatch.setenv("RELAX_EXECUTOR", "local")
    monkeypatch.delenv("RELAX_TEST_FAIL_ROLE", raising=False)


def no_descendants_left(pids):
    assert psutil.Process().children(recursive=True) == []
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def all_pids(state):
    return [p for r in state["roles"].values() for p in r["pids"] if p]


def test_roles_bootstrap_and_complete(tmp_path):
    run = make_run(tmp_path)
    summary = run_controller(run.path)
    state = json.loads(run.state.read_text())
    assert summary == state
    assert state["state"] == "COMPLETED" and state["reason"] is None and state["executor"] == "local"
    assert set(state["roles"]) == {"actor", "rollout", "reference", "actor_fwd"}
    for name, role in state["roles"].items():
        assert role["phase"] == "done", name
        assert role["ranks_ready"] == role["ranks"], name
        assert role["collective_ok"] is True, name
        assert role["nodes"] == ["localhost"] * role["ranks"], name
        assert role["last_heartbeat"] and role["error"] is None and role["exit_code"] == 0
    assert state["roles"]["actor"]["ranks"] == 2
    assert state["cross_group"] == {"world": 4, "ok": True}
    assert json.loads(run.controller_addr.read_text())["host"] == "127.0.0.1"
    assert run.controller_addr.stat().st_mode & 0o777 == 0o600
    no_descendants_left(all_pids(state))


def test_a_failing_role_fails_the_run_fast_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_TEST_FAIL_ROLE", "rollout")
    run = make_run(tmp_path)
    t0 = time.monotonic()
    want = "rollout rank 0 on localhost failed: RuntimeError: RELAX_TEST_FAIL_ROLE=rollout"
    with pytest.raises(RunFailed, match=want):
        run_controller(run.path)
    assert time.monotonic() - t0 < 90  # generous for a loaded 2-core machine; the reason check below tells an error report from a timeout
    state = json.loads(run.state.read_text())
    assert state["state"] == "FAILED" and "injected failure" in state["reason"]
    assert state["roles"]["rollout"]["phase"] == "failed"
    assert "injected failure" in state["roles"]["rollout"]["error"]
    log = (run.logs / "controller.log").read_text()
    assert "log of the failed role rollout" in log and "Traceback" in log
    no_descendants_left(all_pids(state))


def test_a_role_that_dies_without_a_word_fails_the_run(tmp_path, monkeypatch):
    """A rank killed from outside (OOM killer, segfault) sends no error message: its exit code says it."""
    run = make_run(tmp_path)
    killed = []

    def kill_rollout():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            state = run.read_json(run.state, {}) or {}
            pids = state.get("roles", {}).get("rollout", {}).get("pids", [None])
            if pids[0]:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.05)

    threading.Thread(target=kill_rollout, daemon=True).start()
    with pytest.raises(RunFailed, match="rollout failed: step exited with code -9"):
        run_controller(run.path)
    no_descendants_left(all_pids(json.loads(run.state.read_text())))


def test_sigusr2_cancels_the_run_and_stops_the_roles(tmp_path):
    run = make_run(tmp_path)
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGUSR2)).start()
    with pytest.raises(RunFailed, match="received SIGUSR2"):
        run_controller(run.path)
    state = json.loads(run.state.read_text())
    assert state["state"] == "CANCELLED"
    no_descendants_left(all_pids(state))
