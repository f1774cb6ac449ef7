"""Finding a run: by name, by directory, by job id, or the latest one."""

from __future__ import annotations

import os

import pytest

from relax_hpc.launch.runs import RunNotFound, RunUnreadable, find_run, list_runs, load_job
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


def test_find_by_the_recipes_run_name_takes_the_latest_of_that_name(tmp_path):
    """`relax-status quickstart-slurm` (run.name, as the recipes' headers say): the latest run of that name,
    never one whose name only starts with it."""
    root = tmp_path / "runs"
    old = make(root, "walk", "21", 100.0)
    os.rename(old.path, root / "walk-20260101-000000")
    new = make(root, "walk", "22", 200.0)
    make(root, "walk-long", "23", 300.0)
    assert find_run("walk", root).name == new.name
    assert find_run("walk-long", root).name.startswith("walk-long-")
    with pytest.raises(RunNotFound):
        find_run("wal", root)


def test_not_found_says_what_exists(tmp_path):
    root = tmp_path / "runs"
    a = make(root, "a", "11", 100.0)
    with pytest.raises(RunNotFound, match=a.name):
        find_run("nope", root)
    with pytest.raises(RunNotFound, match="no runs under"):
        find_run(None, tmp_path / "empty")


def test_a_damaged_job_json_is_named_not_skipped_or_mistaken(tmp_path):
    """A run whose job.json cannot be used is found (by path, by name, as the latest) and refused with one line
    naming the file; searching by job id passes over it; a run directory without any job.json is not a run."""
    root = tmp_path / "runs"
    a = make(root, "a", "11", 100.0)
    b = make(root, "b", "12", 200.0)
    b.job.write_text('["not", "an", "object"]')
    with pytest.raises(RunUnreadable, match=rf"^{b.job}: holds an array where a JSON object should be$"):
        find_run(str(b.path), root)
    with pytest.raises(RunUnreadable, match=r"job\.json: holds an array"):
        find_run(b.name, root)
    with pytest.raises(RunUnreadable, match=r"job\.json: holds an array"):
        find_run(None, root)  # the latest run is the damaged one: say so, not show an older run
    assert find_run("11", root) == a
    b.job.unlink()
    b.job.mkdir()
    with pytest.raises(RunUnreadable, match=r"job\.json: is a directory, not a regular file"):
        find_run(str(b.path), root)
    b.job.rmdir()
    os.mkfifo(b.job)  # never opened for reading: no hang
    with pytest.raises(RunUnreadable, match=r"job\.json: is a FIFO"):
        find_run(str(b.path), root)
    assert [r.name for r in list_runs(root)][0] == a.name


def test_job_json_fields_are_checked(tmp_path):
    root = tmp_path / "runs"
    rd = make(root, "a", "11", 100.0)
    write_json(rd.job, {"job_id": ["11"], "executor": "slurm"})
    with pytest.raises(RunUnreadable, match=r"field 'job_id' is \['11'\], not a job id"):
        load_job(rd)
    write_json(rd.job, {"job_id": 11, "pid": True})
    with pytest.raises(RunUnreadable, match=r"field 'pid' is True, not a process id"):
        load_job(rd)
    write_json(rd.job, {"job_id": "11+0", "executor": "local", "pid": 5, "pid_start": 9})
    assert load_job(rd)["pid"] == 5
