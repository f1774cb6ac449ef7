"""Turn a merged mapping into a :class:`Recipe`, collecting every problem instead of stopping at the first.

Two passes: ``build`` checks shape and types against the dataclasses (unknown keys with a "did you mean");
``check`` checks meaning (resources that fit together, strings safe for Slurm). Both report
(key, value, message) triples so the user sees the key, the value and the fix in one error.
``check_files`` (run by relax-submit, not by the roles) reads what the run will open: data, the model's
config, and the user functions the recipe names (loaded with :func:`relax_hpc.plugins.load_plugin`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import re
import stat
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from relax_hpc.algo.config import PLUGIN_CALLS, check as check_algorithm, check_opd
from relax_hpc.multimodal import VLM_MODEL_TYPES
from relax_hpc.plugins import PluginError, load_plugin
from relax_hpc.recipe.errors import _MISSING
from relax_hpc.recipe.memory_plan import check as check_memory, recipe_problems as check_memory_keys
from relax_hpc.recipe.reader import TextError, encodable, parse_yaml, read_text, yaml_error_message
from relax_hpc.recipe.relax_names import RELAX_NAMES, cli_flag, relax_flag
from relax_hpc.recipe.schema import ROLE_NAMES, Recipe
from relax_hpc.rollout.data import DataError, check_config as check_data, check_data_files, expand_paths
from relax_hpc.rollout.rewards import AWAITED_REWARDS, BUILTIN_REWARDS, GENERATE_PARAMS, REWARD_PARAMS, relax_args
from relax_hpc.rollout.multiturn import env_factory
from relax_hpc.train.config import check as check_train, steps_per_rollout
from relax_hpc.train.forward_config import check as check_forward

Problem = tuple[str, object, str]

log = logging.getLogger(__name__)

# Strings that become Slurm arguments: a conservative set Slurm itself accepts in names and lists.
# Always used with ``fullmatch``: ``$`` also matches before a trailing newline, so "debug\n" passed a ``^...$``
# check and was refused only later by the sbatch renderer, naming no key.
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.:,+@%/=-]*")
_SLURM_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.:,+@%/=-]*)?")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|\d+-\d+")
_MEM = re.compile(r"\d+[KMGT]?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HTTP_URL = re.compile(r"https?://[^\s/?#]+[^\s]*")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
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
            return f"Relax's {cli_flag(name)} has no equivalent in relax_hpc yet. Fix: remove it"
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


def check(recipe: Recipe) -> list[Problem]:
    """Meaning checks that need several fields at once. Types are already right here."""
    problems: list[Problem] = []
    problems += _check_strings(recipe)
    problems += _check_path_lengths(recipe)
    problems += _check_roles(recipe)
    if recipe.run.steps < 1:
        problems.append(("run.steps", recipe.run.steps, "must be at least 1"))
    if recipe.max_staleness < 0:
        problems.append(("max_staleness", recipe.max_staleness, "must be 0 or more"))
    if recipe.slurm.signal_lead_s < 0:
        problems.append(("slurm.signal_lead_s", recipe.slurm.signal_lead_s, "must be 0 or more seconds"))
    for key, val, low in (("checkpoint.interval", recipe.checkpoint.interval, 0), ("checkpoint.keep", recipe.checkpoint.keep, 1),
                          ("checkpoint.max_restarts", recipe.checkpoint.max_restarts, 0),
                          ("slurm.max_requeues", recipe.slurm.max_requeues, 0),
                          ("health.max_role_restarts", recipe.health.max_role_restarts, 0)):
        if val < low:
            problems.append((key, val, f"must be at least {low}"))
    if recipe.health.window_s < 0:
        problems.append(("health.window_s", recipe.health.window_s, "must be 0 or more seconds (0: a role restarted "
                                                                    "alone may fail again at once and still restart alone)"))
    if recipe.logging.task_timeout_s < 0:
        problems.append(("logging.task_timeout_s", recipe.logging.task_timeout_s,
                         "must be 0 or more seconds (0 turns the hung-task check off)"))
    for key in ("reward_timeout_s", "request_timeout_s"):  # every wait on user code or an engine is bounded
        val = getattr(recipe.rollout, key, None)
        if val is not None and val <= 0:
            problems.append((f"rollout.{key}", val, "must be more than 0 seconds"))
    if recipe.logging.heartbeat_timeout_s <= recipe.logging.heartbeat_s:
        problems.append(("logging.heartbeat_timeout_s", recipe.logging.heartbeat_timeout_s,
                         f"must be longer than logging.heartbeat_s = {recipe.logging.heartbeat_s}"))
    if recipe.logging.notify_urls:
        from relax_hpc.ops.notify import Notifier

        for i, url in enumerate(recipe.logging.notify_urls):
            if Notifier.check([url]):  # the value shown is the scheme only: URLs carry tokens
                problems.append((f"logging.notify_urls[{i}]", url.split("://", 1)[0] + "://...",
                                 "is not a URL Apprise understands. Fix: see https://github.com/caronc/apprise/wiki"))
    if recipe.logging.wandb is not None:
        from relax_hpc.ops.wandb_log import check as check_wandb

        problems += check_wandb(recipe.logging.wandb)
    problems += [(f"algorithm.{k}", v, m) for k, v, m in check_algorithm(recipe.algorithm)]
    if recipe.opd is not None:
        problems += [(f"opd.{k}", v, m) for k, v, m in check_opd(recipe.opd)
                     if not (k == "teacher_url" and v is None)]  # which teacher the run asks: _check_teacher
    problems += [(f"train.{k}", v, m) for k, v, m in check_train(recipe.train)]
    problems += check_forward(recipe)  # reference and actor_fwd: their layout, as train.* is the actor's
    problems += check_data(recipe.data, recipe.rollout)  # keys already carry their section
    problems += _check_rm_type(recipe)
    problems += _check_batch(recipe)
    problems += _check_dynamic_sampling(recipe.rollout, recipe.mode)
    problems += _check_context_bound(recipe)
    if recipe.rollout.interaction_env_path or not recipe.rollout.custom_config_path:  # else its YAML says: check_files
        problems += _check_lengths(recipe, bool(recipe.rollout.interaction_env_path))
    problems += _check_genrm(recipe)
    problems += _check_teacher(recipe)
    problems += _check_engine_args(recipe)
    problems += _check_train_offload(recipe)
    problems += _check_lora_adapter_mode(recipe)
    problems += check_memory_keys(recipe)  # slurm.gpu_memory_gb; megatron-core's optimizer offload: GPU only
    if recipe.train.routing_replay and recipe.roles.actor_fwd.enabled:
        problems.append(("train.routing_replay", True, "with roles.actor_fwd: its π_old pass has no engine experts "
                         "to replay, so π_old and π_θ would route differently. Fix: disable roles.actor_fwd (the "
                         "actor's own forward is π_old) or routing_replay"))
    problems += _check_elastic(recipe)
    problems += _check_container(recipe)
    return problems


# sglang.launch_server arguments relax_hpc sets itself (relax_hpc/engines/launcher.py and roles/engine_host.py): a
# second value would fight the run's own (the model, where it listens, its key, TP from roles.rollout, the seed
# and weight version the run's reproducibility rests on)
ENGINE_ARGS_SET = {
    "--model-path": "model.path", "--model": "model.path", "--tokenizer-path": "model.path",
    "--host": "the node's address", "--port": "a free port the kernel picks", "--api-key": "the run's API key",
    "--tp-size": "roles.rollout.gpus_per_node / tasks_per_node", "--tp": "roles.rollout.gpus_per_node / tasks_per_node",
    "--tensor-parallel-size": "roles.rollout.gpus_per_node / tasks_per_node",
    "--random-seed": "run.seed and the engine's rank", "--weight-version": "the run's weight versions",
}


_IMAGE = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_.:/@#+=-]*")  # enroot URIs (nvcr.io#nvidia/...), paths, docker://
_MOUNT_PATH = re.compile(r"/[A-Za-z0-9_./+@%=-]*")  # absolute; ',' and ':' separate mounts, the rest is shell syntax
_PYTHON = re.compile(r"[A-Za-z0-9_./+-]+")


def _bad_chars(val: str, allowed: re.Pattern) -> str:
    bad = sorted({c for c in val if not allowed.fullmatch("/" + c)})  # each pattern takes '/' first
    return f"contains {' '.join(repr(c) for c in bad)}, refused" if bad else "is not allowed here"


def _check_container(r: Recipe) -> list[Problem]:
    """``slurm.container`` (docs/containers.md): every value becomes an srun option or an ``apptainer exec``
    argument, so each is a plain word or an absolute path, and the options it sets are not set twice."""
    c = r.slurm.container
    if c is None:
        return []
    key = "slurm.container"
    out: list[Problem] = []
    if c.runtime is None:
        out.append((f"{key}.runtime", None, "says which runtime starts the image. Fix: runtime: pyxis (srun "
                                            "--container-image, on clusters with pyxis/enroot) or runtime: apptainer "
                                            "(apptainer exec --nv)"))
    example = ("an Apptainer image such as '/shared/images/relax.sif'" if c.runtime == "apptainer" else
               "an enroot image such as 'nvcr.io#nvidia/pytorch:25.09-py3' or '/shared/images/relax.sqsh'")
    if not c.image.strip():
        out.append((f"{key}.image", c.image, f"is empty: the steps need an image to run in. Fix: {example}"))
    elif not _IMAGE.fullmatch(c.image):
        out.append((f"{key}.image", c.image, f"{_bad_chars(c.image, _IMAGE)}: an image is a registry URI or a path "
                                             f"without spaces or shell syntax. Fix: {example}"))
    for i, m in enumerate(c.mounts):
        src, dst, *flags = [*m.split(":"), ""][:max(2, m.count(":") + 1)]
        if not (m.count(":") in (1, 2) and _MOUNT_PATH.fullmatch(src) and _MOUNT_PATH.fullmatch(dst)
                and flags in ([], ["ro"], ["rw"])):
            out.append((f"{key}.mounts[{i}]", m, "is not SRC:DST (two absolute paths without ',' ':' spaces or "
                                                 "shell syntax, then ':ro' or ':rw' if you like). Fix: e.g. "
                                                 "'/lustre/models:/lustre/models:ro'"))
    for k, v in c.env.items():
        name = f"{key}.env.{k}" if k.isprintable() else f"{key}.env[{k!r}]"
        if not _ENV_NAME.fullmatch(k):
            out.append((name, v, f"the variable name {k!r} must be letters, digits and '_'. Fix: rename it"))
        elif k == "PYTHONPATH" or launcher_env_var(k):
            out.append((name, v, f"{k} is set by relax_hpc for every step (PYTHONPATH puts this relax_hpc first; "
                                 "RELAX_*/SLURM_* say who a rank is). Fix: remove it from slurm.container.env"))
        elif c.runtime == "pyxis" and (k in _HOST_LOADER_ENV or k.startswith("LD_")):
            out.append((name, v, f"with pyxis, env's values are in the environment of the host's srun (pyxis takes "
                                 f"them from there), so {k} would change how the host runs srun itself. Fix: set it "
                                 "in the image (ENV in its Dockerfile), or use runtime: apptainer"))
        elif "\0" in v:  # values travel in the steps' environment (not on srun/apptainer lines): ',' is fine
            out.append((name, v, "contains a NUL byte, which no environment variable can hold. Fix: remove it"))
    if c.workdir is not None and not _MOUNT_PATH.fullmatch(c.workdir):
        out.append((f"{key}.workdir", c.workdir, f"{_bad_chars(c.workdir, _MOUNT_PATH)}: the working directory is "
                                                 "an absolute path without ',' ':' or shell syntax. Fix: e.g. "
                                                 "'/lustre/project', or remove it for the directory relax-submit "
                                                 "runs in"))
    if not _PYTHON.fullmatch(c.python):
        out.append((f"{key}.python", c.python, f"{_bad_chars(c.python, _PYTHON)}: the image's interpreter, a "
                                               "command or a path. Fix: e.g. 'python3' or '/usr/bin/python'"))
    if any(ch in r.run.runs_root for ch in ",:"):
        out.append(("run.runs_root", r.run.runs_root, "contains ',' or ':', which separate container mounts, and "
                                                      "the run directory is mounted into the container. Fix: a "
                                                      "directory path without them"))
    for i, opt in enumerate(r.slurm.srun_args):
        if opt.startswith("--container-") or (opt.startswith("--export") and c.env and c.runtime == "pyxis"):
            out.append((f"slurm.srun_args[{i}]", opt, "sets what slurm.container sets itself (the container "
                                                      "options, and --export for its env). Fix: remove it, and "
                                                      "say it in slurm.container"))
    return out


_HOST_LOADER_ENV = ("PATH", "PYTHONHOME", "PYTHONSTARTUP")  # with LD_*: what decides which binary a host process runs


def _check_external(r: Recipe) -> list[Problem]:
    """rollout.external_engines: each a URL and an absolute key file of mode 0600 (read where the controller runs)."""
    import os

    from relax_hpc.rollout.external import KeyFileError, check_url, read_key_file

    out: list[Problem] = []
    seen: set[str] = set()
    for i, x in enumerate(r.rollout.external_engines):
        key = f"rollout.external_engines[{i}]"
        if set(x) != {"url", "key_file"}:
            out.append((key, x, "must be {url: http://HOST:PORT, key_file: /absolute/path} and nothing else (the key "
                        "itself never goes in a recipe)"))
            continue
        try:
            url = check_url(x["url"])
            if url in seen:
                out.append((f"{key}.url", x["url"], "is listed twice. Fix: list each engine once"))
            seen.add(url)
        except ValueError as e:
            out.append((f"{key}.url", x["url"], f"{e}. Fix: the address of a running engine"))
        if not os.path.isabs(os.path.expanduser(x["key_file"])):
            out.append((f"{key}.key_file", x["key_file"], "must be an absolute path (the controller reads it from its "
                        "own directory). Fix: the full path of the file holding the engine's API key"))
            continue
        try:
            read_key_file(x["key_file"], f"{key}.key_file")
        except KeyFileError as e:
            out.append((f"{key}.key_file", x["key_file"], str(e)))
    return out


def _check_elastic(r: Recipe) -> list[Problem]:
    """Scale-out's knobs (docs/elastic.md): spare rollout nodes, drain and join bounds, the attach defaults."""
    out: list[Problem] = []
    for name in ROLE_NAMES:
        if name != "rollout" and r.role(name).elastic is not None:
            out.append((f"roles.{name}.elastic", "{...}", "only rollout scales (its engines). Fix: remove it"))
    g, el = r.roles.rollout, r.roles.rollout.elastic
    if el is not None:
        if el.max is not None:  # it would only repeat nodes; accepted and ignored, it looked like a scale-out bound
            out.append(("roles.rollout.elastic.max", el.max, f"is not a setting: rollout's component holds "
                        f"roles.rollout.nodes ({g.nodes}) nodes, and the spare ones beyond elastic.initial are the "
                        f"most relax-scale can add. Fix: remove max, and set roles.rollout.nodes: {el.max} for a "
                        "component of that size (a cap on engines in all is rollout.elastic.max_engines)"))
        if not 1 <= el.initial < g.nodes:
            out.append(("roles.rollout.elastic.initial", el.initial, f"must be 1 to roles.rollout.nodes - 1 "
                        f"({g.nodes - 1}): the rest of the component's nodes are the spare ones relax-scale starts "
                        "engines on. Fix: raise roles.rollout.nodes, or remove roles.rollout.elastic"))
        if g.share_with is not None:
            out.append(("roles.rollout.elastic", "{...}", "needs rollout's own component (share_with is set)"))
    e = r.rollout.elastic
    for key in ("drain_timeout_s", "join_timeout_s"):
        if not getattr(e, key) > 0:
            out.append((f"rollout.elastic.{key}", getattr(e, key), "must be > 0 (seconds)"))
    out += _check_external(r)
    initial = (el.initial if el is not None else g.nodes) * g.tasks_per_node
    if e.max_engines is not None and e.max_engines < initial:
        out.append(("rollout.elastic.max_engines", e.max_engines, f"is below the {initial} engines the run starts "
                    "with. Fix: raise it, or null for no limit"))
    a = e.autoscale
    if a.enabled:
        if r.mode != "fully_async":
            out.append(("rollout.elastic.autoscale.enabled", True, "reads fully-async signals (the trainer waiting "
                        "for samples, rollout held at the staleness gate); in colocate the roles take turns by design. "
                        "Fix: mode: fully_async, or disable it"))
        low = a.min if a.min is not None else initial
        if a.max is None or a.max < max(low, 1):
            out.append(("rollout.elastic.autoscale.max", a.max, f"must be set, and at least min ({low}). Fix: the "
                        "most engines the run may have"))
        if a.min is not None and a.min < 1:
            out.append(("rollout.elastic.autoscale.min", a.min, "must be 1 or more, or null (the engines the run "
                        "starts with)"))
        for key in ("step", "window"):
            if getattr(a, key) < 1:
                out.append((f"rollout.elastic.autoscale.{key}", getattr(a, key), "must be 1 or more"))
        for key in ("scale_out_wait_ratio", "scale_in_idle_ratio"):
            if not 0 <= getattr(a, key) <= 1:
                out.append((f"rollout.elastic.autoscale.{key}", getattr(a, key), "must be a share, 0 to 1"))
        q = a.scale_out_queue_per_engine
        if q is not None and not q > 0:
            out.append(("rollout.elastic.autoscale.scale_out_queue_per_engine", q, "must be more than 0 (requests "
                        "waiting per engine), or null to leave the queue out of the decision"))
        for key in ("scale_out_cooldown_s", "scale_in_cooldown_s"):
            if getattr(a, key) < 0:
                out.append((f"rollout.elastic.autoscale.{key}", getattr(a, key), "must be 0 or more (seconds)"))
    for i, x in enumerate(e.attach.extra):
        if not x.startswith("--") or "\n" in x:
            out.append((f"rollout.elastic.attach.extra[{i}]", x, "must be one sbatch option, like '--reservation=r1'"))
    return out


def _check_engine_args(r: Recipe) -> list[Problem]:
    out: list[Problem] = []
    if r.rollout.engine.max_restarts < 0:
        out.append(("rollout.engine.max_restarts", r.rollout.engine.max_restarts, "must be 0 or more (0: a dead "
                    "engine stays dead)"))
    for i, arg in enumerate(r.rollout.engine.args):
        key = f"rollout.engine.args[{i}]"
        flag = arg.split("=", 1)[0]
        if flag in ENGINE_ARGS_SET:
            out.append((key, arg, f"relax_hpc sets {flag} itself (from {ENGINE_ARGS_SET[flag]}). Fix: remove it"))
        elif any(c in arg for c in "\n\r\0"):
            out.append((key, arg, "contains a line break or NUL. Fix: one argument per list item"))
    eng = r.rollout.engine
    if eng.kind == "reference" and eng.args:
        out.append(("rollout.engine.args", eng.args, "are sglang.launch_server arguments; rollout.engine.kind: "
                    "reference takes none. Fix: remove them, or kind: sglang / auto"))
    if eng.offload:
        if r.mode != "colocate":
            out.append(("rollout.engine.offload", True, f"hands the GPU between rollout and the actor, which take "
                        f"turns only in mode: colocate (this recipe: {r.mode}). Fix: mode: colocate, or offload: false"))
        if r.roles.actor_fwd.enabled:
            out.append(("rollout.engine.offload", True, "sends the weights to the engines by CUDA IPC, but roles."
                        "actor_fwd follows the actor through a weight-sync group. Fix: disable roles.actor_fwd, or "
                        "offload: false"))
    return out


def _check_train_offload(r: Recipe) -> list[Problem]:
    """train.offload frees the actor's device memory for engines on the same device while they generate: only
    colocate has them take turns (in fully_async the actor's GPUs are its own, and it trains while they generate)."""
    if r.train.offload and r.mode != "colocate":
        return [("train.offload", True, f"moves the actor's parameters, gradients and optimizer state off the GPU "
                 f"while the engines on it generate, which only mode: colocate has them do (this recipe: {r.mode}, "
                 "where the actor's GPUs are its own). Fix: offload: false, or mode: colocate")]
    return []


def _check_lora_adapter_mode(r: Recipe) -> list[Problem]:
    """train.lora.mode: adapter sends the adapters alone; only relax_hpc's reference engine applies them to every
    request (SGLang applies an adapter to the requests that name it, which the rollout does not), and actor_fwd's
    copy of the actor takes full weights only."""
    lora = r.train.lora
    if lora is None or lora.mode != "adapter":
        return []
    out: list[Problem] = []
    kind = r.rollout.engine.kind  # auto: SGLang on GPU engine nodes that have it (roles.engine_host.engine_kind)
    if kind == "sglang" or kind == "auto" and r.roles.rollout.gpus_per_node > 0:
        out.append(("train.lora.mode", "adapter", f"with rollout.engine.kind: {kind} the engines may be SGLang, which "
                    "applies a loaded adapter only to requests that name it, and the rollout names none: they would "
                    "generate with the base model. Fix: mode: merge (merged weights, as a full fine-tune syncs), or "
                    "rollout.engine.kind: reference"))
    if r.roles.actor_fwd.enabled:
        out.append(("train.lora.mode", "adapter", "roles.actor_fwd follows the actor's full weights and cannot take "
                    "the adapters alone. Fix: mode: merge, or roles.actor_fwd.enabled: false"))
    return out


def _check_genrm(r: Recipe) -> list[Problem]:
    """A judge role without a model, or a model without judge engines, would validate and do nothing."""
    g, on = r.genrm, r.roles.genrm.enabled
    out: list[Problem] = []
    if on and g.model_path is None:
        out.append(("genrm.model_path", None, "is required with roles.genrm.enabled: true (Relax --genrm-model-path). "
                    "Fix: the judge model's directory, or disable roles.genrm"))
    if g.model_path is not None and not on:
        out.append(("roles.genrm.enabled", False, f"genrm.model_path is set ({g.model_path!r}) but no judge engines "
                    "would run. Fix: set roles.genrm.enabled: true (and its nodes), or remove genrm.model_path"))
    if r.rollout.rm_type == "dapo-genrm" and r.rollout.custom_rm_path is None and not on:
        out.append(("rollout.rm_type", "dapo-genrm", "asks a GenRM judge, and the recipe has none. Fix: set "
                    "genrm.model_path and roles.genrm.enabled: true"))
    if r.roles.genrm.share_with is not None:
        out.append(("roles.genrm.share_with", r.roles.genrm.share_with, "the judge engines need nodes of their own "
                    "here. Fix: remove it and give roles.genrm its own nodes"))
    for key, val in (("request_timeout_s", g.request_timeout_s), ("sampling.max_response_len", g.sampling.max_response_len),
                     ("sampling.top_p", g.sampling.top_p)):
        if val <= 0:
            out.append((f"genrm.{key}", val, "must be more than 0"))
    if g.retries < 1:
        out.append(("genrm.retries", g.retries, "must be at least 1 (the number of attempts of one judge call)"))
    if g.sampling.temperature < 0:
        out.append(("genrm.sampling.temperature", g.sampling.temperature, "must be 0 or more"))
    return out


def _check_teacher(r: Recipe) -> list[Problem]:
    """OPD's teacher is the run's own engines (``roles.teacher``, serving ``opd.teacher_model_path``) or a server at
    ``opd.teacher_url``, exactly one; teacher engines without OPD, or a model without them, would do nothing."""
    on, opd = r.roles.teacher.enabled, r.opd if r.opd is not None and r.opd.enabled else None
    out: list[Problem] = []
    if r.roles.teacher.share_with is not None:
        out.append(("roles.teacher.share_with", r.roles.teacher.share_with, "the teacher engines need nodes of their "
                    "own here. Fix: remove it and give roles.teacher its own nodes"))
    if opd is None:
        if on:
            out.append(("roles.teacher.enabled", True, "the teacher engines serve on-policy distillation, and the "
                        "recipe has no opd section that is on. Fix: add opd: {teacher_model_path: <the teacher's "
                        "directory>} (docs/distillation.md), or disable roles.teacher"))
        return out
    if not on and opd.teacher_url is None:
        out.append(("opd.teacher_url", None, "is required when the run has no teacher engines of its own: the "
                    "teacher scores the student's tokens there (Relax --opd-teacher-url). Fix: the teacher SGLang "
                    "server's /generate endpoint, e.g. 'http://teacher-host:30000/generate', or roles.teacher.enabled: "
                    "true with opd.teacher_model_path"))
    if on and opd.teacher_url is not None:
        out.append(("opd.teacher_url", opd.teacher_url, "names a teacher server, and roles.teacher starts the run's "
                    "own teacher engines: the run would ask only one. Fix: remove opd.teacher_url, or disable "
                    "roles.teacher (and remove opd.teacher_model_path)"))
    if on and opd.teacher_model_path is None:
        out.append(("opd.teacher_model_path", None, "is required with roles.teacher.enabled: true (Relax "
                    "--teacher-hf-checkpoint). Fix: the teacher model's directory (it must use the student's "
                    "tokenizer), or disable roles.teacher and set opd.teacher_url"))
    if not on and opd.teacher_model_path is not None:
        out.append(("roles.teacher.enabled", False, f"opd.teacher_model_path is set ({opd.teacher_model_path!r}) but "
                    "no teacher engines would run. Fix: set roles.teacher.enabled: true (and its nodes), or remove "
                    "opd.teacher_model_path"))
    if opd.token_selection != "student_sampled":  # until the exchange carries both models' top-k to the trainer
        out.append(("opd.token_selection", opd.token_selection, "needs the top-k log-probs of the teacher and of the "
                    "student in the training step; the exchange carries the teacher's log-prob of each sampled token "
                    "only (teacher_log_probs). Fix: token_selection: student_sampled, with kl_type reverse_kl or "
                    "low_var_kl and log_prob_top_k 0"))
    return out


def _check_dynamic_sampling(ro: Any, mode: str) -> list[Problem]:
    """Over-sampling without a filter or partial rollout would draw more groups and keep the first ones, and
    partial rollout without over-sampling never aborts anything: knobs that do nothing are refused."""
    out: list[Problem] = []
    osb = ro.over_sampling_batch_size
    if ro.partial_rollout and mode != "fully_async":
        out.append(("rollout.partial_rollout", True, "needs mode: fully_async: which groups finish first depends "
                    "on timing, and colocate mode promises steps that come out the same on a resume. Fix: set "
                    "mode: fully_async, or remove this key"))
    elif ro.partial_rollout and (osb is None or osb <= ro.rollout_batch_size):
        out.append(("rollout.partial_rollout", True, f"needs rollout.over_sampling_batch_size above "
                    f"rollout.rollout_batch_size = {ro.rollout_batch_size}: the groups beyond it are the ones "
                    f"aborted at the step's end. Fix: e.g. over_sampling_batch_size: {2 * ro.rollout_batch_size}"))
    if not ro.partial_rollout:
        for key in ("partial_rollout_max_aborted_count", "mask_offpolicy_in_partial_rollout"):
            if getattr(ro, key) not in (None, False):
                out.append((f"rollout.{key}", getattr(ro, key), "only acts with rollout.partial_rollout: true. "
                            "Fix: set that too, or remove this key"))
    if ro.max_turns is not None and ro.max_turns < 1:
        out.append(("rollout.max_turns", ro.max_turns, "must be at least 1 model turn. Fix: e.g. 2"))
    if ro.max_context_len is not None and ro.max_context_len < 2:
        out.append(("rollout.max_context_len", ro.max_context_len, "must be at least 2 tokens or null. Fix: e.g. 4096"))
    if ro.env_step_timeout_s <= 0:
        out.append(("rollout.env_step_timeout_s", ro.env_step_timeout_s, "must be positive. Fix: e.g. 60"))
    if ro.partial_rollout and ro.interaction_env_path:
        out.append(("rollout.partial_rollout", True, "does not work with rollout.interaction_env_path yet (a "
                    "multi-turn rollout is not aborted and continued). Fix: use one of the two"))
    if ro.partial_rollout and ro.custom_generate_function_path:
        out.append(("rollout.partial_rollout", True, "does not work with rollout.custom_generate_function_path yet "
                    "(a custom function cannot be aborted and continued). Fix: use one of the two"))
    if ro.partial_rollout_max_aborted_count is not None and ro.partial_rollout_max_aborted_count < 1:
        out.append(("rollout.partial_rollout_max_aborted_count", ro.partial_rollout_max_aborted_count,
                    "must be at least 1 or null (no limit). Fix: e.g. 3"))
    if osb is not None and ro.dynamic_sampling_filter_path is None and not ro.partial_rollout:
        out.append(("rollout.over_sampling_batch_size", osb, "only acts with rollout.dynamic_sampling_filter_path "
                    "or rollout.partial_rollout (it is the number of groups drawn per round). Fix: set the filter, "
                    "e.g. relax_hpc.rollout.dynamic.check_reward_nonzero_std, or remove this key"))
    elif osb is not None and osb < ro.rollout_batch_size:
        out.append(("rollout.over_sampling_batch_size", osb, f"must be at least rollout.rollout_batch_size = "
                    f"{ro.rollout_batch_size} (groups drawn per round; Relax's rule). Fix: e.g. "
                    f"{2 * ro.rollout_batch_size}, or null for rollout_batch_size"))
    if ro.dynamic_sampling_max_rounds < 0:
        out.append(("rollout.dynamic_sampling_max_rounds", ro.dynamic_sampling_max_rounds,
                    "must be 0 (no limit) or more. Fix: e.g. 8"))
    return out


def _check_context_bound(r: Recipe) -> list[Problem]:
    """A multi-turn sample grows up to the context bound; one longer than ``train.max_seq_len`` failed the run at
    its first training step ("a sample has 25 tokens, more than train.max_seq_len = 16")."""
    ro, cap = r.rollout, r.train.max_seq_len
    if ro.max_context_len is None or ro.max_context_len <= cap:
        return []
    return [("rollout.max_context_len", ro.max_context_len, f"is more than train.max_seq_len = {cap}, the longest "
             "sample the trainer accepts (a multi-turn sample, prompt and every turn, grows up to "
             f"rollout.max_context_len tokens). Fix: at most {cap}, or null (the bound is then train.max_seq_len), "
             "or raise train.max_seq_len")]


def _check_lengths(r: Recipe, multiturn: bool) -> list[Problem]:
    """Samples longer than the trainer accepts (``train.max_seq_len``), and multi-turn keys without an environment,
    found before the queue. ``multiturn``: whether a multi-turn environment is named (with only a
    ``custom_config_path``, its YAML says: :func:`check_files` calls this then). A custom generate function makes
    its samples itself: only the trainer's own check applies to them."""
    ro, cap = r.rollout, r.train.max_seq_len
    out: list[Problem] = []
    if not multiturn:
        for key in ("max_turns", "max_context_len"):
            if getattr(ro, key) is not None:
                out.append((f"rollout.{key}", getattr(ro, key), "only acts with a multi-turn environment "
                            "(rollout.interaction_env_path, or rollout_interaction_env_path in the custom_config_path "
                            "YAML). Fix: set one, or remove this key"))
    if ro.custom_generate_function_path is not None:
        return out
    bound = min(ro.max_context_len or cap, cap)
    if multiturn and ro.max_prompt_len is not None and ro.max_prompt_len >= bound:
        out.append(("rollout.max_prompt_len", ro.max_prompt_len, f"leaves no room for a response in the multi-turn "
                    f"context bound of {bound} tokens (rollout.max_context_len, else train.max_seq_len = {cap}). "
                    f"Fix: below {bound}, or raise the bound"))
    elif not multiturn and ro.max_prompt_len is not None and ro.max_prompt_len + ro.max_response_len > cap:
        out.append(("rollout.max_response_len", ro.max_response_len, f"rollout.max_prompt_len + "
                    f"rollout.max_response_len = {ro.max_prompt_len} + {ro.max_response_len} = "
                    f"{ro.max_prompt_len + ro.max_response_len} tokens, more than train.max_seq_len = {cap}, the "
                    f"longest sample the trainer accepts. Fix: lower either so that their sum is at most {cap}, or "
                    "raise train.max_seq_len"))
    elif not multiturn and ro.max_response_len >= cap:
        out.append(("rollout.max_response_len", ro.max_response_len, f"leaves no room for a prompt in "
                    f"train.max_seq_len = {cap}, the longest sample (prompt + response) the trainer accepts. Fix: "
                    f"below {cap} by the longest prompt (and set rollout.max_prompt_len, which drops longer "
                    "prompts), or raise train.max_seq_len"))
    return out


def _check_batch(r: Recipe) -> list[Problem]:
    """Mini-batch updates split a rollout step's samples into k equal global batches
    (``train.num_steps_per_rollout`` = k, or ``train.global_batch_size`` = samples / k): a size that does not
    divide the samples, or two keys that disagree, would fail at step 1, after the queue."""
    gbs, k, ro = r.train.global_batch_size, r.train.num_steps_per_rollout, r.rollout
    samples = ro.rollout_batch_size * ro.n_samples_per_prompt
    what = (f"the samples of one rollout step, rollout.rollout_batch_size × rollout.n_samples_per_prompt = "
            f"{ro.rollout_batch_size} × {ro.n_samples_per_prompt} = {samples}")
    if gbs is not None and gbs >= 1 and samples % gbs:
        return [("train.global_batch_size", gbs, f"must divide {what}: each optimizer step trains one equal "
                 f"share of them. Fix: set it to {samples} (one step) or a divisor of {samples}, or null and "
                 "set train.num_steps_per_rollout")]
    if k is not None and k >= 1 and samples % k:
        return [("train.num_steps_per_rollout", k, f"must divide {what}: the step's samples are split into "
                 f"that many equal global batches. Fix: use a divisor of {samples}, e.g. 1, 2 or 4")]
    if k is not None and k >= 1 and gbs is not None and gbs >= 1 and gbs * k != samples:
        return [("train.num_steps_per_rollout", k, f"disagrees with train.global_batch_size = {gbs}: "
                 f"{k} steps of {gbs} samples is not {what}. Fix: set one of them (the other to null), or "
                 f"make global_batch_size = {samples} / num_steps_per_rollout")]
    a, mp = r.roles.actor, r.train.tp * r.train.pp
    world = a.nodes * a.tasks_per_node
    k = steps_per_rollout(r.train, samples)
    if mp >= 1 and world % mp == 0 and k >= 1 and samples // k < world // mp and gbs is None \
            and r.train.num_steps_per_rollout is None:
        # neither batch key is set: the actor's size is what asks too much (roles.actor.nodes=999)
        return [("roles.actor.nodes", a.nodes, f"gives {world // mp} data-parallel actor ranks (roles.actor.nodes × "
                 f"tasks_per_node ÷ (train.tp × train.pp)), more than the {samples} samples of one rollout step "
                 f"({ro.rollout_batch_size} × {ro.n_samples_per_prompt}): every rank needs at least one. Fix: at "
                 f"most {samples * mp // a.tasks_per_node or 1} nodes, or more samples per rollout step")]
    if mp >= 1 and world % mp == 0 and k >= 1 and samples // k < world // mp:
        return [("train.num_steps_per_rollout" if r.train.num_steps_per_rollout else "train.global_batch_size",
                 r.train.num_steps_per_rollout or gbs, f"leaves {samples // k} samples per optimizer step for "
                 f"{world // mp} data-parallel actor ranks: every rank needs at least one. Fix: fewer steps "
                 "per rollout, or more samples per rollout step")]
    return []


def known_rm_type(name: str) -> bool:
    """Whether ``relax_hpc.rollout.rewards.builtin_reward`` scores ``name``: a built-in, or ``boxed_<built-in>``."""
    while name.startswith("boxed_"):
        name = name[len("boxed_"):]
    return name in BUILTIN_REWARDS


def _check_rm_type(r: Recipe) -> list[Problem]:
    """An unknown built-in reward failed only at the first reward call (step 1, after the engines started).
    With ``custom_rm_path`` set, rm_type is only passed to that function, which may use names of its own."""
    rm, url = r.rollout.rm_type, r.rollout.rm_url
    out: list[Problem] = []
    if url is not None and not _HTTP_URL.fullmatch(url):
        out.append(("rollout.rm_url", url, "is not an http(s) URL. Fix: the reward server's address, e.g. "
                    "'http://rm-host:8000/score'"))
    if rm is None or r.rollout.custom_rm_path is not None:
        return out
    if rm == "remote_rm":
        if url is None:
            out.append(("rollout.rm_url", url, "is required with rollout.rm_type remote_rm (Relax --rm-url): each "
                        "sample is POSTed there as {prompt, response, label}. Fix: set rollout.rm_url to the reward "
                        "server's http(s) URL"))
        return out
    boxed_awaited = rm.startswith("boxed_") and rm.split("boxed_")[-1] in AWAITED_REWARDS
    if known_rm_type(rm) and not boxed_awaited:
        return out
    known = ", ".join(BUILTIN_REWARDS)
    what = (f"is refused: {rm.split('boxed_')[-1]} reads the whole response itself, so it has no boxed_ form"
            if boxed_awaited and known_rm_type(rm) else
            "is not a built-in reward of relax_hpc (Relax's ifbench, openr1mm, geo3k and mopd are not built in)")
    return out + [("rollout.rm_type", rm, f"{what}. Fix: use one of {known}, or boxed_<one of them> (e.g. "
                   "boxed_math), or write your reward function and set rollout.custom_rm_path")]


_PLACEMENT_OPTIONS = {"--het-group", "--relative", "-r", "--nodelist", "-w", "--exclude", "-x"}  # each step's own


def _check_strings(r: Recipe) -> list[Problem]:
    """Every string that becomes a Slurm argument must be a plain word: no value reaches a shell unquoted,
    and refusing metacharacters up front turns a confusing sbatch failure into a named key."""
    out = _check_line_breaks(r)
    broken = {k for k, _, _ in out}
    s = r.slurm
    words = {"slurm.partition": s.partition, "slurm.account": s.account, "slurm.qos": s.qos,
             "slurm.constraint": s.constraint, "slurm.job_name": s.job_name}
    for key, val in words.items():
        if key not in broken and val is not None and (not val or not _SLURM_WORD.fullmatch(val)):
            out.append((key, val, _meta_msg(val, "a Slurm name as `sinfo`/`sacctmgr` prints it")))
    if "slurm.time" not in broken and not _SLURM_TIME.fullmatch(s.time):
        out.append(("slurm.time", s.time, "is not Slurm time syntax. Fix: MM, HH:MM:SS or D-HH:MM:SS, e.g. '02:00:00'"))
    for i, opt in enumerate(s.sbatch_extra):
        if f"slurm.sbatch_extra[{i}]" not in broken and not _SLURM_OPTION.fullmatch(opt):
            out.append((f"slurm.sbatch_extra[{i}]", opt,
                        _meta_msg(opt, "one sbatch option per item, like '--mail-type=END'")))
    for i, opt in enumerate(s.srun_args):
        if f"slurm.srun_args[{i}]" not in broken and not _SLURM_OPTION.fullmatch(opt):
            out.append((f"slurm.srun_args[{i}]", opt,
                        _meta_msg(opt, "one srun option per item, like '--container-image=img.sqsh'")))
        elif opt.split("=")[0] in _PLACEMENT_OPTIONS:
            out.append((f"slurm.srun_args[{i}]", opt, "places the steps, which relax_hpc does itself per role "
                        "(--het-group, or --relative in slurm.layout single). Fix: remove it; give a role its "
                        "nodes with roles.<role>.nodes and slurm.constraint"))
    out += _check_env(s.env, broken)
    if r.run.name is not None and "run.name" not in broken and not _RUN_NAME.fullmatch(r.run.name):
        out.append(("run.name", r.run.name,
                    _meta_msg(r.run.name, "letters, digits, '.', '_' and '-', starting with a letter or digit")))
    if "run.runs_root" not in broken and any(c in r.run.runs_root for c in "%\\"):
        out.append(("run.runs_root", r.run.runs_root,
                    "contains '%' or '\\', which Slurm expands as a filename pattern (%j: job id, %t: task) in the "
                    "log paths of the run but not in the run directory itself, so logs would land elsewhere. "
                    "Fix: a plain directory path without '%' or '\\'"))
    for name in ROLE_NAMES:
        mem = r.role(name).mem
        if mem is not None and f"roles.{name}.mem" not in broken and not _MEM.fullmatch(mem):
            out.append((f"roles.{name}.mem", mem, "is not Slurm memory syntax. Fix: e.g. '16G' or '4000M'"))
    return out


def _script_strings(r: Recipe) -> dict[str, str | None]:
    """Every recipe string that ends up in the sbatch script, an srun command line or a path the job opens."""
    s = r.slurm
    out: dict[str, str | None] = {
        "slurm.partition": s.partition, "slurm.account": s.account, "slurm.qos": s.qos,
        "slurm.constraint": s.constraint, "slurm.job_name": s.job_name, "slurm.time": s.time,
        "slurm.template": s.template, "run.name": r.run.name, "run.runs_root": r.run.runs_root,
        "model.path": r.model.path, "data.path": r.data.path,
    }
    out.update({f"slurm.sbatch_extra[{i}]": v for i, v in enumerate(s.sbatch_extra)})
    out.update({f"slurm.srun_args[{i}]": v for i, v in enumerate(s.srun_args)})
    # slurm.env's values are not here: they travel in the steps' environment, never in the script (secrets)
    out.update({f"data.eval_prompt_data.{k}": v for k, v in r.data.eval_prompt_data.items()})
    out.update({f"roles.{n}.mem": r.role(n).mem for n in ROLE_NAMES})
    return out


def _path_values(r: Recipe) -> dict[str, str | None]:
    """Every recipe string that names a file, a directory or a module the run or relax-submit opens."""
    ro = r.rollout
    out = {"model.path": r.model.path, "genrm.model_path": r.genrm.model_path, "data.path": r.data.path,
           "opd.teacher_model_path": r.opd.teacher_model_path if r.opd is not None else None,
           "rollout.custom_config_path": ro.custom_config_path, "slurm.template": r.slurm.template,
           "run.runs_root": r.run.runs_root, "rollout.custom_rm_path": ro.custom_rm_path,
           "rollout.dynamic_sampling_filter_path": ro.dynamic_sampling_filter_path,
           "rollout.sample_filter_path": ro.sample_filter_path,
           "rollout.custom_generate_function_path": ro.custom_generate_function_path,
           "rollout.interaction_env_path": ro.interaction_env_path}
    out.update({f"data.eval_prompt_data.{k}": v for k, v in r.data.eval_prompt_data.items()})
    out.update({f"algorithm.{k}": getattr(r.algorithm, k) for k in PLUGIN_CALLS})
    return out


_PATH_MAX, _NAME_MAX = 4096, 255  # Linux's limits, in bytes: beyond them every open fails (ENAMETOOLONG)


def _check_path_lengths(r: Recipe) -> list[Problem]:
    """A path the system cannot even look up: refused here, by key, instead of an OSError from the first
    stat of it (every check of a file, and each role, would stumble on it)."""
    out: list[Problem] = []
    for key, val in _path_values(r).items():
        if val is None:
            continue
        size = len(val.encode("utf-8", "surrogatepass"))
        longest = max((len(p.encode("utf-8", "surrogatepass")) for p in re.split(r"[/.:]", val)), default=0)
        if size >= _PATH_MAX or longest > _NAME_MAX:
            out.append((key, val, f"is too long for a path ({size} bytes; a path may have {_PATH_MAX - 1}, each "
                                  f"name in it {_NAME_MAX}). Fix: the right path"))
    return out


def _check_line_breaks(r: Recipe) -> list[Problem]:
    """A line break or NUL in any of these would end an ``#SBATCH``/``export`` line; the renderer refuses it,
    but only as "<sbatch template>", so say here which key holds it (usually a YAML ``|`` block's newline)."""
    out: list[Problem] = []
    for key, val in _script_strings(r).items():
        if val is None or not any(c in val for c in "\n\r\0"):
            continue
        body = val.rstrip("\n\r\0")
        where = "contains" if any(c in body for c in "\n\r\0") else "ends in"
        out.append((key, val, f"{where} a newline or NUL byte, which cannot go into the sbatch script or a "
                              f"command line. Fix: {val.strip()!r} on one line (a YAML '|' block keeps its final "
                              "newline: use a plain or quoted string)"))
    return out


# Variables the launcher sets or reads in the controller and the role steps: a recipe that sets them would
# change what relax_hpc starts (SUBMITIT_LOCAL_NTASKS=2 starts two controllers on one run directory) or who
# a rank thinks it is. Slurm-set ones describe the job; the user sets Slurm's *input* variables (SLURM_CONF,
# SBATCH_*, SRUN_*) freely.
_LAUNCHER_ENV_PREFIXES = ("SUBMITIT_", "RELAX_", "SLURM_JOB", "SLURM_STEP", "SLURM_HET", "SLURM_ARRAY",
                          "SLURM_NTASKS", "SLURM_TASKS", "SLURM_SUBMIT", "SLURM_SRUN_COMM", "SLURM_TOPOLOGY",
                          "SLURMD_")
_LAUNCHER_ENV_NAMES = {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NPROCS", "SLURM_NNODES",
                       "SLURM_NODELIST", "SLURM_RESTART_COUNT", "SLURM_GTIDS", "SLURM_TASK_PID",
                       "SLURM_CLUSTER_NAME", "SLURM_CPUS_ON_NODE", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_PRIO_PROCESS",
                       "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}
# RELAX_* settings documented for users (docs/engines.md, docs/controller.md): not the launcher's own.
USER_RELAX_ENV = ("RELAX_SGLANG_PYTHON", "RELAX_SGLANG_TP", "RELAX_NOTIFY_URLS")


def launcher_env_var(name: str) -> bool:
    """True for a variable the launcher or Slurm sets for the job, which ``slurm.env`` must not override."""
    if name in USER_RELAX_ENV:
        return False
    return name in _LAUNCHER_ENV_NAMES or name.startswith(_LAUNCHER_ENV_PREFIXES)


def _check_env(env: dict[str, str], broken: set[str]) -> list[Problem]:
    out: list[Problem] = []
    for k, v in env.items():
        key = f"slurm.env.{k}" if k.isprintable() else f"slurm.env[{k!r}]"  # a newline in a key would split the line
        if not _ENV_NAME.fullmatch(k):
            out.append((key, v, f"the variable name {k!r} must be letters, digits and '_'. Fix: rename it"))
        elif launcher_env_var(k):
            out.append((key, v, f"{k} is set or read by relax_hpc's launcher or by Slurm for the job itself "
                                f"(SUBMITIT_*, RELAX_* except {', '.join(USER_RELAX_ENV)}, and Slurm's job/step "
                                "variables such as SLURM_JOB_ID, SLURM_PROCID, SLURM_NTASKS, SLURM_HET_*, "
                                "SLURM_RESTART_COUNT); overriding it breaks the run. Fix: remove it from slurm.env "
                                "and size the job with roles.<role>.nodes/tasks_per_node"))
        elif isinstance(v, str) and "\0" in v:  # the value travels in the environment, where a NUL cannot
            out.append((key, v, "contains a NUL byte, which no environment variable can hold. Fix: remove it"))
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
    elif mp > 0 and (world // mp) % max(1, r.train.ep):  # Megatron splits the experts over data-parallel ranks
        out.append(("train.ep", r.train.ep, f"does not divide the actor's data-parallel size {world // mp} ({world} ranks "
                    f"÷ (train.tp × train.pp)). Fix: a divisor of {world // mp}, or change the actor's size"))
    if a.gpus_per_node and a.tasks_per_node != a.gpus_per_node:
        out.append(("roles.actor.tasks_per_node", a.tasks_per_node,
                    f"on GPU nodes the actor runs one rank per GPU: set it to gpus_per_node = {a.gpus_per_node}"))
    if r.algorithm.use_kl_loss and not r.roles.reference.enabled:  # else the controller refuses it after the queue
        out.append(("algorithm.use_kl_loss", True, "needs the reference's log-probs (π_ref). Fix: "
                    "roles.reference.enabled: true (share_with: actor puts it on the actor's nodes), or "
                    "algorithm.use_kl_loss: false"))
    if r.mode == "colocate" and r.max_staleness != 0:
        out.append(("max_staleness", r.max_staleness, "colocate mode is strictly on-policy: use 0, or mode: fully_async"))
    if r.staleness_mode == "fixed" and r.rollout.partial_rollout:
        out.append(("staleness_mode", "fixed", "cannot be reproducible with rollout.partial_rollout (which groups are "
                    "cut off depends on timing). Fix: staleness_mode: bounded, or rollout.partial_rollout: false"))
    return out


def check_files(recipe: Recipe, cwd: str | Path | None = None) -> list[Problem]:
    """Checks that read the filesystem, so ``relax-submit`` runs them (through preflight) and the roles, which
    reload the recipe elsewhere, do not. Relative paths are resolved as the roles resolve them
    (``relax_hpc.roles.runtime.resolve``): against the directory the run is submitted from, ``cwd``."""
    base = Path.cwd() if cwd is None else Path(cwd)
    problems = _check_data_paths(recipe, base)
    problems += _check_media_roots(recipe, base)
    problems += _check_model_dirs(recipe, base)
    problems += _check_runs_root(recipe, base)
    problems += _check_context(recipe, base)
    problems += _check_plugins(recipe, base)
    problems += _check_custom_config(recipe, base)
    problems += check_memory(recipe, base)  # the memory plan against slurm.gpu_memory_gb (memory_plan.py)
    return problems


def _check_custom_config(r: Recipe, base: Path) -> list[Problem]:
    """``rollout.custom_config_path`` is read as the rollout role reads it (relax_args): an unreadable file or
    a key that contradicts the recipe is refused here instead of when the role starts, after the queue."""
    path = r.rollout.custom_config_path
    if not path or any(c in path for c in "\n\r\0"):
        return []
    try:  # read within the recipe's bounds first: a FIFO, a device or an alias bomb here would hang relax_args
        parse_yaml(read_text(_resolve(path, base)))
    except FileNotFoundError:
        pass  # relax_args says "cannot read"
    except (TextError, yaml.YAMLError) as e:
        text = yaml_error_message(e) if isinstance(e, yaml.YAMLError) else str(e)
        return [("rollout.custom_config_path", path, f"{text} (relative paths are relative to the directory you "
                 f"submit from, {base}). Fix: a YAML file of Relax's custom config keys")]
    resolved = dataclasses.replace(r, rollout=dataclasses.replace(r.rollout, custom_config_path=str(_resolve(path, base))))
    try:
        args = relax_args(resolved)
    except ValueError as e:
        return [("rollout.custom_config_path", path, str(e))]
    if r.rollout.interaction_env_path:  # known without the YAML: check already judged the lengths
        return []
    return _check_lengths(r, bool(getattr(args, "rollout_interaction_env_path", None)))


def _resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _check_model_dirs(r: Recipe, base: Path) -> list[Problem]:
    """A model is a Hugging Face directory with its config.json; ``/dev/null``, a file or a missing directory
    were accepted and failed only when a role loaded the weights, after the queue."""
    out: list[Problem] = []
    teacher = r.opd.teacher_model_path if r.opd is not None else None
    for key, val in (("model.path", r.model.path), ("genrm.model_path", r.genrm.model_path),
                     ("opd.teacher_model_path", teacher)):
        if val is None or any(c in val for c in "\n\r\0"):
            continue  # unset, or refused by the string checks
        wrong = _model_dir_problem(_resolve(val, base))
        if wrong:
            out.append((key, val, f"{wrong} (relative paths are relative to the directory you submit from, "
                                  f"{base}). Fix: the model's Hugging Face directory (config.json, tokenizer, "
                                  "weights), as an absolute path or relative to where you run relax-submit"))
        elif key == "model.path":
            out += _check_model_kind(r, val, (_model_config(_resolve(val, base))[0] or {}).get("model_type"))
    return out


def _check_model_kind(r: Recipe, val: str, kind: object) -> list[Problem]:
    """What model.path's kind (config.json's model_type) rules out: a vision tower to freeze needs a VLM; a VLM
    trains in padded micro-batches on one pipeline stage (relax_hpc.train.vlm refuses the rest when the actor
    builds, after the queue: refused here before submitting)."""
    out: list[Problem] = []
    vlm = kind in VLM_MODEL_TYPES
    out += _check_omni_kind(r, val, kind)
    if r.model.freeze_vision and not vlm:
        out.append(("model.freeze_vision", True, f"model.path {val!r} is a text model (model_type {kind!r}): "
                    "it has no vision tower to freeze. Fix: model.freeze_vision: false, or a "
                    f"vision-language model.path (model_type one of {list(VLM_MODEL_TYPES)})"))
    if not vlm:
        return out
    for attr in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        value = getattr(r.train, attr)
        if value is not None:
            out.append((f"train.{attr}", value, f"packs micro-batches (THD), but model.path {val!r} is a "
                        f"vision-language model (model_type {kind!r}): packing is not wired for M-RoPE and images. "
                        f"Fix: remove train.{attr} (padded micro-batches of train.micro_batch_size samples)"))
    if r.train.pp != 1:
        out.append(("train.pp", r.train.pp, f"model.path {val!r} is a vision-language model (model_type {kind!r}): "
                    "pipeline stages after the first are not wired for it. Fix: train.pp: 1"))
    return out


def _check_omni_kind(r: Recipe, val: str, kind: object) -> list[Problem]:
    """Audio needs an omni thinker's model.path (relax_hpc.train.omni), which trains frozen-tower, padded, on one
    pipeline stage: refused here, before the queue, rather than when the actor builds or the engine answers 400."""
    from relax_hpc.audio import OMNI_MODEL_TYPES

    out: list[Problem] = []
    omni = kind in OMNI_MODEL_TYPES
    mk = r.data.multimodal_keys if isinstance(r.data.multimodal_keys, dict) else {}
    if mk.get("audio") and not omni:
        hint = " (the whole Qwen2.5-Omni: give its thinker's directory)" if kind == "qwen2_5_omni" else ""
        out.append(("data.multimodal_keys.audio", mk["audio"], f"model.path {val!r} (model_type {kind!r}) has no "
                    f"audio tower this build runs{hint}. Fix: an omni thinker's model.path (model_type one of "
                    f"{list(OMNI_MODEL_TYPES)}), or remove the audio column"))
    if not r.model.freeze_audio:
        out.append(("model.freeze_audio", False, "training the audio tower is not wired yet (the weight sync sends "
                    "the language model only). Fix: model.freeze_audio: true"))
    if not omni:
        return out
    if mk.get("image"):
        out.append(("data.multimodal_keys.image", mk["image"], f"model.path {val!r} is an omni thinker: images "
                    "in its prompts are not wired yet (3-D positions in the actor). Fix: audio only"))
    for attr in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        value = getattr(r.train, attr)
        if value is not None:
            out.append((f"train.{attr}", value, f"packs micro-batches (THD), but model.path {val!r} is an omni "
                        f"thinker: packing is not wired for audio. Fix: remove train.{attr}"))
    if r.train.pp != 1:
        out.append(("train.pp", r.train.pp, f"model.path {val!r} is an omni thinker: its audio tower sits on one "
                    "pipeline stage. Fix: train.pp: 1"))
    return out


def _model_dir_problem(where: Path) -> str | None:
    try:
        mode = where.stat().st_mode
    except FileNotFoundError:
        return f"there is no directory {str(where)!r}"
    except (OSError, ValueError) as e:
        return f"{str(where)!r} cannot be read ({getattr(e, 'strerror', None) or e})"
    if not stat.S_ISDIR(mode):
        return f"{str(where)!r} is not a directory"
    _, wrong = _model_config(where)
    return wrong


_CONFIG_BYTES = 16 << 20  # a config.json is a few KB; one with a large label map still fits


def _model_config(where: Path) -> tuple[dict | None, str | None]:
    """The model directory's config.json as a mapping, or why not (read within the recipe's bounds)."""
    config = where / "config.json"
    try:
        data = json.loads(read_text(config, max_bytes=_CONFIG_BYTES))
    except FileNotFoundError:
        return None, f"{str(where)!r} has no config.json"
    except TextError as e:
        return None, f"{str(config)!r} {e}"
    except (ValueError, RecursionError) as e:
        return None, f"{str(config)!r} is not JSON ({type(e).__name__}: {e})"
    if not isinstance(data, dict):
        return None, f"{str(config)!r} is not a JSON object"
    return data, None


def _check_runs_root(r: Recipe, base: Path) -> list[Problem]:
    """``run.runs_root`` is made at submit if missing: what exists of it must be directories."""
    val = r.run.runs_root
    if any(c in val for c in "\n\r\0%\\"):
        return []  # refused by the string checks
    where = _resolve(val, base)
    for p in (where, *where.parents):
        try:
            mode = p.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):  # the first part that exists says
            continue
        except (OSError, ValueError) as e:
            return [("run.runs_root", val, f"{str(p)!r} cannot be read ({getattr(e, 'strerror', None) or e}). "
                     "Fix: a directory you can write, or one that can be made")]
        if not stat.S_ISDIR(mode):
            return [("run.runs_root", val, f"{str(p)!r} is not a directory, so no run directory can be made under "
                     f"it. Fix: a directory you can write (default ./runs)")]
        return []
    return []


def _check_data_paths(r: Recipe, base: Path) -> list[Problem]:
    """A missing prompt file, or a bad record in one, failed only when the rollout role read it, after the job had
    waited in the queue. The first rows of each dataset are read here as the role reads them
    (:func:`relax_hpc.rollout.data.check_data_files`); what does not refuse (blank lines skipped, some prompts
    over max_prompt_len) is logged."""
    paths = {"data.path": r.data.path, **{f"data.eval_prompt_data.{k}": v for k, v in r.data.eval_prompt_data.items()}}
    out: list[Problem] = []
    found: dict[str, Path] = {}
    for key, val in paths.items():
        if val is None or any(c in val for c in "\n\r\0"):
            continue  # unset, or already refused by the string checks
        where = _resolve(val, base)
        try:
            expand_paths(where)
            found[key] = where
        except DataError as e:
            out.append((key, val, f"{e} (relative paths are relative to the directory you submit from, {base}). "
                                  "Fix: give an existing JSONL/Parquet file or a directory of them, "
                                  "as an absolute path or relative to where you run relax-submit"))
    model = r.model.path
    model_dir = _resolve(model, base) if model and not any(c in model for c in "\n\r\0") else None
    problems, notes = check_data_files(r.data, r.rollout, found, model_dir)
    for note in notes:
        log.warning("%s", note)
    return out + [(key, paths[key], msg) for key, msg in problems]


def _check_media_roots(r: Recipe, base: Path) -> list[Problem]:
    """``data.media_roots``: each an existing directory (a typo would fail every row that names a file there, one
    sample at a time, after the queue)."""
    out: list[Problem] = []
    for i, root in enumerate(r.data.media_roots):
        if not isinstance(root, str) or not root.strip() or "\0" in root:
            continue  # refused by check_data
        if not _resolve(root, base).is_dir():
            out.append((f"data.media_roots[{i}]", root, f"is not a directory (relative paths are relative to the "
                        f"directory you submit from, {base}). Fix: an existing directory that holds the dataset's "
                        "images, or remove it"))
    return out


def _check_plugins(r: Recipe, base: Path) -> list[Problem]:
    """A function reference that does not load (a typo, a missing file, a wrong signature) failed only when a
    role first called it: at the first reward or the first training step, after the job had queued and the
    engines had started. Load each one here as the roles will (relative to the submit directory, which is their
    working directory) and check it accepts the call they make.

    Not refused: a module that exists but imports a package missing on this machine (the job may run in a
    container or another environment); that is logged. Bad forms were already refused by :func:`check`."""
    refs = [("rollout.custom_rm_path", r.rollout.custom_rm_path, REWARD_PARAMS, ()),
            ("rollout.dynamic_sampling_filter_path", r.rollout.dynamic_sampling_filter_path, ("args", "samples"), ()),
            ("rollout.sample_filter_path", r.rollout.sample_filter_path, ("args", "groups"), ()),
            ("rollout.custom_generate_function_path", r.rollout.custom_generate_function_path, GENERATE_PARAMS, ()),
            ("rollout.interaction_env_path", r.rollout.interaction_env_path and env_factory(r.rollout.interaction_env_path),
             (), ("sample", "args"))]
    refs += [(f"algorithm.{k}", getattr(r.algorithm, k), params, kw) for k, (params, kw) in PLUGIN_CALLS.items()]
    out: list[Problem] = []
    for key, spec, params, keywords in refs:
        if spec is None:
            continue
        try:
            load_plugin(spec, key, params=params, keywords=keywords, base=base)
        except PluginError as e:
            if e.kind == "dependency":
                log.warning("not checked here: %s", e)
            elif e.kind != "syntax":
                out.append((key, spec, e.message))
    return out


def _check_context(r: Recipe, base: Path) -> list[Problem]:
    """Prompt + response longer than the model's context fails (or silently truncates) inside the engine, at
    step 1; the model's config.json says its limit, so compare before submitting."""
    limit, config = _max_positions(r.model.path, base)
    if limit is None:
        return []
    ro = r.rollout
    if ro.max_prompt_len is None:
        if ro.max_response_len <= limit:
            return []
        return [("rollout.max_response_len", ro.max_response_len,
                 f"is longer than the model's context, max_position_embeddings = {limit} in {config}. "
                 f"Fix: at most {limit} tokens minus the longest prompt; set rollout.max_prompt_len too, so that "
                 f"max_prompt_len + max_response_len <= {limit}")]
    total = ro.max_prompt_len + ro.max_response_len
    if total <= limit:
        return []
    return [("rollout.max_response_len", ro.max_response_len,
             f"rollout.max_prompt_len + rollout.max_response_len = {ro.max_prompt_len} + {ro.max_response_len} = "
             f"{total} tokens, more than the model's context, max_position_embeddings = {limit} in {config}. "
             f"Fix: lower either so that their sum is at most {limit}")]


def _max_positions(model_path: str | None, base: Path) -> tuple[int | None, Path | None]:
    """``max_position_embeddings`` of the model's config.json (or of its ``text_config``); None when there is no
    model directory, no config.json or no such key: then there is nothing to check against."""
    if model_path is None or any(c in model_path for c in "\n\r\0"):
        return None, None
    config = _resolve(model_path, base) / "config.json"
    data, _ = _model_config(config.parent)  # a bad model directory is _check_model_dirs' to report
    if data is None:
        return None, None
    for section in (data, data.get("text_config") if isinstance(data, dict) else None):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, config
    return None, None
