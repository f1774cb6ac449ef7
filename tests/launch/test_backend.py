"""The launcher's half of a backend (relax_hpc.launch.backend), and the check that keeps the executor names out
of the code's branches."""

import re
import socket
import subprocess
from pathlib import Path

import pytest

import relax_hpc
from relax_hpc.launch import localproc
from relax_hpc.launch.backend import CancelError, LocalLauncher, SlurmLauncher, launcher_for
from relax_hpc.rundir import RunDir

ROOT = Path(relax_hpc.__file__).resolve().parent
# Places still asking an executor's name rather than its backend (the launcher's submit, status, checks): each
# one moved behind the backend comes off this list. A new one fails the test.
LEFT = {"launch/preflight.py", "launch/status.py", "launch/submit.py"}


def test_no_branch_on_an_executor_s_name_outside_the_backends():
    name = re.compile(r"""[!=]=\s*["'](slurm|local)["']""")
    found = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if name.search(p.read_text())}
    assert found <= LEFT, f"compare with the run's backend instead (its properties): {sorted(found - LEFT)}"


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
