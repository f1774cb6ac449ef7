"""relax-submit: recipe → checks → run directory → one het job (or a local run) → job.json.

Order matters and is the point of this module: everything that can refuse a recipe (the validator, the
checks against the cluster or this machine, rendering the template) runs *before* the run directory is made
or anything is submitted; if the submission itself fails, the run directory is removed again. So a refused
recipe leaves nothing behind, and a run directory always belongs to a submitted job. How a job starts is its
backend's (:meth:`~relax_hpc.backends.Backend.submit`, over :mod:`relax_hpc.launch.jobs`).
"""

from __future__ import annotations

import dataclasses
import getpass
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from relax_hpc.backends import container
from relax_hpc.controller import recipe_copy
from relax_hpc.controller.steps import describe_steps
from relax_hpc.launch import provenance
from relax_hpc.launch.tools import launcher_for
from relax_hpc.launch.jobs import Plan, SubmitError, pythonpath, resubmit
from relax_hpc.launch.layouts import unasked
from relax_hpc.launch.preflight import preflight_problems
from relax_hpc.recipe import RecipeError
from relax_hpc.recipe.load import read_recipe
from relax_hpc.rundir import RunDir, create_run_dir, mask_override, write_json
from relax_hpc.train.latest import read_latest

# Plan, SubmitError and resubmit are relax-submit's names too (a task pickled before they moved to
# launch.jobs names launch.submit.resubmit)
__all__ = ["Plan", "SubmitError", "dry_run", "plan", "pythonpath", "resubmit", "resume", "submit"]


def plan(recipe_path: str | Path, overrides: list[str] | tuple[str, ...] = (), executor: str = "slurm",
         python: str | None = None, check_place: bool = True) -> Plan:
    """Load, validate and check a recipe for ``executor``; raises RecipeError (nothing is created) with the
    validator's and the place's problems together, those about keys the user set first. ``check_place=False``
    (``--dry-run --render-only``): the recipe is validated, but not checked against a cluster or this machine
    (partition, nodes, GPUs, the files it opens, the container runtime): what a dry run of a recipe whose cluster
    cannot be reached from here may show."""
    loaded = read_recipe(recipe_path, list(overrides))
    problems = list(loaded.problems)
    # every value is the user's: check it against the place it runs too, even if refused already
    if loaded.typed and check_place:
        refused = {k for k, _, _ in problems}
        problems += [x for x in preflight_problems(loaded.recipe, executor, refused) if x not in problems]
        place = launcher_for(executor)
        why = container.unserved(loaded.recipe, place.container_runtimes, place.steps_here)
        if why and "slurm.container.runtime" not in refused:
            problems.append(("slurm.container.runtime", loaded.recipe.slurm.container.runtime, why))
    if problems:  # the keys the user set first: the command line's, then the file's, then derived ones
        raise RecipeError(loaded.ordered(problems), source=str(recipe_path))
    recipe = loaded.recipe
    p = Plan(recipe, str(recipe_path), list(overrides), executor, python or sys.executable,
             [Path.cwd(), Path(recipe_path).resolve().parent])
    try:  # a broken template is a recipe problem (also for a local run of the recipe): find it now
        check = p if launcher_for(executor).batch_script else dataclasses.replace(p, recipe=unasked(recipe))
        check.script(p.runs_root / f"{recipe.run.name}-YYYYmmdd-HHMMSS")
    except RecipeError as e:
        raise RecipeError(e.problems, source=str(recipe_path)) from None
    return p


def would_be_run_dir(p: Plan) -> Path:
    return p.runs_root / f"{p.recipe.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def step_lines(p: Plan, run_dir: Path) -> list[str]:
    """The role steps' and the run's own engine steps' command lines, from the controller's own builder
    (:mod:`relax_hpc.controller.steps`)."""
    try:
        return describe_steps(p.recipe, run_dir, p.python, launcher_for(p.executor))
    except Exception as e:  # the step builder belongs to the controller; a dry run should still print the script
        return [f"# (step commands unavailable: {type(e).__name__}: {e})"]


def dry_run(p: Plan) -> dict:
    run_dir = would_be_run_dir(p)
    return {"dry_run": True, "executor": p.executor, "run_dir": str(run_dir), "run": run_dir.name,
            "job_id": None, "script": p.script(run_dir) if launcher_for(p.executor).batch_script else None,
            "steps": step_lines(p, run_dir)}


def submit(p: Plan) -> tuple[dict, Any]:
    """Make the run directory, submit, write job.json; returns (job.json contents, submitit job handle)."""
    rd = create_run_dir(p.runs_root, p.recipe.run.name)
    try:
        recipe_copy.save(rd, p.recipe)  # the secrets in RUN/secrets.json, masked in the copy and in job.json
        provenance.record(rd)  # the code that will run: version, commit, local changes
        record: dict[str, Any] = {
            "run": rd.name, "run_dir": str(rd.path), "executor": p.executor,
            "job_name": p.recipe.slurm.job_name or f"relax-{p.recipe.run.name}",
            "recipe_source": str(Path(p.source).resolve()), "overrides": [mask_override(o) for o in p.overrides],
            "submitit_folder": str(rd.path / "submitit"), "python": p.python,
            "host": socket.gethostname(), "user": getpass.getuser(),
        }
        fields, job = launcher_for(p.executor).submit(p, rd)
        record.update(fields)
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
    out = launcher_for(executor or old.get("executor", "slurm")).resume(rd, old, python)
    provenance.record_resume(rd)
    return out
