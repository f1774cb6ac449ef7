"""Load a recipe: YAML, then its ``defaults:`` (files it extends, later wins), then command-line overrides.

A ``defaults:`` entry is a path relative to the recipe file, or a name under ``relax_hpc/configs/`` (package
data: the wheel carries it) without the ``.yaml`` (``algorithm/grpo``). Overrides are ``key.sub=value`` with the
value read as YAML, so ``train.lr=1e-5`` is a number and ``slurm.sbatch_extra=[--exclusive]`` a list. Files and
override values are read within the bounds of :mod:`relax_hpc.recipe.reader` (size, depth, aliases expanded, UTF-8).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import yaml

from relax_hpc.recipe.errors import _MISSING, RecipeError
from relax_hpc.recipe.reader import (MAX_BYTES, MAX_DEPTH, LimitError, TextError, encodable, height, parse_yaml,
                                    read_text, yaml_error_message)
from relax_hpc.recipe.schema import Recipe
from relax_hpc.recipe.validate import Problem, build, check

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"  # relax_hpc/configs: found through the package


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The checked recipe at ``path`` with ``overrides`` applied; raises :class:`RecipeError`."""
    loaded = read_recipe(path, overrides)
    if loaded.problems:
        raise RecipeError(loaded.problems, source=str(path))
    return loaded.recipe


@dataclasses.dataclass
class Loaded:
    """A recipe read and checked, problems kept: what ``relax-submit`` needs to check it against the place it
    runs before it reports (:func:`relax_hpc.launch.submit.plan`). ``recipe`` has defaults where a value was
    refused; ``typed`` says the type pass found nothing, so every value in ``recipe`` is the user's."""

    recipe: Recipe
    problems: list[Problem]
    typed: bool
    override_keys: list[str]  # the keys set on the command line, in order
    file_keys: set[str]  # every key the recipe files set (defaults: files included)

    def ordered(self, problems: list[Problem]) -> list[Problem]:
        """``problems`` with those about keys the user set first: command-line overrides, then the files'
        keys, then derived ones (a default that no longer fits). A refusal leads with what the user can fix
        where they wrote it."""
        return sorted(problems, key=lambda p: _rank(p[0], self.override_keys, self.file_keys))


def read_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Loaded:
    """Read ``path`` with its defaults and ``overrides``, build and check it, and return the problems instead of
    raising them. Raises :class:`RecipeError` only for text that gives no recipe at all (a missing or unreadable
    file, bad YAML, text over the bounds of :mod:`relax_hpc.recipe.reader`)."""
    path = Path(path)
    merged = _load_with_defaults(path, chain=(), budget=[MAX_FILES], source=str(path))
    file_keys = _dotted_keys(merged)
    problems: list[Problem] = []
    override_keys = []
    for item in overrides:
        key = _apply_override(merged, item, problems)
        if key:
            override_keys.append(key)
    merged.setdefault("run", {})
    if isinstance(merged["run"], dict) and not merged["run"].get("name"):
        merged["run"]["name"] = path.stem
    recipe = build(Recipe, merged, "", problems)
    typed = not problems
    if typed:
        problems = check(recipe)
    loaded = Loaded(recipe, [], typed, override_keys, file_keys)
    loaded.problems = loaded.ordered(problems)
    return loaded


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


def _read_yaml(path: Path, chain: tuple[Path, ...], source: str) -> dict:
    """One recipe file's mapping. Every way it can fail is a RecipeError naming the file (and line); ``source``
    is the recipe the user named (the error's header), ``path`` may be a file of its ``defaults:``."""
    via = f" (listed in defaults: of {chain[-1]})" if chain else ""
    try:
        data = parse_yaml(read_text(path))
    except FileNotFoundError:
        raise RecipeError([("<file>", str(path), f"no such file{via}. Fix: check the path")], source=source)
    except TextError as e:
        raise RecipeError([("<file>", str(path), f"{e}{via}")], source=source) from None
    except yaml.YAMLError as e:
        raise RecipeError([("<yaml>", str(path) if chain else _MISSING, f"{yaml_error_message(e)}{via}")],
                          source=source) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([("<recipe>", data if not chain else str(path),
                            f"the top level must be a mapping of sections, not {type(data).__name__}{via}")],
                          source=source)
    return data


def _resolve_default(name: str, base: Path) -> Path:
    candidate = (base.parent / name)
    if candidate.suffix in (".yaml", ".yml") and candidate.exists():
        return candidate
    if candidate.with_suffix(".yaml").exists():
        return candidate.with_suffix(".yaml")
    named = CONFIGS_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    return named if named.exists() else candidate


MAX_FILES = 64
"""Files one recipe may read through ``defaults:`` (each file counts each time it is listed)."""


def _load_with_defaults(path: Path, chain: tuple[Path, ...], budget: list[int], source: str) -> dict:
    path = _resolved(path)
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise RecipeError([("defaults", str(path), f"defaults form a cycle: {cycle}")], source=source)
    budget[0] -= 1
    if budget[0] < 0:
        raise RecipeError([("defaults", str(path), f"the defaults: chain reads more than {MAX_FILES} files. "
                            "Fix: list each file once")], source=source)
    data = _read_yaml(path, chain, source)
    defaults = data.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise RecipeError([("defaults", defaults, f"must be a list of file names (in {path})")], source=source)
    for name in defaults:
        if not name or "\0" in name or not encodable(name) or len(name) > 4096:
            raise RecipeError([("defaults", name, f"is not a file name (in {path}). Fix: a path relative to that "
                                "file, or a name under relax_hpc/configs/ without .yaml (algorithm/grpo)")],
                              source=source)
    merged: dict = {}
    for name in defaults:
        merged = _merge(merged, _load_with_defaults(_resolve_default(name, path), chain + (path,), budget, source))
    return _merge(merged, data)


def _resolved(path: Path) -> Path:
    try:
        return path.resolve() if path.exists() else path
    except (OSError, ValueError):  # a name too long, a NUL byte, a character the file system cannot encode
        return path


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge key by key, anything else (lists included) is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _apply_override(data: dict, item: str, problems: list) -> str | None:
    """Set ``key.sub=value`` in ``data``, the value read as YAML within the bounds a file has; the key, or None
    (a problem is appended) when it cannot be set."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not part for part in parts):
        problems.append(("<override>", item, "overrides look like key.sub=value, e.g. run.steps=20"))
        return None
    if len(item) > MAX_BYTES or len(parts) > MAX_DEPTH:
        problems.append(("<override>", f"{item[:60]}...", f"is longer than {MAX_BYTES} characters or "
                         f"{MAX_DEPTH} keys deep. Fix: set the key in the recipe file"))
        return None
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        if isinstance(e, LimitError):
            problems.append((key, _MISSING, f"its value on the command line is refused {yaml_error_message(e)}"))
            return None
        value = raw  # not YAML: take the text as it is
    except TextError:
        value = raw
    if len(parts) - 1 + height(value) > MAX_DEPTH:
        problems.append((key, _MISSING, f"the key and its value nest more than {MAX_DEPTH} levels deep. "
                         "Fix: a recipe needs a few levels"))
        return None
    node = data
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            problems.append((".".join(parts[: i + 1]), nxt, f"is not a section, so {key} cannot be set"))
            return None
        node = nxt
    node[parts[-1]] = value
    return key


def _dotted_keys(data: dict, prefix: str = "") -> set[str]:
    """Every key in ``data`` as a dotted path (``roles``, ``roles.actor``, ``roles.actor.nodes``)."""
    out: set[str] = set()
    for k, v in data.items():
        key = f"{prefix}{k}"
        out.add(key)
        if isinstance(v, dict):
            out |= _dotted_keys(v, key + ".")
    return out


def _rank(key: str, overrides: list[str], file_keys: set[str]) -> int:
    """0: a key set on the command line (or one inside it, or the section holding it); 1: a key of the files;
    2: a key nobody set (a default or a derived value) or not a key at all (``<cluster>``)."""
    if key == "<override>":
        return 0
    bare = re.sub(r"\[[^\]]*\]", "", key)  # slurm.sbatch_extra[0] -> slurm.sbatch_extra

    def related(k: str) -> bool:
        return bare == k or bare.startswith(k + ".") or k.startswith(bare + ".")

    if any(related(k) for k in overrides):
        return 0
    return 1 if bare in file_keys else 2
