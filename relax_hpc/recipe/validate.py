"""Turn a merged mapping into a :class:`Recipe`, collecting every problem instead of stopping at the first.

Two passes: ``build`` checks shape and types against the dataclasses (unknown keys with a "did you mean");
``check`` checks meaning (resources that fit together, strings safe for Slurm). Both report
(key, value, message) triples so the user sees the key, the value and the fix in one error.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin

from relax_hpc.algo.config import check as check_algorithm
from relax_hpc.recipe.errors import _MISSING
from relax_hpc.recipe.schema import ROLE_NAMES, Recipe
from relax_hpc.rollout.data import check_config as check_data
from relax_hpc.train.config import check as check_train

Problem = tuple[str, object, str]

# Strings that become Slurm arguments: a conservative set Slurm itself accepts in names and lists.
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.:,+@%/=-]*$")
_SLURM_OPTION = re.compile(r"^--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.:,+@%/=-]*)?$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_SHELL_META = set(";&|<>`$()\\\"'*?[]{}~!#\n\r\t ")


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
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean '{near[0]}'?" if near else f"known keys here: {', '.join(sorted(fields))}"
            problems.append((full, _MISSING, f"unknown key; {hint}"))
            continue
        ok, converted = _convert(hints[key], value, full, problems)
        if ok:
            kwargs[key] = converted
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str, problems: list[Problem]) -> tuple[bool, Any]:
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
        near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
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
            if not isinstance(k, str):
                problems.append((f"{path}.{k}", _MISSING, "keys must be strings"))
                good = False
                continue
            ok, conv = _convert(args[1], item, f"{path}.{k}", problems)
            good &= ok
            out[k] = conv
        return good, out
    return _scalar(tp, value, path, problems)


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
        if isinstance(value, str) and _FLOAT.match(value.strip()):
            return True, float(value)  # PyYAML (YAML 1.1) reads `1e-5` as a string
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


def check(recipe: Recipe) -> list[Problem]:
    """Meaning checks that need several fields at once. Types are already right here."""
    problems: list[Problem] = []
    problems += _check_strings(recipe)
    problems += _check_roles(recipe)
    if recipe.run.steps < 1:
        problems.append(("run.steps", recipe.run.steps, "must be at least 1"))
    if recipe.max_staleness < 0:
        problems.append(("max_staleness", recipe.max_staleness, "must be 0 or more"))
    if recipe.slurm.signal_lead_s < 0:
        problems.append(("slurm.signal_lead_s", recipe.slurm.signal_lead_s, "must be 0 or more seconds"))
    for key, val, low in (("checkpoint.interval", recipe.checkpoint.interval, 0), ("checkpoint.keep", recipe.checkpoint.keep, 1),
                          ("checkpoint.max_restarts", recipe.checkpoint.max_restarts, 0),
                          ("slurm.max_requeues", recipe.slurm.max_requeues, 0)):
        if val < low:
            problems.append((key, val, f"must be at least {low}"))
    if recipe.logging.heartbeat_timeout_s <= recipe.logging.heartbeat_s:
        problems.append(("logging.heartbeat_timeout_s", recipe.logging.heartbeat_timeout_s,
                         f"must be longer than logging.heartbeat_s = {recipe.logging.heartbeat_s}"))
    if recipe.logging.notify_urls:
        from relax_hpc.ops.notify import Notifier

        for i, url in enumerate(recipe.logging.notify_urls):
            if Notifier.check([url]):  # the value shown is the scheme only: URLs carry tokens
                problems.append((f"logging.notify_urls[{i}]", url.split("://", 1)[0] + "://...",
                                 "is not a URL Apprise understands. Fix: see https://github.com/caronc/apprise/wiki"))
    problems += [(f"algorithm.{k}", v, m) for k, v, m in check_algorithm(recipe.algorithm)]
    problems += [(f"train.{k}", v, m) for k, v, m in check_train(recipe.train)]
    problems += check_data(recipe.data, recipe.rollout)  # keys already carry their section
    return problems


def _check_strings(r: Recipe) -> list[Problem]:
    """Every string that becomes a Slurm argument must be a plain word: no value reaches a shell unquoted,
    and refusing metacharacters up front turns a confusing sbatch failure into a named key."""
    out: list[Problem] = []
    s = r.slurm
    words = {"slurm.partition": s.partition, "slurm.account": s.account, "slurm.qos": s.qos,
             "slurm.constraint": s.constraint, "slurm.job_name": s.job_name}
    for key, val in words.items():
        if val is not None and (not val or not _SLURM_WORD.match(val)):
            out.append((key, val, _meta_msg(val, "a Slurm name as `sinfo`/`sacctmgr` prints it")))
    if not _SLURM_TIME.match(s.time):
        out.append(("slurm.time", s.time, "is not Slurm time syntax. Fix: MM, HH:MM:SS or D-HH:MM:SS, e.g. '02:00:00'"))
    for i, opt in enumerate(s.sbatch_extra):
        if not _SLURM_OPTION.match(opt):
            out.append((f"slurm.sbatch_extra[{i}]", opt,
                        _meta_msg(opt, "one sbatch option per item, like '--mail-type=END'")))
    for i, opt in enumerate(s.srun_args):
        if not _SLURM_OPTION.match(opt):
            out.append((f"slurm.srun_args[{i}]", opt,
                        _meta_msg(opt, "one srun option per item, like '--container-image=img.sqsh'")))
    for k, v in s.env.items():
        if not _ENV_NAME.match(k):
            out.append((f"slurm.env.{k}", v, "the variable name must be letters, digits and '_'"))
        elif "\n" in v or "\0" in v:
            out.append((f"slurm.env.{k}", v, "values may not contain newlines"))
    if r.run.name is not None and not _RUN_NAME.match(r.run.name):
        out.append(("run.name", r.run.name,
                    _meta_msg(r.run.name, "letters, digits, '.', '_' and '-', starting with a letter or digit")))
    for key, val in {"run.runs_root": r.run.runs_root, "model.path": r.model.path, "data.path": r.data.path,
                     "slurm.template": s.template}.items():
        if val is not None and any(c in val for c in "\n\r\0"):
            out.append((key, val, "paths may not contain newlines"))
    for name in ROLE_NAMES:
        mem = r.role(name).mem
        if mem is not None and not _MEM.match(mem):
            out.append((f"roles.{name}.mem", mem, "is not Slurm memory syntax. Fix: e.g. '16G' or '4000M'"))
    return out


def _meta_msg(val: str, want: str) -> str:
    bad = sorted({c for c in val if c in _SHELL_META})
    shown = " ".join(repr(c) for c in bad)
    lead = f"contains shell metacharacters ({shown}) and was refused" if bad else "is not allowed here"
    return f"{lead}. Fix: use {want}."


def _check_roles(r: Recipe) -> list[Problem]:
    out: list[Problem] = []
    if not r.roles.actor.enabled:
        out.append(("roles.actor.enabled", False, "the actor is what learns; it cannot be disabled"))
    for name in ROLE_NAMES:
        g = r.role(name)
        key = f"roles.{name}"
        for attr, low in (("nodes", 1), ("tasks_per_node", 1), ("cpus_per_task", 1), ("gpus_per_node", 0)):
            if getattr(g, attr) < low:
                out.append((f"{key}.{attr}", getattr(g, attr), f"must be at least {low}"))
        if g.share_with is not None:
            host = g.share_with
            if host not in ROLE_NAMES or host == name:
                others = [n for n in ROLE_NAMES if n != name]
                out.append((f"{key}.share_with", host, f"must name another role: one of {', '.join(others)}"))
            elif not r.role(host).enabled:
                out.append((f"{key}.share_with", host, f"roles.{host} is disabled; enable it or give {name} its own nodes"))
            elif r.role(host).share_with is not None:
                out.append((f"{key}.share_with", host,
                            f"roles.{host} itself shares roles.{r.role(host).share_with}'s nodes; share with that role"))
            elif g.nodes > r.role(host).nodes:
                out.append((f"{key}.nodes", g.nodes,
                            f"a role sharing roles.{host} can use at most its {r.role(host).nodes} node(s)"))
    a = r.roles.actor
    world = a.nodes * a.tasks_per_node
    mp = r.train.tp * r.train.pp
    if mp > 0 and world % mp:
        out.append(("train.tp", r.train.tp,
                    f"train.tp × train.pp = {mp} does not divide the actor's {world} ranks "
                    f"(roles.actor.nodes × tasks_per_node). Fix: change tp/pp or the actor's size"))
    if a.gpus_per_node and a.tasks_per_node != a.gpus_per_node:
        out.append(("roles.actor.tasks_per_node", a.tasks_per_node,
                    f"on GPU nodes the actor runs one rank per GPU: set it to gpus_per_node = {a.gpus_per_node}"))
    if r.mode == "colocate" and r.max_staleness != 0:
        out.append(("max_staleness", r.max_staleness, "colocate mode is strictly on-policy: use 0, or mode: fully_async"))
    return out
