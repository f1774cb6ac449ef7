"""The local backend (relax_hpc.backends.local): its steps as processes of this machine, and the run's process
group from outside."""

import socket
import subprocess

import pytest

from relax_hpc.backends import CancelError, LocalBackend
from relax_hpc.backends.local import LOCAL_REQUEUE_EXIT, LOCAL_STEPS
from relax_hpc.controller.state import RunState
from relax_hpc.controller.steps import describe_steps, step_commands
from relax_hpc.launch import localproc
from relax_hpc.launch.places import cuda_device_count
from relax_hpc.launch.tools import launcher_for
from relax_hpc.recipe import recipe_from_dict, role_steps


def test_where_it_runs(run, tiny):
    env = {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n7", "SLURM_JOB_NODELIST_HET_GROUP_0": "n[7-8]"}
    local = LocalBackend()
    assert (local.control_host(env), local.bind_host) == ("127.0.0.1", "127.0.0.1")
    doc = RunState(run, tiny, role_steps(tiny), local, env=env).doc
    assert doc["executor"] == "local" and {v["het_nodelist"] for v in doc["roles"].values()} == {"localhost"}


def test_a_role_is_one_process_per_rank_told_its_rank(run, tiny):
    steps = {c.role: c for c in step_commands(tiny, run.path, LocalBackend(), python="/py")}
    own = ["/py", "-m", "relax_hpc.roles.actor", str(run.path.resolve())]
    assert [p.argv for p in steps["actor"].procs] == [own, own]
    assert [p.env["RELAX_RANK"] for p in steps["actor"].procs] == ["0", "1"]
    lines = describe_steps(tiny, run.path, "/py", LocalBackend())
    assert lines[0].startswith("RELAX_LOCAL_RANK=0 RELAX_NODE=localhost RELAX_RANK=0 ") and lines[0].endswith(
        " ".join(own))


def test_room_for_more_engines(tiny_dict):
    local = LocalBackend()
    plain = recipe_from_dict(tiny_dict)
    assert local.spare_engines(plain, used=1, count=2) == LOCAL_STEPS - 1 and not local.spares_apart(plain)
    capped = recipe_from_dict({**tiny_dict, "rollout": {"elastic": {"max_engines": 3}}})
    assert local.spare_engines(capped, used=0, count=2) == 1 and not local.attaches


def test_an_attempt_comes_back_through_submitit_s_requeue_exit(run, tiny):
    called = []
    with pytest.raises(SystemExit) as e:
        LocalBackend().come_back(run, tiny, called.append, called.append)
    assert e.value.code == LOCAL_REQUEUE_EXIT == 144 and called == []  # neither scontrol nor a continuation job


def test_the_job_from_outside():
    lo = launcher_for("local")
    assert lo.job_label({"pid": 34}) == "local process 34" and lo.component_label({"job_id": "34"}, 1) == "local"
    assert lo.job_id_ok("abc")
    assert (lo.batch_script, lo.follows, lo.time_limited, lo.queued) == (False, True, False, False)


def test_cancel_stops_the_run_s_process_group_and_refuses_what_it_cannot_signal(run):
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        job = {"pid": p.pid, "pid_start": localproc.start_ticks(p.pid), "host": socket.gethostname()}
        assert launcher_for("local").cancel(run, job, grace_s=5.0) == "terminated"
        assert p.wait(5) == -15
        with pytest.raises(CancelError, match="runs on host elsewhere: run relax-cancel there"):
            launcher_for("local").cancel(run, {**job, "host": "elsewhere"}, grace_s=1.0)
        with pytest.raises(CancelError, match="names no process id"):
            launcher_for("local").cancel(run, {"host": socket.gethostname()}, grace_s=1.0)
    finally:
        p.kill()
        p.wait()


def test_the_checks_of_its_place_are_this_machine_s_gpus():
    rec = recipe_from_dict({"roles": {"actor": {"gpus_per_node": 1}}})
    local = launcher_for("local").place_problems(rec, layout=True)
    assert [k for k, _, _ in local] == ([] if cuda_device_count() else ["roles.actor.gpus_per_node"])
    assert launcher_for("local").place_problems(rec, layout=False) == []  # a refused share_with: no layout to check
    assert launcher_for("local").place_problems(recipe_from_dict({}), layout=True) == []
