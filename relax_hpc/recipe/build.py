"""The recipe's first pass: turn a merged mapping into a :class:`~relax_hpc.recipe.schema.Recipe` by the schema's
dataclasses, collecting every problem instead of stopping at the first.

Shape and types only: unknown keys (with a "did you mean", or Relax's flag name and its key here), wrong types,
values YAML or JSON cannot carry. Meaning is the second pass, :func:`relax_hpc.recipe.validate.check`. Problems are
(key, value, message) triples, so the user sees the key, the value and the fix in one error.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin

from relax_hpc.recipe.errors import _MISSING
from relax_hpc.recipe.reader import encodable
from relax_hpc.recipe.relax_names import RELAX_NAMES, WHY, cli_flag, relax_flag
from relax_hpc.recipe.schema import Recipe

Problem = tuple[str, object, str]

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def build(cls: type, data: Any, path: str, problems: list[Problem]) -> Any:
    """Build dataclass ``cls`` from ``data``; append problems; return an instance (defaults where bad)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append((path or "<recipe>", data, f"must be a mapping of keys to values, not {_kind(data)}"))
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{_show_key(key)}" if path else _show_key(key)
        if key not in fields:
            shown = _MISSING if isinstance(value, dict) or "://" in str(value) else value  # URLs carry tokens
            problems.append((full, shown, f"unknown key; {unknown_key_hint(_show_key(key), list(fields), value)}"))
            continue
        ok, converted = _convert(hints[key], value, full, problems)
        if ok:
            kwargs[key] = converted
    return cls(**kwargs)


def unknown_key_hint(key: str, here: list[str], value: Any = _MISSING) -> str:
    """Where an unknown key belongs. Relax's flag names first (``num_rollout`` is ``run.steps``; a spelling
    match would say ``runs_root``), then the same name in another section, then the closest spelling here."""
    name = relax_flag(key)
    if name in RELAX_NAMES:
        target = RELAX_NAMES[name]
        if target is None:
            why = f" ({WHY[name]})" if name in WHY else ""  # the reason --from-relax-args prints too
            return f"Relax's {cli_flag(name)} has no equivalent in relax_hpc yet{why}. Fix: remove it"
        if target.split(":")[0] in schema_keys():
            return f"Relax's {cli_flag(name)} is `{target}` here. Fix: {_move_fix(target, value)}"
    elsewhere = [k for k in sorted(schema_keys()) if k.rsplit(".", 1)[-1] == name]
    elsewhere.sort(key=lambda k: k.startswith("forward."))  # forward.* repeats train.* for the forward roles: train first
    if elsewhere:
        fix = _move_fix(elsewhere[0], value)
        return f"`{name}` is a key of another section: {', '.join(elsewhere[:4])}. Fix: {fix}"
    near = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    return f"did you mean '{near[0]}'?" if near else f"known keys here: {', '.join(sorted(here))}"


def _move_fix(target: str, value: Any) -> str:
    if ":" in target:
        return f"set {target} instead"
    if value is _MISSING or isinstance(value, dict) or not _printable_value(value):
        return f"move it to {target}"
    return f"set {target}: {json.dumps(value) if not isinstance(value, str) else value} instead"


def _printable_value(value: Any) -> bool:
    """Whether ``value`` is short JSON that can be written into a fix (not a date, a huge number, a long list)."""
    try:
        return len(json.dumps(value)) <= 200
    except (TypeError, ValueError):
        return False


@functools.cache
def schema_keys() -> frozenset[str]:
    """Every dotted key a recipe may hold (sections too): ``run``, ``run.steps``, ``roles.actor.nodes``, ...,
    and the keys of optional sections (``roles.rollout.elastic.initial``)."""
    out: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        for name, tp in typing.get_type_hints(cls).items():
            key = f"{prefix}{name}"
            out.add(key)
            optional = get_origin(tp) in (typing.Union, types.UnionType)
            inner = [a for a in get_args(tp) if a is not type(None)] if optional else [tp]
            if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
                walk(inner[0], key + ".")

    walk(Recipe, "")
    return frozenset(out)


def _convert(tp: Any, value: Any, path: str, problems: list[Problem]) -> tuple[bool, Any]:
    if _refused_scalar(value, path, problems):
        return False, None
    if dataclasses.is_dataclass(tp):
        return True, build(tp, value, path, problems)
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, problems)
    if origin is Literal:
        if value in args:
            return True, value
        choices = ", ".join(repr(a) for a in args)
        near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1) if isinstance(value, str) else []
        hint = f" Did you mean {near[0]!r}?" if near else ""
        problems.append((path, value, f"must be one of {choices}.{hint}"))
        return False, None
    if origin is list:
        if not isinstance(value, list):
            problems.append((path, value, f"must be a list, not {_kind(value)}"))
            return False, None
        out, good = [], True
        for i, item in enumerate(value):
            ok, conv = _convert(args[0], item, f"{path}[{i}]", problems)
            good &= ok
            out.append(conv)
        return good, out
    if origin is dict:
        if not isinstance(value, dict):
            problems.append((path, value, f"must be a mapping, not {_kind(value)}"))
            return False, None
        out, good = {}, True
        for k, item in value.items():
            if not isinstance(k, str) or not encodable(k):
                problems.append((f"{path}[{_show_key(k)}]", _MISSING, "keys must be strings of UTF-8 text"))
                good = False
                continue
            ok, conv = _convert(args[1], item, f"{path}.{k}", problems)
            good &= ok
            out[k] = conv
        return good, out
    if tp is Any:  # passed on as JSON (chat template arguments): JSON's values, any shape
        return _json_like(value, path, problems), value
    return _scalar(tp, value, path, problems)


# Integers beyond 64 bits mean nothing to Slurm, torch or a step counter, and beyond 4300 digits Python
# cannot even print them (ValueError in an f-string): refused where they are read.
_INT_LIMIT = 2**63


def _refused_scalar(value: Any, path: str, problems: list[Problem]) -> bool:
    """The values no key accepts, whatever its type: inf and nan, integers beyond 64 bits, text that cannot be
    encoded as UTF-8 (a lone surrogate: a ``\\ud800`` escape, or a byte of the command line that is not UTF-8)."""
    if isinstance(value, float) and not math.isfinite(value):
        problems.append((path, value, "must be a finite number: no recipe key takes inf or nan. Fix: a number, "
                                      "e.g. 1.0, or remove the key for its default"))
    elif isinstance(value, int) and not isinstance(value, bool) and not -_INT_LIMIT < value < _INT_LIMIT:
        problems.append((path, value, "is too large: at most 2**63 - 1 in either direction. Fix: a smaller number"))
    elif isinstance(value, str) and not encodable(value):
        problems.append((path, value, "contains a character that cannot be encoded as UTF-8 (a lone surrogate: a "
                                      "\\ud800-style escape, or a byte that is not UTF-8 on the command line). "
                                      "Fix: UTF-8 text only"))
    else:
        return False
    return True


def _json_like(value: Any, path: str, problems: list[Problem]) -> bool:
    """Whether ``value`` is made of JSON's values (its strings UTF-8, its numbers finite); problems named by path."""
    if isinstance(value, dict):
        good = True
        for k, item in value.items():
            if not isinstance(k, str) or not encodable(k):
                problems.append((f"{path}[{_show_key(k)}]", _MISSING, "keys must be strings of UTF-8 text"))
                good = False
            elif not _json_like(item, f"{path}.{k}", problems):
                good = False
        return good
    if isinstance(value, list):
        return all([_json_like(item, f"{path}[{i}]", problems) for i, item in enumerate(value)])
    if _refused_scalar(value, path, problems):
        return False
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    problems.append((path, value, f"must be a JSON value (text, number, true/false, null, list or mapping), not "
                                  f"{_kind(value)}. Fix: quote it to make it text"))
    return False


def _show_key(key: Any) -> str:
    """A key as it can be printed: repr for a non-string, escapes for text that is not UTF-8."""
    if not isinstance(key, str):
        return repr(key)
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _scalar(tp: Any, value: Any, path: str, problems: list[Problem]) -> tuple[bool, Any]:
    if tp is bool:
        if isinstance(value, bool):
            return True, value
        problems.append((path, value, "must be true or false"))
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        problems.append((path, value, f"must be an integer, not {_kind(value)}"))
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            number = float(value)  # PyYAML (YAML 1.1) reads `1e-5` as a string
            if not math.isfinite(number):  # 1e999
                problems.append((path, value, "is too large: it overflows to inf. Fix: a smaller number"))
                return False, None
            return True, number
        problems.append((path, value, f"must be a number, not {_kind(value)}"))
    elif tp is str:
        if isinstance(value, str):
            return True, value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, str(value)  # YAML reads `time: 10` or `partition: 01` as numbers
        problems.append((path, value, f"must be a string, not {_kind(value)}"))
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"recipe schema field {path} has unsupported type {tp!r}")
    return False, None


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "empty"}.get(
        type(value), type(value).__name__
    )
