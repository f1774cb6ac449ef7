"""How the controller judges roles: phases, readiness, failures (first one wins), silence, completion."""

import json
import os
import threading

import pytest

from ctl_helpers import TINY, make_run
from relax_hpc.backends import LocalBackend
from relax_hpc.controller.state import RunState
from relax_hpc.recipe import load_recipe, role_steps


@pytest.fixture
def state(tmp_path):
    run = make_run(tmp_path)
    recipe = load_recipe(run.recipe)
    st = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={})
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



def test_a_failure_that_will_be_restarted_is_never_published_as_the_end(tmp_path):
    """A step's crash with a restart left: state.json says RUNNING (phase restarting, the failure named) from the
    first write on, through the restart, so a watcher never reads FAILED for a run that goes on; the restarted try
    records how the one before ended. With no restart left the same failure is FAILED at once."""
    run = make_run(tmp_path, {**TINY, "checkpoint": {"max_restarts": 1}})
    recipe = load_recipe(run.recipe)
    st = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={})
    st.step_exited("actor", -9)
    assert st.doc["state"] == "FAILED" and st.will_restart and not st.running  # the attempt itself is over
    st.write()
    doc = json.loads(run.state.read_text())
    assert (doc["state"], doc["phase"], doc["reason"]) == ("RUNNING", "restarting", None)
    assert "actor failed: step exited with code -9" in doc["restarting"] == doc["last_failure"]
    again = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={}, restart=True)
    assert again.doc["restarts"] == 1 and "restarting" not in again.doc
    assert again.doc["history"][-1]["state"] == "FAILED" and "code -9" in again.doc["history"][-1]["reason"]
    again.step_exited("actor", -9)  # the one restart is used: this failure ends the run
    assert not again.will_restart
    again.write()
    doc = json.loads(run.state.read_text())
    assert doc["state"] == "FAILED" and "code -9" in doc["reason"] and "restarting" not in doc
    for kind in ("permanent", "task"):  # failures a restart cannot fix are published at once
        st = RunState(create_run(tmp_path, kind), recipe, role_steps(recipe), LocalBackend(), env={})
        st.fail("rollout", 0, "n0", "ValueError: bad data", kind=kind)
        st.write()
        assert json.loads(st.run.state.read_text())["state"] == "FAILED"


def create_run(tmp_path, name):
    return make_run(tmp_path / name, {**TINY, "checkpoint": {"max_restarts": 1}})


# ------------------------------------------------------------------------------------------ hung tasks ---

@pytest.fixture
def hung_state(tmp_path):
    """The tiny run with logging.task_timeout_s = 100 (heartbeat_timeout_s stays 60)."""
    return _state_with(tmp_path, task_timeout_s=100)


def _state_with(tmp_path, **logging):
    # the global tier (a hung rollout alone would be restarted alone: tests/controller/test_role_restart.py)
    recipe = {**TINY, "logging": {**TINY["logging"], **logging}, "health": {"max_role_restarts": 0}}
    run = make_run(tmp_path, recipe)
    loaded = load_recipe(run.recipe)
    st = RunState(run, loaded, role_steps(loaded), LocalBackend(), env={})
    for role in st.ranks:
        st.step_started(role, 100.0)
    ready_all(st)
    return st


def task(progress, id=3, kind="generate", step=7):
    return {"id": id, "kind": kind, "step": step, "progress": progress}


def beat(st, t, rollout_task="unchanged"):
    """Every rank heartbeats at ``t`` (none is silent); rollout rank 0 shows ``rollout_task`` if given."""
    for role, ranks in st.ranks.items():
        for i in range(len(ranks)):
            info = {"task": rollout_task} if (role, i) == ("rollout", 0) and rollout_task != "unchanged" else {}
            st.apply(t, hb(role, i, "ready", **info))
    st.check_silence(t, timeout_s=60)


def test_a_task_that_keeps_progressing_is_never_hung(hung_state):
    for n, t in enumerate(range(110, 1000, 50)):  # 900 s in one task, progress every 50 s
        beat(hung_state, t, task(n))
    assert hung_state.running


def test_a_task_without_progress_past_the_timeout_fails_the_role_naming_the_task(hung_state):
    beat(hung_state, 110, task(0))
    beat(hung_state, 160, task(1))  # progressed at 160
    beat(hung_state, 210, task(1))  # heartbeats go on: not silent, but not progressing either
    beat(hung_state, 260, task(1))
    assert hung_state.running  # 100 s without progress is still within the timeout
    beat(hung_state, 261, task(1))
    assert hung_state.doc["state"] == "FAILED"
    f = hung_state.failure
    assert (f.role, f.rank, f.kind) == ("rollout", 0, "role")  # role: restarted in place from the checkpoint
    assert hung_state.doc["reason"].startswith("rollout rank 0 on n0 failed: task generate (step 7) made no "
                                               "progress for 101s (logging.task_timeout_s=100)")


def test_a_new_task_is_progress_and_a_task_without_step_is_named_by_its_id(hung_state):
    beat(hung_state, 110, task(5, id=3))
    beat(hung_state, 200, task(5, id=4, kind="sync", step=None))  # the next task, same counter
    beat(hung_state, 290, task(5, id=4, kind="sync", step=None))
    assert hung_state.running
    beat(hung_state, 301, task(5, id=4, kind="sync", step=None))
    assert "task sync (id 4) made no progress for 101s" in hung_state.doc["reason"]


def test_a_role_with_no_task_never_times_out(hung_state):
    beat(hung_state, 110, task(0))
    beat(hung_state, 150, None)  # the task ended: idle, long-polling for the next
    for t in range(200, 5000, 50):
        beat(hung_state, t)
    assert hung_state.running


def test_task_timeout_zero_turns_the_check_off(tmp_path):
    st = _state_with(tmp_path, task_timeout_s=0)
    beat(st, 110, task(0))
    for t in range(150, 5000, 50):
        beat(st, t)
    assert st.running


def test_the_default_task_timeout_is_half_an_hour(state):
    assert state.task_timeout_s == 1800


@pytest.mark.parametrize("info", [
    {"cross_group": "x"}, {"cross_group": {"ok": "yes"}}, {"collective_ok": "true"}, {"nodes": 5},
    {"nodes": [1, None]}, {"task": "generate"}, {"task": {"id": [], "progress": {}}},
])
def test_wrong_typed_info_that_got_through_is_ignored_never_raised_on(state, info):
    ready_all(state)
    state.apply(102, hb("actor", 0, "ready", **info))
    state.check_silence(103, timeout_s=60)
    d = state.doc
    assert state.running and d["roles"]["actor"]["nodes"] == ["n0", "n1"]
    assert d["roles"]["actor"]["collective_ok"] in (True, None) and d["cross_group"]["ok"] in (True, None)


# ----------------------------------------------------------------------------- failure classes, a full disk ---

ERROR = {"type": "error", "role": "rollout", "rank": 0, "node": "node3",
         "traceback": "Traceback (most recent call last):\n  File x\n"
                      "DataError: d.jsonl: line 1: missing key 'prompt'\n"}


@pytest.mark.parametrize("verdict, kind", [(None, "role"), ("permanent", "permanent"), ("no_space", "no_space")])
def test_an_errors_verdict_decides_whether_a_restart_may_help(state, verdict, kind):
    """Only ``role`` failures are restarted (controller/loop.py): a role's error that will repeat, or a full disk,
    is not."""
    state.apply(101, {**ERROR, **({"verdict": verdict} if verdict else {})})
    assert state.failure.kind == kind and state.doc["state"] == "FAILED"
    assert state.doc["reason"] == "rollout rank 0 on node3 failed: DataError: d.jsonl: line 1: missing key 'prompt'"


def test_an_errors_reason_replaces_the_tracebacks_last_line(state):
    state.apply(101, {**ERROR, "verdict": "no_space", "reason": "no space left on /scratch (...). Fix: ..."})
    assert state.doc["reason"] == "rollout rank 0 on node3 failed: no space left on /scratch (...). Fix: ..."
    assert state.doc["roles"]["rollout"]["error"] == "no space left on /scratch (...). Fix: ..."


def disk_state(small_disk, size_mib=8):
    disk = small_disk(size_mib)
    run = make_run(disk.path)
    recipe = load_recipe(run.recipe)
    st = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={})
    for role in st.ranks:
        st.step_started(role, 100.0)
    ready_all(st)
    st.write()
    return disk, run, st


def test_a_state_write_on_a_full_disk_lands_even_while_another_writer_takes_every_freed_block(small_disk):
    """The failure goes into the reserve's own blocks: a role still writing to the full disk (here a thread that
    takes every block that comes free, as fast as it can) cannot take the room before state.json does."""
    disk, run, st = disk_state(small_disk)
    disk.fill()
    stop, took = threading.Event(), [0]

    def thief():
        fd = os.open(disk.path / "thief", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while not stop.is_set():
                try:
                    took[0] += os.write(fd, b"\0" * 4096)
                except OSError:
                    pass
        finally:
            os.close(fd)

    t = threading.Thread(target=thief, daemon=True)
    t.start()
    try:
        st.apply(102.0, hb("actor", 0, "ready"))
        st.write()
    finally:
        stop.set()
        t.join()
    on_disk = json.loads(run.state.read_text())
    assert on_disk["state"] == "FAILED" and f"no space left on {disk.path}" in on_disk["reason"]
    assert not run.reserve.exists() and not list(run.path.glob(".state.json.*"))  # no temporary file left


def test_a_state_write_on_a_full_disk_frees_the_reserve_and_records_the_failure(small_disk):
    disk, run, st = disk_state(small_disk)
    disk.fill()
    st.apply(102.0, hb("actor", 0, "ready"))
    st.write()  # ENOSPC: the reserve goes, the run fails naming the disk, and that is what lands
    on_disk = json.loads(run.state.read_text())
    assert on_disk["state"] == "FAILED" and st.failure.kind == "no_space"  # no restart: the disk is still full
    assert on_disk["reason"] == (f"controller failed: no space left on {disk.path} (writing {run.state}; No space "
                                 f"left on device). Fix: free space on {disk.path} (or raise the quota), then "
                                 f"relax-submit --resume {run.path}")
    assert on_disk["last_failure"] == on_disk["reason"] and not run.reserve.exists()
    st.event("failed", on_disk["reason"])
    st.write()  # the end's writes go on in the space freed
    assert json.loads(run.state.read_text())["events"][-1]["event"] == "failed"


def test_without_a_reserve_a_full_disk_is_logged_and_the_write_tried_again_later(small_disk, caplog):
    disk, run, st = disk_state(small_disk)
    run.release_reserve()
    disk.fill()
    st.apply(102.0, hb("actor", 0, "ready"))
    st.write()  # never raises into the controller's loop
    assert json.loads(run.state.read_text())["state"] == "RUNNING" and st.doc["state"] == "FAILED"
    assert f"could not write {run.state}" in caplog.text and st.dirty
    disk.free()
    st.write()
    assert json.loads(run.state.read_text())["state"] == "FAILED"


def test_a_failure_seen_while_the_disk_is_full_is_the_disks(small_disk):
    """A writer that lost the errno (torch: "file write failed") still ends the run as a full disk: no restart."""
    disk, run, st = disk_state(small_disk)
    disk.fill()
    st.step_exited("actor", 1, "RuntimeError: PytorchStreamWriter failed writing file data/0: file write failed")
    assert st.failure.kind == "no_space"
    assert st.doc["reason"].startswith("actor failed: step exited with code 1: RuntimeError: PytorchStreamWriter")
    assert f"; no space left on {disk.path} (" in st.doc["reason"] and "relax-submit --resume" in st.doc["reason"]
