"""Checks of a valid recipe against the place it will run, before anything is submitted.

The recipe validator knows types and internal consistency; only here do we know the cluster (from
``sinfo``), this machine (CUDA) and the files the run will open (:mod:`relax_hpc.launch.files`). A request Slurm
can never satisfy would otherwise sit PENDING forever or be refused by sbatch with "Requested node
configuration is not available", naming no key. Problems are (key, value, message-with-fix) triples,
raised as one :class:`RecipeError`, like the validator's. The checks of a place are its backend's
(:meth:`~relax_hpc.backends.Backend.place_problems`, over :mod:`relax_hpc.launch.places`).
"""

from __future__ import annotations

import copy
import dataclasses

from relax_hpc.launch.tools import launcher_for
from relax_hpc.launch.doctor import submit_problems
from relax_hpc.launch.layouts import het_jobs_allowed, settle_layout
from relax_hpc.launch.places import Problem, check_local, check_slurm, cuda_device_count, mem_mb
from relax_hpc.ops.wandb_log import credential_problems
from relax_hpc.recipe import Recipe, RecipeError
from relax_hpc.recipe.layout import one_component
from relax_hpc.launch.files import check_files

__all__ = ["Problem", "check_local", "check_slurm", "cuda_device_count", "layout_problems", "mem_mb", "preflight",
           "preflight_problems"]


def preflight(recipe: Recipe, executor: str, source: str | None = None) -> None:
    """Raise :class:`RecipeError` if ``recipe`` cannot run on ``executor`` ('slurm' asks sinfo); all problems
    of :func:`preflight_problems` in one error."""
    problems = preflight_problems(recipe, executor)
    if problems:
        raise RecipeError(problems, source=source)


def preflight_problems(recipe: Recipe, executor: str,
                       refused: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """What keeps ``recipe`` from running on ``executor``: first the files the run will open (``data.path``, the
    model, relative to this working directory, which becomes the roles'), then the cluster or this machine, then
    relax-doctor's checks that cost milliseconds (:func:`~relax_hpc.launch.doctor.submit_problems`: the SGLang
    interpreter).

    Runs on a recipe whose meaning checks failed too (``relax-submit`` reports both at once, so that
    ``roles.actor.nodes=999`` is named by the cluster's node count, not only by what it implies for the batch):
    ``refused`` are the keys the validator refused: the checks here see their defaults where they are strings
    (a path too long to open, a partition with a ';'), and the layout checks are skipped when a ``share_with``
    is refused (one naming no role gives no layout to check)."""
    recipe = _unset_refused_strings(recipe, refused)
    problems = check_files(recipe)
    layout = not any(k.endswith(".share_with") for k in refused)
    problems += launcher_for(executor).place_problems(recipe, layout)
    if launcher_for(executor).batch_script and not any(k.startswith("<cluster>") for k, _, _ in problems):
        problems += layout_problems(recipe)
    problems += submit_problems(recipe, executor)  # relax-doctor's cheap ones: the SGLang interpreter
    if recipe.logging.wandb is not None:  # the job sees this environment (sbatch exports it)
        problems += credential_problems(recipe.logging.wandb)
    return problems


def layout_problems(recipe: Recipe) -> list[Problem]:
    """``slurm.layout: hetjob`` on a partition that refuses heterogeneous jobs (``sbatch --test-only``, asked once
    per process: :func:`~relax_hpc.launch.doctor.het_jobs_allowed`). ``auto`` never is a problem: it is settled
    here, in ``recipe`` itself (:func:`~relax_hpc.launch.doctor.settle_layout`: single where het jobs are refused),
    so that the script, the dry run's step lines and the run's recipe copy agree."""
    s = recipe.slurm
    if s.layout == "auto" or one_component(recipe):
        settle_layout(recipe)
    if s.layout != "hetjob" or s.__dict__.get("layout_why"):  # single, or hetjob picked by auto (allowed)
        return []
    v = het_jobs_allowed(s.partition, s.account, s.qos)
    if v.allowed is False:
        return [("slurm.layout", s.layout, f"{v.detail}. Fix: slurm.layout: single (one allocation of all the "
                 "roles' nodes), or auto (picks single here)")]
    return []


def _unset_refused_strings(recipe: Recipe, refused: set[str] | frozenset[str]) -> Recipe:
    """A copy of ``recipe`` with each refused string value put back to its default (a refused entry of a
    mapping removed): the paths, names and specs the validator refused are not opened or looked up again."""
    out = None
    for key in refused:
        parts = key.split(".")
        node: object = recipe
        for part in parts[:-1]:
            node = getattr(node, part, None)
        leaf = parts[-1]
        if isinstance(node, dict) and isinstance(node.get(leaf), str) or \
                dataclasses.is_dataclass(node) and isinstance(getattr(node, leaf, None), str):
            if out is None:
                out = copy.deepcopy(recipe)
            _reset(out, parts)
    return recipe if out is None else out


def _reset(recipe: Recipe, parts: list[str]) -> None:
    node: object = recipe
    for part in parts[:-1]:
        node = getattr(node, part)
    if isinstance(node, dict):
        del node[parts[-1]]
        return
    f = next(f for f in dataclasses.fields(node) if f.name == parts[-1])
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    setattr(node, parts[-1], default)
