"""submitit extended: het job ids in the watcher, the checkpointable controller task, the local executor's
process group, and (on the dev cluster) a real het job submitted through HetSlurmExecutor."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import cloudpickle
import pytest

from relax_hpc.backends import SlurmBackend
from relax_hpc.launch.executors import (ControllerTask, HetSlurmExecutor, HetSlurmInfoWatcher, RelaxLocalExecutor,
                                        read_result, runner_argv)
from relax_hpc.launch.render import render_script
from relax_hpc.launch.slurm import parse_time
from relax_hpc.recipe import recipe_from_dict

from . import stub_tasks
from .conftest import REPO, TESTS

SACCT = """JobID|State|NodeList
12+0|RUNNING|node[1-2]
12+0.batch|RUNNING|node1
12+1|RUNNING|node3
12+1.0|RUNNING|node3
13+0|COMPLETED|node1
13+1|FAILED|node2
14+0|CANCELLED by 0|node1
14+1|CANCELLED by 0|node2
15|COMPLETED|node4
"""


def test_watcher_understands_het_ids():
    info = HetSlurmInfoWatcher().read_info(SACCT)
    assert info["12"]["State"] == "RUNNING" and info["12"]["NodeList"] == "node[1-2],node3"
    assert info["13"]["State"] == "FAILED"  # the worst component
    assert info["14"]["State"] == "CANCELLED"
    assert info["12+1"]["State"] == "RUNNING" and "12+0.batch" not in info
    assert info["15"]["State"] == "COMPLETED"  # plain jobs as before


def test_watcher_is_done_for_het_jobs():
    w = HetSlurmInfoWatcher()
    w._info_dict.update(w.read_info(SACCT))
    assert not w.is_done("12", mode="cache") and w.is_done("13", mode="cache")


def test_a_het_job_seen_as_one_plain_final_row_is_not_done_until_its_het_rows(monkeypatch):
    """sacct briefly shows a just-ended het job as plain ``15|COMPLETED``; submitit would cache that as final
    and never ask again (the CI failure this test pins)."""
    clock = [1000.0]
    monkeypatch.setattr("relax_hpc.launch.executors.time.monotonic", lambda: clock[0])
    w = HetSlurmInfoWatcher()
    w.expect_het("15")
    w._info_dict.update(w.read_info(SACCT))
    assert w._info_dict["15"]["State"] == "COMPLETED" and not w.is_done("15", mode="cache")
    w._info_dict.update(w.read_info("JobID|State|NodeList\n15+0|COMPLETED|node4\n15+1|COMPLETED|node1\n"))
    assert w.is_done("15", mode="cache") and w._info_dict["15"]["HetComponents"] == "2"
    w.expect_het("16")  # a dbd that never splits it: done after the grace period, so result() cannot hang
    w._info_dict.update(w.read_info("JobID|State|NodeList\n16|FAILED|node1\n"))
    assert not w.is_done("16", mode="cache")
    clock[0] += w.HET_ROWS_GRACE_S + 1
    assert w.is_done("16", mode="cache")


def test_controller_task_is_checkpointable_and_picklable(tmp_path):
    task = ControllerTask(tmp_path)
    again = task.checkpoint()
    assert isinstance(again.function, ControllerTask) and again.function.run_dir == str(tmp_path)
    clone = pickle.loads(cloudpickle.dumps(task))
    assert clone.run_dir == str(tmp_path)
    from relax_hpc.launch.submit import resubmit

    task = ControllerTask(tmp_path, resubmit)
    assert task.checkpoint().function.resubmit is resubmit  # a requeued task can still resubmit
    assert pickle.loads(cloudpickle.dumps(task)).resubmit is resubmit  # pickled by reference
    # a job pickled before the submit helpers moved to launch.jobs names the old module: it must still load
    from relax_hpc.launch import jobs

    assert pickle.loads(b"crelax_hpc.launch.submit\nresubmit\n.") is jobs.resubmit
    legacy = ControllerTask.__new__(ControllerTask)
    legacy.__dict__.update(run_dir=str(tmp_path))  # pickled before the attribute existed
    assert legacy.resubmit is None


def test_controller_task_hands_the_controller_the_launchers_ways_back(tmp_path, monkeypatch):
    """The controller never imports launch: ControllerTask injects scontrol requeue, resubmit and the way to add
    engines (relax-scale's capacity)."""
    from relax_hpc.launch import attach, slurm

    got = {}
    monkeypatch.setattr("relax_hpc.controller.loop.run_controller", lambda run_dir, **kw: got.update(kw, run_dir=run_dir))
    resubmit = object()
    ControllerTask(tmp_path, resubmit)()
    assert got == {"run_dir": str(tmp_path), "requeue_job": slurm.scontrol_requeue, "resubmit": resubmit,
                   "capacity": attach}


@pytest.mark.parametrize("refused", [False, True])
def test_come_back_on_slurm_uses_the_injected_requeue_then_resubmit(tmp_path, monkeypatch, refused):
    from relax_hpc.controller.requeue import come_back
    from relax_hpc.launch.slurm import SlurmError
    from relax_hpc.rundir import RunDir

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    calls = []

    def requeue_job(job_id):
        calls.append(("requeue", job_id))
        if refused:
            raise SlurmError("scontrol requeue 77 failed (exit 1): Requested operation is presently disabled")

    def resubmit(path):
        calls.append(("resubmit", path))
        return {"job_id": "78"}

    run, recipe = RunDir(tmp_path), recipe_from_dict({})
    out = come_back(run, recipe, SlurmBackend(), requeue_job, resubmit)
    assert out == ("continuation job 78" if refused else "requeued job 77")
    assert calls == [("requeue", "77")] + ([("resubmit", tmp_path)] if refused else [])
    with pytest.raises(RuntimeError, match="cannot come back by itself"):
        come_back(run, recipe, SlurmBackend())  # python -m relax_hpc.controller: no launcher, no way back


def local_executor(tmp_path, **env) -> RelaxLocalExecutor:
    return RelaxLocalExecutor(tmp_path / "submitit", {"RELAX_EXECUTOR": "local", **env}, tmp_path / "local.log",
                              timeout_min=5, signal_delay_s=30, max_num_timeout=2)


def test_local_executor_runs_in_its_own_session(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{TESTS}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    ex = local_executor(tmp_path, EXTRA="a b; c")
    out = tmp_path / "env.txt"
    job = ex.submit(stub_tasks.write_env, str(out), "RELAX_EXECUTOR", "EXTRA", "CUDA_VISIBLE_DEVICES")
    pid = int(job.job_id)
    assert os.getpgid(pid) == pid  # session leader: relax-cancel signals the whole group
    result = job.result()
    assert result == {"RELAX_EXECUTOR": "local", "EXTRA": "a b; c", "CUDA_VISIBLE_DEVICES": "7"}
    assert read_result(ex.folder, job.job_id) == ("success", result)


def test_local_executor_reports_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{TESTS}")
    ex = local_executor(tmp_path)
    job = ex.submit(stub_tasks.fail, "boom 42")
    with pytest.raises(Exception, match="boom 42"):
        job.result()
    outcome, trace = read_result(ex.folder, job.job_id)
    assert outcome == "error" and "boom 42" in trace


def two_groups(tmp_path) -> tuple:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    recipe = recipe_from_dict({"run": {"name": "exec-test"}, "slurm": {"partition": "debug", "time": "00:05:00"},
                               "roles": {"actor": {"nodes": 2}, "rollout": {"nodes": 1, "gpus_per_node": 2}}})
    return recipe, run_dir


@pytest.mark.slurm
def test_het_slurm_executor_end_to_end(slurm_cluster, tmp_path):
    """A real 2-component het job through submitit: pickled callable run by the batch script, its result back
    through submitit, and the watcher's state for the het id is COMPLETED (plain submitit says UNKNOWN)."""
    recipe, run_dir = two_groups(tmp_path)
    folder = run_dir / "submitit"

    def render(argv):
        assert argv == runner_argv(ex.raw_python, folder)
        return render_script(recipe, run_dir, argv, f"{REPO}{os.pathsep}{TESTS}")

    ex = HetSlurmExecutor(folder, render, parse_time(recipe.slurm.time) / 60, max_num_timeout=1)
    job = ex.submit(stub_tasks.write_env, str(tmp_path / "env.txt"), "SLURM_HET_SIZE", "RELAX_EXECUTOR",
                    "SUBMITIT_EXECUTOR", "SLURM_JOB_NODELIST_HET_GROUP_1")
    assert job.job_id.isdigit()
    submitted = Path(job.paths.submission_file).read_text()
    assert submitted.count("#SBATCH hetjob") == 1
    result = job.result()
    assert result["SLURM_HET_SIZE"] == "2" and result["RELAX_EXECUTOR"] == "slurm"
    assert result["SUBMITIT_EXECUTOR"] == "slurm" and result["SLURM_JOB_NODELIST_HET_GROUP_1"]
    deadline = time.monotonic() + 60  # sacct is eventually consistent (briefly, a het job shows as a plain id)
    while True:
        info = job.watcher.get_info(job.job_id, mode="force")
        if (info.get("State") == "COMPLETED" and "HetComponents" in info) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert info.get("State") == "COMPLETED" and info.get("HetComponents") == "2", info


@pytest.mark.slurm
def test_het_slurm_executor_failure_is_seen(slurm_cluster, tmp_path):
    recipe, run_dir = two_groups(tmp_path)
    folder = run_dir / "submitit"
    ex = HetSlurmExecutor(folder, lambda argv: render_script(recipe, run_dir, argv, f"{REPO}{os.pathsep}{TESTS}"),
                          5, max_num_timeout=1)
    job = ex.submit(stub_tasks.fail, "het boom")
    with pytest.raises(Exception, match="het boom"):
        job.result()
    deadline = time.monotonic() + 60
    while (state := job.watcher.get_state(job.job_id, mode="force")) != "FAILED" and time.monotonic() < deadline:
        time.sleep(1)
    assert state == "FAILED"
