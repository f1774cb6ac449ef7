"""How the controller judges roles: phases, readiness, failures (first one wins), silence, completion."""

import json

import pytest

from ctl_helpers import make_run
from relax_hpc.controller.state import RunState
from relax_hpc.recipe import load_recipe, role_steps


@pytest.fixture
def state(tmp_path):
    run = make_run(tmp_path)
    recipe = load_recipe(run.recipe)
    st = RunState(run, recipe, role_steps(recipe), "local", env={})
    for role in st.ranks:
        st.step_started(role, 100.0)
    return st


def hb(role, rank, phase, **info):
    return {"type": "heartbeat", "role": role, "rank": rank, "node": f"n{rank}", "phase": phase, "info": info}


def ready_all(st, t=101.0):
    for role, ranks in st.ranks.items():
        for i in range(len(ranks)):
            info = {"collective_ok": True}
            if i == 0:
                info["cross_group"] = {"world": 4, "ok": True}
            st.apply(t, hb(role, i, "ready", **info))


def test_initial_document_has_the_schema(state):
    d = state.doc
    assert d["state"] == "RUNNING" and d["executor"] == "local" and d["attempt"] == 0
    assert set(d["roles"]) == {"actor", "rollout", "reference", "actor_fwd"}
    a = d["roles"]["actor"]
    assert a["ranks"] == 2 and a["phase"] == "starting" and a["het_nodelist"] == "localhost"
    assert d["roles"]["actor_fwd"]["het_group"] == d["roles"]["reference"]["het_group"]
    assert d["cross_group"] == {"world": 4, "ok": None}


def test_ready_needs_every_rank_and_phases_never_go_back(state):
    state.apply(101, {"type": "hello", "role": "actor", "rank": 0, "world": 2, "node": "n0", "pid": 7})
    assert state.doc["roles"]["actor"]["phase"] == "bootstrap"
    state.apply(102, hb("actor", 0, "ready", collective_ok=True))
    assert state.doc["roles"]["actor"]["ranks_ready"] == 1 and state.doc["roles"]["actor"]["phase"] == "bootstrap"
    state.apply(103, hb("actor", 1, "ready", collective_ok=True))
    assert state.doc["roles"]["actor"]["phase"] == "ready" and state.doc["roles"]["actor"]["collective_ok"] is True
    state.apply(104, hb("actor", 1, "bootstrap"))  # a late, stale heartbeat
    assert state.doc["roles"]["actor"]["phase"] == "ready"
    assert state.doc["roles"]["actor"]["pids"] == [7, None]


def test_cross_group_ok_once_every_member_reported(state):
    ready_all(state)
    assert state.doc["cross_group"] == {"world": 4, "ok": True}


def test_completes_only_when_all_done_and_all_steps_exited(state):
    ready_all(state)
    for role, ranks in state.ranks.items():
        for i in range(len(ranks)):
            state.apply(105, hb(role, i, "done"))
    state.check_complete()
    assert state.running
    for role in state.ranks:
        state.step_exited(role, 0)
    state.check_complete()
    assert state.doc["state"] == "COMPLETED" and state.doc["reason"] is None


def test_error_message_fails_the_run_with_role_rank_node_and_last_line(state):
    state.apply(101, {"type": "error", "role": "rollout", "rank": 0, "node": "node3",
                      "traceback": "Traceback (most recent call last):\n  File x\nValueError: bad prompt\n"})
    assert state.doc["state"] == "FAILED"
    assert state.doc["reason"] == "rollout rank 0 on node3 failed: ValueError: bad prompt"
    assert state.doc["roles"]["rollout"]["phase"] == "failed"
    state.step_exited("actor", 9)  # later failures do not replace the first reason
    assert state.doc["reason"].startswith("rollout")


def test_nonzero_exit_and_early_clean_exit_fail(state, tmp_path):
    state.step_exited("reference", 0)
    assert state.doc["state"] == "FAILED" and "before all its ranks reported done" in state.doc["reason"]


def test_silence_fails_the_role(state):
    ready_all(state, t=101.0)
    state.check_silence(150.0, timeout_s=60)
    assert state.running
    state.apply(155.0, hb("actor", 0, "ready"))
    state.check_silence(162.0, timeout_s=60)
    assert state.doc["state"] == "FAILED" and "no heartbeat for 61s" in state.doc["reason"]


def test_a_rank_that_never_reports_fails_after_the_timeout(state):
    state.check_silence(161.0, timeout_s=60)
    assert "never reported" in state.doc["reason"]


def test_unknown_roles_and_ranks_are_ignored(state):
    state.apply(101, hb("advantages", 0, "ready"))
    state.apply(101, hb("actor", 5, "ready"))
    assert state.running and state.doc["roles"]["actor"]["ranks_ready"] == 0


def test_write_is_atomic_private_json(state):
    state.write()
    path = state.run.state
    assert json.loads(path.read_text())["state"] == "RUNNING"
    assert path.stat().st_mode & 0o777 == 0o600
