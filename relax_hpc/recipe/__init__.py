"""Recipes: one YAML file describes a run; this package loads, merges, overrides and validates it.

Nothing here knows Slurm or Megatron: it turns text into a checked :class:`Recipe` or a
:class:`RecipeError` that names every bad key, its value and the fix, before anything is submitted.
"""

from relax_hpc.recipe.errors import RecipeError
from relax_hpc.recipe.layout import RoleStep, initial_engines, role_steps
from relax_hpc.recipe.load import dump_recipe, load_recipe, recipe_from_dict, recipe_to_dict
from relax_hpc.recipe.schema import ROLE_NAMES, Recipe, RoleGroup

__all__ = [
    "ROLE_NAMES", "Recipe", "RecipeError", "RoleGroup", "RoleStep", "dump_recipe", "load_recipe",
    "recipe_from_dict", "recipe_to_dict", "role_steps", "initial_engines",
]
