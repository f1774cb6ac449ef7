"""The launcher's half of a backend (relax_hpc.launch.backend), and the check that keeps the executor names out
of the code's branches."""

import re
import socket
import subprocess
from pathlib import Path

import pytest

import relax_hpc
from relax_hpc.launch import localproc
from relax_hpc.controller.backend import SlurmBackend
from relax_hpc.launch.backend import CancelError, Launcher, LocalLauncher, SlurmLauncher, launcher_for
from relax_hpc.launch.places import cuda_device_count
from relax_hpc.recipe import recipe_from_dict
from relax_hpc.rundir import RunDir

ROOT = Path(relax_hpc.__file__).resolve().parent


def test_no_branch_on_an_executor_s_name_outside_the_backends():
    name = re.compile(r"""[!=]=\s*["'](slurm|local)["']""")
    found = sorted(f"{p.relative_to(ROOT)}:{i}" for p in ROOT.rglob("*.py")
                   for i, line in enumerate(p.read_text().splitlines(), 1) if name.search(line))
    assert not found, f"ask the run's backend instead (a method or property of launch.backend.Launcher): {found}"


def test_launcher_for_a_job_json():
    assert type(launcher_for(None)) is SlurmLauncher  # a job.json from before the field existed
    assert type(launcher_for("local")) is LocalLauncher
    with pytest.raises(ValueError, match="unknown executor 'ray'"):
        launcher_for("ray")
    s, lo = SlurmLauncher(), LocalLauncher()
    assert s.job_label({"job_id": "12"}) == "Slurm job 12" and lo.job_label({"pid": 34}) == "local process 34"
    assert s.job_id_ok("12+1") and not s.job_id_ok("abc") and lo.job_id_ok("abc")
    assert (s.batch_script, s.follows, s.time_limited) == (True, False, True)
    assert (lo.batch_script, lo.follows, lo.time_limited) == (False, True, False)
    assert (s.component_label({"job_id": "12"}, 1), lo.component_label({"job_id": "34"}, 1)) == ("12+1", "local")


def test_local_cancel_stops_the_run_s_process_group_and_refuses_what_it_cannot_signal(tmp_path):
    rd = RunDir(tmp_path)
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        job = {"pid": p.pid, "pid_start": localproc.start_ticks(p.pid), "host": socket.gethostname()}
        assert LocalLauncher().cancel(rd, job, grace_s=5.0) == "terminated"
        assert p.wait(5) == -15
        with pytest.raises(CancelError, match="runs on host elsewhere: run relax-cancel there"):
            LocalLauncher().cancel(rd, {**job, "host": "elsewhere"}, grace_s=1.0)
        with pytest.raises(CancelError, match="names no process id"):
            LocalLauncher().cancel(rd, {"host": socket.gethostname()}, grace_s=1.0)
    finally:
        p.kill()
        p.wait()


def test_each_launcher_answers_the_whole_interface():
    class Half(SlurmBackend, Launcher):  # the controller's half only
        pass

    with pytest.raises(TypeError, match="abstract"):
        Half()
    asked = Launcher.__abstractmethods__
    assert {"place_problems", "job_state", "submit", "resume", "cancel"} <= asked
    for cls in (SlurmLauncher, LocalLauncher):
        assert not cls.__abstractmethods__, cls


def test_the_checks_of_a_place_are_its_backend_s(no_slurm_env, monkeypatch):
    monkeypatch.setenv("PATH", no_slurm_env["PATH"])
    rec = recipe_from_dict({"roles": {"actor": {"gpus_per_node": 1}}})
    [(key, _, message)] = SlurmLauncher().place_problems(rec, layout=True)  # sinfo is not there to ask
    assert key == "<cluster>" and message.startswith("cannot check the recipe against the cluster: ")
    assert message.endswith("Fix: check that Slurm answers (sinfo), or run with --local")
    assert SlurmLauncher().place_problems(rec, layout=False)[0][0] == "<cluster>"  # asked even without a layout
    have = cuda_device_count()
    local = LocalLauncher().place_problems(rec, layout=True)
    assert [k for k, _, _ in local] == ([] if have else ["roles.actor.gpus_per_node"])
    assert LocalLauncher().place_problems(rec, layout=False) == []  # a refused share_with: no layout to check
    assert LocalLauncher().place_problems(recipe_from_dict({}), layout=True) == []
