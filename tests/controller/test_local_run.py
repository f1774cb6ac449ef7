"""Local end to end: the controller starts the roles as processes, they bootstrap, and the run ends.

Each test starts 5 Python processes that import torch (a few seconds on a small machine).
"""

import contextlib
import json
import os
import signal
import threading
import time

import psutil
import pytest

from ctl_helpers import TINY, make_run
from relax_hpc.controller import RunFailed, run_controller


pytestmark = pytest.mark.usefixtures("local_executor")  # tests/conftest.py's


@pytest.fixture(autouse=True)
def _children_before():
    """The descendants this pytest process had before the test (an engine a session fixture started, torch's
    shared-memory manager): not the test's to stop."""
    global _BEFORE
    _BEFORE = {p.pid for p in psutil.Process().children(recursive=True)}
    yield


_BEFORE: set[int] = set()


def our_children() -> list:
    """This process's descendants the test started (see :func:`_children_before`), still alive."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in _BEFORE and p.name() != "torch_shm_manager":
                out.append(p)
        except psutil.NoSuchProcess:  # gone while we looked: not left over
            pass
    return out


def no_descendants_left(pids):
    assert our_children() == []
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
    run = make_run(tmp_path, dict(TINY, checkpoint={"max_restarts": 1},  # one restart fails too: no more left
                                  health={"max_role_restarts": 0}))  # the global tier only (test_role_restart.py)
    want = "rollout rank 0 on localhost failed: RuntimeError: RELAX_TEST_FAIL_ROLE=rollout"
    with pytest.raises(RunFailed, match=want):  # the report, not a heartbeat timeout, ends it
        run_controller(run.path)
    state = json.loads(run.state.read_text())
    assert state["state"] == "FAILED" and "injected failure" in state["reason"]
    assert state["restarts"] == 1 and [e["event"] for e in state["events"]] == ["started", "step_restarted", "failed"]
    assert state["roles"]["rollout"]["phase"] == "failed"
    assert "injected failure" in state["roles"]["rollout"]["error"]
    log = (run.logs / "controller.log").read_text()
    assert "log of the failed role rollout" in log and "Traceback" in log
    no_descendants_left(all_pids(state))


def kill_once(run, role: str, killed: list) -> threading.Thread:
    """SIGKILL ``role``'s rank 0 as soon as state.json names its PID (once)."""
    def kill_rollout():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            state = run.read_json(run.state, {}) or {}
            pids = state.get("roles", {}).get(role, {}).get("pids", [None])
            if pids[0]:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.05)

    t = threading.Thread(target=kill_rollout, daemon=True)
    t.start()
    return t


def test_a_role_that_dies_without_a_word_fails_the_run(tmp_path, monkeypatch):
    """A rank killed from outside (OOM killer, segfault) sends no error message: its exit code says it.
    With no restarts allowed, the run fails with that reason. (The role is held ready until killed.)"""
    monkeypatch.setenv("RELAX_TEST_HOLD_ROLE", "rollout")
    run = make_run(tmp_path, dict(TINY, checkpoint={"max_restarts": 0}, health={"max_role_restarts": 0}))
    kill_once(run, "rollout", [])
    with pytest.raises(RunFailed, match="rollout failed: step exited with code -9"):
        run_controller(run.path)
    no_descendants_left(all_pids(json.loads(run.state.read_text())))


@pytest.mark.parametrize("role", ["actor", "reference"])
def test_a_killed_step_is_restarted_and_the_run_goes_on(tmp_path, role, monkeypatch):
    """With restarts allowed, every step is stopped and started again (a new control port, new PIDs) and the
    run completes; state.json keeps the failure that was survived and counts the restart. The role is held
    ready in the first try, so the kill always lands before the run could end."""
    monkeypatch.setenv("RELAX_TEST_HOLD_ROLE", role)
    # the global tier: a reference alone would be started again alone (tests/controller/test_role_restart.py)
    run = make_run(tmp_path, dict(TINY, checkpoint={"max_restarts": 1}, health={"max_role_restarts": 0}))
    killed: list = []
    kill_once(run, role, killed)
    seen, done = set(), threading.Event()

    def watch():  # what a watcher of state.json reads meanwhile: never an end while the run goes on
        while not done.is_set():
            seen.add((run.read_json(run.state, {}) or {}).get("state"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        final = run_controller(run.path)
    finally:
        done.set()
        watcher.join()
    assert seen <= {None, "RUNNING", "COMPLETED"}, seen
    assert final["state"] == "COMPLETED" and final["restarts"] == 1 and final["attempt"] == 0
    assert role in final["last_failure"] and "code -9" in final["last_failure"]
    assert killed[0] not in final["roles"][role]["pids"]
    assert [e["event"] for e in final["events"]] == ["started", "step_restarted", "finished"]
    no_descendants_left(all_pids(final) + killed)


@contextlib.contextmanager
def signal_when_held(run, role: str, signum: int):
    """Hold ``role`` ready (``RELAX_TEST_HOLD_ROLE``: the run cannot end without the controller), and send
    ``signum`` to this process (the controller's) once state.json shows the role ready. The sender stops
    when the block ends, so a signal never lands after the controller has given its handlers back."""
    stop = threading.Event()

    def send():
        while not stop.wait(0.05):
            roles = (run.read_json(run.state, {}) or {}).get("roles", {})
            if roles.get(role, {}).get("phase") == "ready":
                os.kill(os.getpid(), signum)
                return

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAX_TEST_HOLD_ROLE", role)
        t = threading.Thread(target=send, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()


def test_sigusr2_requeues_the_run_and_stops_the_roles(tmp_path):
    """The time-limit warning: with nothing to checkpoint (no model) the attempt ends REQUEUED at once and,
    locally, the controller exits with submitit's requeue code so the local runner starts it again."""
    run = make_run(tmp_path)
    with signal_when_held(run, "rollout", signal.SIGUSR2), pytest.raises(SystemExit) as exc:
        run_controller(run.path)
    assert exc.value.code == 144
    state = json.loads(run.state.read_text())
    assert state["state"] == "REQUEUED" and "SIGUSR2" in state["reason"]
    assert [e["event"] for e in state["events"]] == ["started", "requeued"]
    no_descendants_left(all_pids(state))


def test_relax_cancel_checkpoint_reaches_the_controller_over_its_socket(tmp_path, monkeypatch):
    """``relax-cancel --checkpoint`` is a control message on the run's token-authenticated socket; with no
    training loop there is nothing to save, so the run is cancelled at once with that reason. The rollout
    role is held, so the run is still going when the message comes."""
    from relax_hpc.launch.cancel import checkpoint_then_stop

    monkeypatch.setenv("RELAX_TEST_HOLD_ROLE", "rollout")
    run = make_run(tmp_path)
    (run.path / "job.json").write_text(json.dumps({"run": run.name, "executor": "local", "job_id": "1"}))
    result = {}
    t = threading.Thread(target=lambda: result.update(err=_run_catching(run)), daemon=True)
    t.start()
    while t.is_alive() and (run.read_json(run.state, {}) or {}).get("roles", {}).get("rollout", {}).get("phase") != "ready":
        time.sleep(0.05)
    out = checkpoint_then_stop(run, "checkpoint_cancel", wait_s=120)
    t.join(120)
    assert out["state"] == "CANCELLED" and out["action"] == "checkpoint, then cancel"
    assert "relax-cancel --checkpoint" in result["err"]
    assert (run.path / "cancel.json").exists()
    no_descendants_left(all_pids(json.loads(run.state.read_text())))


def _run_catching(run) -> str:
    try:
        run_controller(run.path)
        return ""
    except RunFailed as e:
        return str(e)


def test_past_max_requeues_the_run_fails_and_says_how_to_go_on(tmp_path):
    run = make_run(tmp_path, dict(TINY, slurm={"mpi": "none", "max_requeues": 0}))
    with signal_when_held(run, "rollout", signal.SIGUSR2), pytest.raises(RunFailed, match="slurm.max_requeues is 0"):
        run_controller(run.path)
    state = json.loads(run.state.read_text())
    assert state["state"] == "FAILED" and "relax-submit --resume" in state["reason"]
    assert state["events"][-1]["event"] == "failed"
    no_descendants_left(all_pids(state))


def test_a_second_controller_of_a_live_run_stops_without_touching_it(tmp_path):
    """A requeued job and its continuation, or a --resume of a live run: the second controller finds the run's
    lock held and stops before writing anything, so the live run's state.json and controller.json stay its own."""
    import fcntl

    from relax_hpc.controller.loop import RunLocked

    run = make_run(tmp_path)
    run.state.write_text('{"state": "RUNNING", "attempt": 4}')
    run.controller_addr.write_text('{"host": "node7", "port": 1234, "pid": 4321}')
    before = (run.state.read_bytes(), run.controller_addr.read_bytes())
    with open(run.path / "controller.lock", "a+") as live:  # the live controller's lock
        fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunLocked, match=r"another controller is running .* \(pid 4321 on node7"):
            run_controller(run.path)
    assert (run.state.read_bytes(), run.controller_addr.read_bytes()) == before
    assert our_children() == []
