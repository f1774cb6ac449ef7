"""The two tiers of recovery, with real role processes (no model: the roles only bootstrap, so a run is seconds).

Role tier: a role other than the actor that dies is started again alone; the others keep their processes. Global
tier: the actor's death, or a role failing again within ``health.window_s`` of its restart alone, restarts every
step (``checkpoint.max_restarts``). The run with a model, a reference killed mid-step and the journal audit is
``tests/e2e/test_role_restart.py``.
"""

import json
import os
import signal
import threading
import time

import pytest

from ctl_helpers import TINY, make_run
from relax_hpc.backends import LocalBackend
from relax_hpc.controller import RunFailed, run_controller
from test_local_run import _children_before, all_pids, no_descendants_left  # noqa: F401

pytestmark = pytest.mark.usefixtures("local_executor")  # tests/conftest.py's


def kill_when_ready(run, role: str, killed: list) -> threading.Thread:
    """SIGKILL ``role``'s rank 0 once state.json shows every role past the start's cross-role check (once)."""
    def kill():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            state = run.read_json(run.state, {}) or {}
            if (state.get("cross_group") or {}).get("ok") and state["roles"][role]["phase"] == "ready":
                pid = state["roles"][role]["pids"][0]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


def _events(state):
    return [e["event"] for e in state["events"]]


def test_a_killed_reference_is_started_again_alone(tmp_path, monkeypatch):
    """kill -9 of the reference while it is held ready: only its step starts again (new PIDs), the actor's and
    rollout's PIDs stay, no step restart is used, and state.json says which tier acted, why and how long it took."""
    monkeypatch.setenv("RELAX_TEST_HOLD_ROLE", "reference")  # held in its first life only: the new one finishes
    run = make_run(tmp_path, dict(TINY, checkpoint={"max_restarts": 0}))  # a global restart would fail the run
    killed: list = []
    kill_when_ready(run, "reference", killed)
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED" and final["restarts"] == 0
    assert killed[0] not in final["roles"]["reference"]["pids"] and all(final["roles"]["reference"]["pids"])
    ev = _events(final)
    assert ev[0] == "started" and ev[-1] == "finished" and "role_restarted" in ev and "step_restarted" not in ev
    restarted = next(e for e in final["events"] if e["event"] == "role_restarted")["detail"]
    assert "reference failed: step exited with code -9" in restarted and "started again alone (1/3)" in restarted
    h = final["health"]
    assert h["role_restarts"] == 1 and h["global_restarts"] == 0 and h["pending"] is None
    (rec,) = h["recoveries"]
    assert rec["tier"] == "role" and rec["role"] == "reference" and "code -9" in rec["why"]
    assert isinstance(rec["recovery_s"], float) and rec["recovery_s"] > 0
    assert "role_recovered" in ev
    assert final["roles"]["reference"]["phase"] == "done" and final["roles"]["reference"]["exit_code"] == 0
    assert final["cross_group"]["ok"] is True  # checked at the start; the restarted role does not rejoin it
    log = (run.logs / "controller.log").read_text()
    assert log.count("starting reference:") == 1 and log.count("starting actor:") == 1  # the actor started once
    assert "starting reference again" in log
    no_descendants_left(all_pids(final) + killed)


def test_a_role_that_dies_while_a_cancel_is_requested_is_not_restarted(tmp_path, monkeypatch):
    """relax-cancel writes cancel.json, then signals the run: a role that dies of it first is not started again alone
    (local roles run in sessions of their own: a new one would be outside what the cancel stops); the run ends
    CANCELLED. Before, Ctrl-C on relax-submit could wait 90 s for a role restarted into the cancel."""
    from relax_hpc.rundir import write_json

    monkeypatch.setenv("RELAX_TEST_HOLD_ROLE", "reference")
    run = make_run(tmp_path, dict(TINY, checkpoint={"max_restarts": 0}))
    killed: list = []

    def cancel_then_kill():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = run.read_json(run.state, {}) or {}
            if (state.get("cross_group") or {}).get("ok") and state["roles"]["reference"]["phase"] == "ready":
                write_json(run.path / "cancel.json", {"requested_at": time.time(), "by": "relax-cancel"})
                killed.append(state["roles"]["reference"]["pids"][0])
                os.kill(killed[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    t = threading.Thread(target=cancel_then_kill, daemon=True)
    t.start()
    with pytest.raises(RunFailed, match="stopped by the cancel"):
        run_controller(run.path)
    t.join()
    final = run.read_json(run.state, {})
    assert final["state"] == "CANCELLED" and killed and "role_restarted" not in _events(final)
    assert final["health"]["role_restarts"] == 0
    log = (run.logs / "controller.log").read_text()
    assert "starting reference again" not in log
    no_descendants_left(all_pids(final) + killed)


def test_a_role_failing_again_within_the_window_restarts_every_step(tmp_path, monkeypatch):
    """A reference that fails at every start: the first failure restarts it alone, the second (within health.window_s)
    takes the global tier (every step from the checkpoint); in the new try the same happens, and with no step
    restart left the run fails, naming the window."""
    monkeypatch.setenv("RELAX_TEST_FAIL_ROLE", "reference")
    run = make_run(tmp_path, dict(TINY, checkpoint={"max_restarts": 1}, health={"window_s": 3600}))
    with pytest.raises(RunFailed, match=r"within health.window_s=3600: every step restarts"):
        run_controller(run.path)
    state = json.loads(run.state.read_text())
    assert state["state"] == "FAILED" and state["restarts"] == 1
    tiers = [e for e in _events(state) if e in ("started", "role_restarted", "step_restarted", "failed")]
    assert tiers == ["started", "role_restarted", "step_restarted", "role_restarted", "failed"]
    step_restarted = next(e for e in state["events"] if e["event"] == "step_restarted")["detail"]
    assert "within health.window_s" in step_restarted and "global tier" in step_restarted
    h = state["health"]
    assert h["role_restarts"] == 2 and h["global_restarts"] == 1
    assert [r["tier"] for r in h["recoveries"] if r["tier"] == "role"] == ["role", "role"]
    first = h["recoveries"][0]  # the new reference was ready (then failed): a recovery that took time, not 0
    assert first["tier"] == "role" and (first["recovery_s"] is None or first["recovery_s"] > 0), first
    no_descendants_left(all_pids(state))


def test_max_role_restarts_0_takes_the_global_tier_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_TEST_FAIL_ROLE", "reference")
    run = make_run(tmp_path, dict(TINY, checkpoint={"max_restarts": 0}, health={"max_role_restarts": 0}))
    with pytest.raises(RunFailed, match=r"health.max_role_restarts is 0: every step restarts"):
        run_controller(run.path)
    state = json.loads(run.state.read_text())
    assert _events(state) == ["started", "failed"] and state["health"]["role_restarts"] == 0


def _state(tmp_path, **health):
    from relax_hpc.controller.state import RunState
    from relax_hpc.recipe import load_recipe, role_steps

    run = make_run(tmp_path, dict(TINY, health=health) if health else TINY)
    recipe = load_recipe(run.recipe)
    st = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={})
    for role in st.ranks:
        st.step_started(role, time.time())
        for rank in range(len(st.ranks[role])):  # every rank past the start's cross-role check
            st.apply(time.time(), {"type": "heartbeat", "role": role, "rank": rank, "node": "n0", "phase": "ready",
                                   "info": {"cross_group": {"world": 4, "ok": True}} if rank == 0 else {}})
    return st


def test_the_tier_is_decided_by_who_failed_and_how(tmp_path):
    """RunState's decision alone: a role's own failure → alone (the run stays RUNNING); a task's restartable error
    (what broke may be another role's) → every step; the actor → every step; again within the window → every step."""
    st = _state(tmp_path)
    st.fail("reference", 0, "n0", "step exited with code -9")
    assert st.running and list(st.alone) == ["reference"]
    (role, failure), = st.take_alone().items()
    st.restarted_alone(role, failure, time.time())
    assert st.doc["health"]["role_restarts"] == 1 and st.doc["roles"]["reference"]["phase"] == "starting"
    st.apply(time.time(), {"type": "error", "role": "reference", "rank": 0, "node": "n0", "traceback": "late"})
    assert st.running  # the old rank's late words, before the new rank's hello: dropped
    st.apply(time.time(), {"type": "hello", "role": "reference", "rank": 0, "node": "n0", "pid": 1, "world": 1})
    st.fail("reference", 0, "n0", "step exited with code -9")  # again, within health.window_s
    assert st.doc["state"] == "FAILED" and st.will_restart  # every step restarts (checkpoint.max_restarts left)
    assert "within health.window_s=600" in st.doc["reason"]

    st = _state(tmp_path / "cap", max_role_restarts=1, window_s=0)  # no window: only the count escalates
    st.fail("reference", 0, "n0", "step exited with code -9")
    (role, failure), = st.take_alone().items()
    st.restarted_alone(role, failure, time.time())
    st.apply(time.time(), {"type": "hello", "role": "reference", "rank": 0, "node": "n0", "pid": 1, "world": 1})
    st.fail("actor_fwd", 0, "n0", "no heartbeat for 61s")
    assert st.doc["state"] == "FAILED" and "restarted alone 1 time(s) in this try, health.max_role_restarts=1" \
        in st.doc["reason"]

    st = _state(tmp_path / "task")
    st.fail("rollout", 0, "n0", "generate (step 2): TeacherError: teacher0 gone", alone=False)
    assert st.doc["state"] == "FAILED" and not st.alone

    st = _state(tmp_path / "actor")
    st.fail("actor", 0, "n0", "step exited with code -9")
    assert st.doc["state"] == "FAILED" and not st.alone
