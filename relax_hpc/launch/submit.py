"""relax-submit: recipe → checks → run directory → one het job (or a local run) → job.json.

Order matters and is the point of this module: everything that can refuse a recipe (the validator, the
checks against the cluster or this machine, rendering the template) runs *before* the run directory is made
or anything is submitted; if the submission itself fails, the run directory is removed again. So a refused
recipe leaves nothing behind, and a run directory always belongs to a submitted job.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.controller.steps import describe_steps
from relax_hpc.launch import localproc
from relax_hpc.launch.backend import launcher_for
from relax_hpc.launch.executors import ControllerTask, HetSlurmExecutor, RelaxLocalExecutor, runner_argv
from relax_hpc.launch.preflight import preflight_problems
from relax_hpc.launch.render import PACKAGE_ROOT, render_script
from relax_hpc.launch.slurm import parse_time
from relax_hpc.recipe import Recipe, RecipeError, dump_recipe, load_recipe
from relax_hpc.recipe.load import read_recipe
from relax_hpc.rundir import RunDir, create_run_dir, write_json, write_private
from relax_hpc.train.latest import read_latest


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


def plan(recipe_path: str | Path, overrides: list[str] | tuple[str, ...] = (), executor: str = "slurm",
         python: str | None = None) -> Plan:
    """Load, validate and check a recipe for ``executor``; raises RecipeError (nothing is created) with the
    validator's and the place's problems together, those about keys the user set first."""
    loaded = read_recipe(recipe_path, list(overrides))
    problems = list(loaded.problems)
    if loaded.typed:  # every value is the user's: check it against the place it runs too, even if refused already
        refused = {k for k, _, _ in problems}
        problems += [x for x in preflight_problems(loaded.recipe, executor, refused) if x not in problems]
    if problems:  # the keys the user set first: the command line's, then the file's, then derived ones
        raise RecipeError(loaded.ordered(problems), source=str(recipe_path))
    recipe = loaded.recipe
    p = Plan(recipe, str(recipe_path), list(overrides), executor, python or sys.executable,
             [Path.cwd(), Path(recipe_path).resolve().parent])
    try:  # a broken template is a recipe problem (also for a local run of the recipe): find it now
        p.script(p.runs_root / f"{recipe.run.name}-YYYYmmdd-HHMMSS")
    except RecipeError as e:
        raise RecipeError(e.problems, source=str(recipe_path)) from None
    return p


def would_be_run_dir(p: Plan) -> Path:
    return p.runs_root / f"{p.recipe.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def step_lines(p: Plan, run_dir: Path) -> list[str]:
    """The role steps' and the run's own engine steps' command lines, from the controller's own builder
    (:mod:`relax_hpc.controller.steps`)."""
    try:
        return describe_steps(p.recipe, run_dir, p.python, p.executor)
    except Exception as e:  # the step builder belongs to the controller; a dry run should still print the script
        return [f"# (step commands unavailable: {type(e).__name__}: {e})"]


def dry_run(p: Plan) -> dict:
    run_dir = would_be_run_dir(p)
    return {"dry_run": True, "executor": p.executor, "run_dir": str(run_dir), "run": run_dir.name,
            "job_id": None, "script": p.script(run_dir) if launcher_for(p.executor).batch_script else None,
            "steps": step_lines(p, run_dir)}


def _timeout_min(recipe: Recipe) -> float:
    return parse_time(recipe.slurm.time) / 60


def _submit_slurm(p: Plan, rd: RunDir, script: str):
    def render(argv: list[str]) -> str:
        if argv != runner_argv(p.python, rd.path / "submitit"):
            raise SubmitError(f"unexpected runner command {argv}")
        return script

    ex = HetSlurmExecutor(rd.path / "submitit", render, _timeout_min(p.recipe), p.recipe.slurm.max_requeues,
                          python=p.python)
    return ex.submit(ControllerTask(rd.path, resubmit))  # resubmit: for a controller whose requeue is refused


def _submit_local(p: Plan, rd: RunDir):
    env = {**p.recipe.slurm.env, "RELAX_EXECUTOR": "local", "RELAX_RUN_DIR": str(rd.path),
           "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1"}
    ex = RelaxLocalExecutor(rd.path / "submitit", env, rd.logs / "local.log", _timeout_min(p.recipe),
                            p.recipe.slurm.signal_lead_s, p.recipe.slurm.max_requeues, python=p.python)
    return ex.submit(ControllerTask(rd.path))


def _local_fields(job: Any, rd: RunDir) -> dict:
    """job.json's fields for a local run's process (its PID is its process group; the start time tells a
    reused PID apart)."""
    pid = int(job.job_id)
    return dict(job_id=str(pid), pid=pid, pgid=pid, pid_start=localproc.start_ticks(pid),
                local_log=str(rd.logs / "local.log"))


def submit(p: Plan) -> tuple[dict, Any]:
    """Make the run directory, submit, write job.json; returns (job.json contents, submitit job handle)."""
    rd = create_run_dir(p.runs_root, p.recipe.run.name)
    try:
        write_private(rd.recipe, dump_recipe(p.recipe))
        record: dict[str, Any] = {
            "run": rd.name, "run_dir": str(rd.path), "executor": p.executor,
            "job_name": p.recipe.slurm.job_name or f"relax-{p.recipe.run.name}",
            "recipe_source": str(Path(p.source).resolve()), "overrides": p.overrides,
            "submitit_folder": str(rd.path / "submitit"), "python": p.python,
            "host": socket.gethostname(), "user": getpass.getuser(),
        }
        if p.executor == "slurm":
            script = p.script(rd.path)
            write_private(rd.script, script)
            record["submitted_at"] = time.time()
            try:
                job = _submit_slurm(p, rd, script)
            except SubmitError:
                raise
            except Exception as e:  # submitit wraps sbatch's complaint in its own error types
                raise SubmitError(f"submitting the job failed: {str(e).strip()}") from None
            record.update(job_id=str(job.job_id), script=str(rd.script),
                          batch_log=str(rd.logs / f"batch-{job.job_id}.out"))
        else:
            record["submitted_at"] = time.time()
            try:
                job = _submit_local(p, rd)
            except Exception as e:
                raise SubmitError(f"could not start the local run: {e}") from None
            record.update(_local_fields(job, rd))
        write_json(rd.job, record)
    except BaseException:
        if not rd.job.exists():  # nothing was submitted: leave nothing behind
            shutil.rmtree(rd.path, ignore_errors=True)
        raise
    return record, job


def resume(run_dir: str | Path, executor: str | None = None, python: str | None = None) -> tuple[dict, Any]:
    """Start an ended run again in its own directory (``relax-submit --resume``): the controller resumes from
    ``checkpoints/latest``. Slurm runs get a continuation job (:func:`resubmit`); local runs a new process.
    A ``latest`` naming a missing or incomplete checkpoint raises :class:`~relax_hpc.train.latest.BrokenLatest`
    before anything is submitted or changed (resuming would start again at step 0). Returns (job.json contents, the submitit job handle or None)."""
    rd = RunDir(Path(run_dir).resolve())
    read_latest(rd.path / "checkpoints")  # a broken `latest` (BrokenLatest) is refused before anything is touched
    old = rd.read_json(rd.job, {}) or {}
    if (executor or old.get("executor", "slurm")) == "slurm":
        return resubmit(rd.path, python), None
    recipe = load_recipe(rd.recipe)
    p = Plan(recipe, str(rd.recipe), [], "local", python or old.get("python") or sys.executable, [rd.path])
    (rd.path / "cancel.json").unlink(missing_ok=True)  # an earlier relax-cancel is not this attempt's
    job = _submit_local(p, rd)
    record = dict(old, executor="local", **_local_fields(job, rd), submitted_at=time.time(), host=socket.gethostname(),
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
    recipe = load_recipe(rd.recipe)
    search = [Path.cwd()] + ([Path(old["recipe_source"]).parent] if old.get("recipe_source") else []) + [rd.path]
    p = Plan(recipe, str(rd.recipe), [], "slurm", python or old.get("python") or sys.executable, search)
    script = p.script(rd.path)
    write_private(rd.script, script)
    job = _submit_slurm(p, rd, script)
    record = dict(old, job_id=str(job.job_id), submitted_at=time.time(),
                  previous_job_ids=[*old.get("previous_job_ids", []), old.get("job_id")],
                  batch_log=str(rd.logs / f"batch-{job.job_id}.out"))
    write_json(rd.job, record)
    return record
