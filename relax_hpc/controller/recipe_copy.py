"""The run directory's copy of the recipe (``RUN/recipe.yaml``), its secrets kept apart (:mod:`relax_hpc.rundir`, "the recipe's secrets").

relax-submit writes it (:func:`save`): the resolved recipe with each secret masked, and the secrets in
``RUN/secrets.json`` (0600). Whoever needs the values loads it with :func:`load` (the controller, each of its
attempts, a requeue, a resume, a continuation job); everyone else (the roles, relax-status) reads the masked copy
with :func:`relax_hpc.recipe.load_recipe` as before.
"""

from __future__ import annotations

import yaml

from relax_hpc.recipe import Recipe, load_recipe, recipe_to_dict
from relax_hpc.rundir import (SECRET_ENV, RunDir, read_secrets, secret_overrides, split_secrets, write_private,
                              write_secrets)


def save(run: RunDir, recipe: Recipe) -> None:
    """The secrets file, then the masked copy (the order a reader of the copy may rely on)."""
    masked, found = split_secrets(recipe_to_dict(recipe))
    write_secrets(run, found)
    write_private(run.recipe, yaml.safe_dump(masked, sort_keys=False, default_flow_style=False))


def load(run: RunDir) -> Recipe:
    """The run's recipe with its secrets (RecipeError, or RunFileError for a secrets file that cannot be read)."""
    return load_recipe(run.recipe, secret_overrides(read_secrets(run)))


def job_env(run: RunDir) -> dict[str, str]:
    """``slurm.env`` with its values, for the process that runs the controller (the launcher's task sets them before
    the controller starts, as the batch script once exported them: W&B's key, a continuation job's sbatch, and every
    step through the controller's environment)."""
    prefix = SECRET_ENV + "."
    return {k[len(prefix):]: str(v) for k, v in read_secrets(run).items() if k.startswith(prefix)}
