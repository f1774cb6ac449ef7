"""Finding a run: by name, by directory, by job id, or the latest one."""

from __future__ import annotations

import pytest

from relax_hpc.launch.runs import RunNotFound, find_run, list_runs
from relax_hpc.rundir import create_run_dir, write_json


def make(root, name, job_id, at):
    rd = create_run_dir(root, name)
    write_json(rd.job, {"run": rd.name, "run_dir": str(rd.path), "job_id": job_id, "executor": "slurm",
                        "submitted_at": at})
    return rd


def test_find_by_name_path_jobid_and_latest(tmp_path):
    root = tmp_path / "runs"
    a = make(root, "a", "11", 100.0)
    b = make(root, "b", "12", 200.0)
    create_run_dir(root, "never-submitted")  # no job.json: not a run
    assert [r.name for r in list_runs(root)] == [a.name, b.name]
    assert find_run(None, root) == b
    assert find_run(a.name, root) == a
    assert find_run(str(a.path), tmp_path / "elsewhere") == a
    assert find_run("11", root) == a
    assert find_run("12+3", root) == b  # a component id names its het job


def test_not_found_says_what_exists(tmp_path):
    root = tmp_path / "runs"
    a = make(root, "a", "11", 100.0)
    with pytest.raises(RunNotFound, match=a.name):
        find_run("nope", root)
    with pytest.raises(RunNotFound, match="no runs under"):
        find_run(None, tmp_path / "empty")
