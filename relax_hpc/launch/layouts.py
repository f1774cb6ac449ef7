"""``slurm.layout``: does the site take heterogeneous jobs, and which layout a run's script is rendered in.

A leaf of :mod:`relax_hpc.launch` (Slurm's clients only): the renderer, relax-submit's preflight and relax-doctor
all ask here, so they give the same answer. ``sbatch --test-only`` answers without scheduling anything; the answer
is kept for the process (relax-submit renders a script twice).
"""

from __future__ import annotations

import copy
import functools
import subprocess
from dataclasses import dataclass
from typing import Any

from relax_hpc.launch import slurm
from relax_hpc.recipe.layout import one_component

HET_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class HetVerdict:
    """What ``sbatch --test-only`` said of a two-component het job on a partition: ``allowed`` True or False, or None
    when it could not tell (no sbatch, or even a plain job refused: a partition or account problem, which the other
    checks name); ``detail`` says which, with sbatch's own words."""

    allowed: bool | None
    detail: str


def _test_only(argv: list[str]) -> tuple[bool, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=HET_PROBE_TIMEOUT_S)
    except FileNotFoundError:
        return False, "sbatch not found on PATH"
    except subprocess.TimeoutExpired:
        return False, f"no answer in {HET_PROBE_TIMEOUT_S:.0f} s (is slurmctld up?)"
    text = " ".join((p.stderr or p.stdout).split())
    return p.returncode == 0, text[:300]


@functools.lru_cache(maxsize=16)  # one question per site and process: relax-submit renders the script twice
def het_jobs_allowed(partition: str | None, account: str | None = None, qos: str | None = None) -> HetVerdict:
    """Ask Slurm whether it would take a heterogeneous job (two one-node components, one minute) on ``partition``
    (None: the default one), as ``account``/``qos``: ``sbatch --test-only``, which schedules nothing. A site that
    disables het jobs (a job_submit plugin, limits on components) refuses it; if it refuses a plain one-node job
    too, the answer is None (the partition or account is the problem, not het jobs)."""
    if not slurm.have_sbatch():
        return HetVerdict(None, "sbatch not found on PATH: Slurm not asked")
    opts = [*([f"--partition={partition}"] if partition else []), *([f"--account={account}"] if account else []),
            *([f"--qos={qos}"] if qos else []), "--nodes=1", "--ntasks=1", "--time=1"]
    where = f"partition {partition}" if partition else "the default partition"
    ok, said = _test_only(["sbatch", "--test-only", "--job-name=relax-het-probe", *opts, ":", *opts, "--wrap", "true"])
    if ok:
        return HetVerdict(True, f"{where} takes heterogeneous jobs (sbatch --test-only of a 2-component job: accepted)")
    if said.startswith("no answer"):  # slurmctld down or slow: do not wait for it twice
        return HetVerdict(None, f"sbatch --test-only: {said}")
    plain_ok, plain_said = _test_only(["sbatch", "--test-only", "--job-name=relax-het-probe", *opts, "--wrap", "true"])
    if not plain_ok:
        return HetVerdict(None, f"sbatch --test-only refuses even a plain job on {where}: {plain_said}")
    return HetVerdict(False, f"{where} refuses heterogeneous jobs (sbatch --test-only: {said}); "
                             "a plain job is accepted")


def choose_layout(recipe: Any, ask: bool = True) -> tuple[str, str]:
    """``slurm.layout`` settled: (``hetjob`` or ``single``, why). ``auto`` asks :func:`het_jobs_allowed` (once per
    process): single where the site refuses het jobs, else hetjob (also when Slurm cannot be asked: the script then
    says so). ``ask=False``: Slurm is not asked, ``auto`` is hetjob (a run with no Slurm job: :func:`unasked`)."""
    s = recipe.slurm
    if one_component(recipe):
        # one component is a plain job: steps naming --het-group=0 in it would find no het component to run on
        return "single", f"slurm.layout: {s.layout} -> single: every role runs in one component (a plain job)"
    if s.layout != "auto":
        return s.layout, f"slurm.layout: {s.layout} (set in the recipe)"
    if not ask:
        return "hetjob", "slurm.layout: auto -> hetjob: a run with no Slurm job (Slurm not asked)"
    v = het_jobs_allowed(s.partition, s.account, s.qos)
    if v.allowed is False:
        return "single", f"slurm.layout: auto -> single: {v.detail}"
    return "hetjob", f"slurm.layout: auto -> hetjob: {v.detail}"


def unasked(recipe: Any) -> Any:
    """A shallow copy of ``recipe`` with its layout chosen without asking Slurm, for a run that has no Slurm job
    (``relax-submit --local``), whose script is rendered only to check the template: ``auto`` is rendered as the
    het job it becomes where Slurm cannot be asked. Asking would make a local run wait up to
    :data:`HET_PROBE_TIMEOUT_S` wherever ``sbatch`` is installed and no slurmctld answers (a laptop, a container
    built with Slurm's clients). The recipe itself keeps its ``slurm.layout``."""
    r = copy.copy(recipe)
    r.slurm = copy.copy(recipe.slurm)
    r.slurm.layout, r.slurm.__dict__["layout_why"] = choose_layout(recipe, ask=False)
    return r


def settle_layout(recipe: Any) -> tuple[str, str]:
    """:func:`choose_layout`, written into ``recipe`` (relax-submit's preflight): an ``auto`` layout becomes the one
    picked, so that the script, the dry run's step lines, the run's recipe copy (``RUN/recipe.yaml``) and a
    continuation job all agree; the reason rides along (``layout_why``, no recipe key) for the script's comment."""
    layout, why = choose_layout(recipe)
    recipe.slurm.layout = layout
    recipe.slurm.__dict__["layout_why"] = why
    return layout, why


def layout_of(recipe: Any) -> tuple[str, str]:
    """The layout a script is rendered in, and why: as settled by :func:`settle_layout`, as set in the recipe, or
    ``auto`` chosen now."""
    why = recipe.slurm.__dict__.get("layout_why")
    return (recipe.slurm.layout, why) if why else choose_layout(recipe)
