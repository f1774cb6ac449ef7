"""Starting a run's job, each backend's way: the het job through submitit's Slurm executor (:func:`submit_slurm`),
the local process (:func:`submit_local`), and the continuation job of a Slurm run (:func:`resubmit`). relax-submit
(:mod:`relax_hpc.launch.submit`) decides when; the backends (:mod:`relax_hpc.backends`) which.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.controller import recipe_copy
from relax_hpc.launch import localproc
from relax_hpc.launch.executors import ControllerTask, HetSlurmExecutor, RelaxLocalExecutor, runner_argv
from relax_hpc.launch.render import PACKAGE_ROOT, render_script
from relax_hpc.launch.slurm import parse_time
from relax_hpc.recipe import Recipe
from relax_hpc.rundir import RunDir, write_json, write_private


class SubmitError(RuntimeError):
    """The recipe was fine but submitting failed (sbatch refused, the local process did not start)."""


@dataclass
class Plan:
    """A checked recipe and what would be submitted for it."""

    recipe: Recipe
    source: str
    overrides: list[str]
    executor: str  # "slurm" | "local"
    python: str
    search: list[Path] = field(default_factory=list)  # where a relative slurm.template is looked up

    @property
    def runs_root(self) -> Path:
        return Path(self.recipe.run.runs_root).expanduser().resolve()

    def script(self, run_dir: Path) -> str:
        # the script prepends this to the job's PYTHONPATH (sbatch passes the submitter's environment on)
        return render_script(self.recipe, run_dir, runner_argv(self.python, run_dir / "submitit"),
                             str(PACKAGE_ROOT), self.search)


def pythonpath() -> str:
    """PYTHONPATH for a local run: it imports the same relax_hpc as the submitter, whatever its directory."""
    old = os.environ.get("PYTHONPATH")
    return str(PACKAGE_ROOT) + (os.pathsep + old if old else "")


def _timeout_min(recipe: Recipe) -> float:
    return parse_time(recipe.slurm.time) / 60


def submit_slurm(p: Plan, rd: RunDir, script: str):
    def render(argv: list[str]) -> str:
        if argv != runner_argv(p.python, rd.path / "submitit"):
            raise SubmitError(f"unexpected runner command {argv}")
        return script

    ex = HetSlurmExecutor(rd.path / "submitit", render, _timeout_min(p.recipe), p.recipe.slurm.max_requeues,
                          python=p.python)
    return ex.submit(ControllerTask(rd.path, resubmit))  # resubmit: for a controller whose requeue is refused


def submit_local(p: Plan, rd: RunDir):
    env = {**p.recipe.slurm.env, "RELAX_EXECUTOR": "local", "RELAX_RUN_DIR": str(rd.path),
           "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1"}
    ex = RelaxLocalExecutor(rd.path / "submitit", env, rd.logs / "local.log", _timeout_min(p.recipe),
                            p.recipe.slurm.signal_lead_s, p.recipe.slurm.max_requeues, python=p.python)
    return ex.submit(ControllerTask(rd.path))


def local_fields(job: Any, rd: RunDir) -> dict:
    """job.json's fields for a local run's process (its PID is its process group; the start time tells a
    reused PID apart)."""
    pid = int(job.job_id)
    return dict(job_id=str(pid), pid=pid, pgid=pid, pid_start=localproc.start_ticks(pid),
                local_log=str(rd.logs / "local.log"))


def start_slurm(p: Plan, rd: RunDir) -> tuple[dict, Any]:
    """Write the batch script and submit the het job; (job.json's fields for it, the submitit job)."""
    script = p.script(rd.path)
    write_private(rd.script, script)
    submitted_at = time.time()
    try:
        job = submit_slurm(p, rd, script)
    except SubmitError:
        raise
    except Exception as e:  # submitit wraps sbatch's complaint in its own error types
        raise SubmitError(f"submitting the job failed: {str(e).strip()}") from None
    return dict(submitted_at=submitted_at, job_id=str(job.job_id), script=str(rd.script),
                batch_log=str(rd.logs / f"batch-{job.job_id}.out")), job


def start_local(p: Plan, rd: RunDir) -> tuple[dict, Any]:
    """Start the run's local process; (job.json's fields for it, the submitit job)."""
    submitted_at = time.time()
    try:
        job = submit_local(p, rd)
    except Exception as e:
        raise SubmitError(f"could not start the local run: {e}") from None
    return dict(submitted_at=submitted_at, **local_fields(job, rd)), job


def resume_local(rd: RunDir, old: dict, python: str | None = None) -> tuple[dict, Any]:
    """A new local process for an ended run (its job.json was ``old``); (the new job.json, the submitit job)."""
    recipe = recipe_copy.load(rd)  # with its secrets
    p = Plan(recipe, str(rd.recipe), [], "local", python or old.get("python") or sys.executable, [rd.path])
    (rd.path / "cancel.json").unlink(missing_ok=True)  # an earlier relax-cancel is not this attempt's
    job = submit_local(p, rd)
    record = dict(old, executor="local", **local_fields(job, rd), submitted_at=time.time(), host=socket.gethostname(),
                  previous_job_ids=[*old.get("previous_job_ids", []), old.get("job_id")])
    write_json(rd.job, record)
    return record, job


def resubmit(run_dir: str | Path, python: str | None = None) -> dict:
    """Submit an existing Slurm run again as a new job (for a controller whose requeue was refused).

    Re-renders the script from ``RUN_DIR/recipe.yaml`` (same run directory, so the new job resumes from its
    checkpoints), submits it through the same executor, and records the new id in job.json (the old one in
    ``previous_job_ids``). Returns the updated job.json contents."""
    rd = RunDir(Path(run_dir).resolve())
    old = rd.read_json(rd.job, {}) or {}
    recipe = recipe_copy.load(rd)  # with its secrets
    search = [Path.cwd()] + ([Path(old["recipe_source"]).parent] if old.get("recipe_source") else []) + [rd.path]
    p = Plan(recipe, str(rd.recipe), [], "slurm", python or old.get("python") or sys.executable, search)
    script = p.script(rd.path)
    write_private(rd.script, script)
    job = submit_slurm(p, rd, script)
    record = dict(old, job_id=str(job.job_id), submitted_at=time.time(),
                  previous_job_ids=[*old.get("previous_job_ids", []), old.get("job_id")],
                  batch_log=str(rd.logs / f"batch-{job.job_id}.out"))
    write_json(rd.job, record)
    return record
