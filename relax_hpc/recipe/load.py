"""Load a recipe: YAML, then its ``defaults:`` (files it extends, later wins), then command-line overrides.

A ``defaults:`` entry is a path relative to the recipe file, or a name under ``configs/`` without the
``.yaml`` (``algorithm/grpo``). Overrides are ``key.sub=value`` with the value read as YAML, so
``train.lr=1e-5`` is a number and ``slurm.sbatch_extra=[--exclusive]`` a list.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from relax_hpc.recipe.errors import _MISSING, RecipeError
from relax_hpc.recipe.schema import Recipe
from relax_hpc.recipe.validate import build, check

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The checked recipe at ``path`` with ``overrides`` applied; raises :class:`RecipeError`."""
    path = Path(path)
    merged = _load_with_defaults(path, chain=())
    problems: list = []
    for item in overrides:
        _apply_override(merged, item, problems)
    if problems:
        raise RecipeError(problems, source=str(path))
    merged.setdefault("run", {})
    if isinstance(merged["run"], dict) and not merged["run"].get("name"):
        merged["run"]["name"] = path.stem
    return recipe_from_dict(merged, source=str(path))


def recipe_from_dict(data: dict, source: str | None = None) -> Recipe:
    problems: list = []
    recipe = build(Recipe, data, "", problems)
    if not problems:
        problems = check(recipe)
    if problems:
        raise RecipeError(problems, source=source)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML: every key, defaults included, so a run directory says exactly what ran."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False)


def _read_yaml(path: Path, chain: tuple[Path, ...]) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        via = f" (listed in defaults: of {chain[-1]})" if chain else ""
        raise RecipeError([("<file>", str(path), f"no such file{via}. Fix: check the path")], source=str(path))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        raise RecipeError([("<yaml>", _MISSING, f"not valid YAML at {where}: {getattr(e, 'problem', e)}")],
                          source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([("<recipe>", data, "the top level must be a mapping of sections")], source=str(path))
    return data


def _resolve_default(name: str, base: Path) -> Path:
    candidate = (base.parent / name)
    if candidate.suffix in (".yaml", ".yml") and candidate.exists():
        return candidate
    if candidate.with_suffix(".yaml").exists():
        return candidate.with_suffix(".yaml")
    named = CONFIGS_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    return named if named.exists() else candidate


def _load_with_defaults(path: Path, chain: tuple[Path, ...]) -> dict:
    path = path.resolve() if path.exists() else path
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise RecipeError([("defaults", str(path), f"defaults form a cycle: {cycle}")], source=str(chain[0]))
    data = _read_yaml(path, chain)
    defaults = data.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise RecipeError([("defaults", defaults, "must be a list of file names")], source=str(path))
    merged: dict = {}
    for name in defaults:
        merged = _merge(merged, _load_with_defaults(_resolve_default(name, path), chain + (path,)))
    return _merge(merged, data)


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else (lists included) is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _apply_override(data: dict, item: str, problems: list) -> None:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        problems.append(("<override>", item, "overrides look like key.sub=value, e.g. run.steps=20"))
        return
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: take the text as it is
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            problems.append((".".join(parts[: i + 1]), nxt, f"is not a section, so {key} cannot be set"))
            return
        node = nxt
    node[parts[-1]] = value
