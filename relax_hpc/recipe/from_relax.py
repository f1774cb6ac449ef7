"""``relax-submit --from-relax-args ARGS...``: a Relax launch script's flags, as a recipe.

Why: a team moving from Relax has working launch scripts (``python train.py --hf-checkpoint ... --rollout-batch-size
32 ...``). Typing each flag into a recipe by hand is where values get lost, so this turns the flags into the
recipe's YAML, using the same table the recipe's errors use (:mod:`relax_hpc.recipe.relax_names`). Flags that have
no home yet, or that relax_hpc describes differently (GPU counts become role sizes), are listed as comments at the
top of the YAML, never silently dropped. The result is validated like any recipe before it is printed.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from relax_hpc.recipe.relax_names import ONLY_WITH, OPD_TYPES, RELAX_NAMES, cli_flag, relax_flag
from relax_hpc.recipe.schema import Recipe
from relax_hpc.train.config import TrainConfig

# Relax's own functions that relax_hpc ships under another path
FUNCTION_PATHS = {
    "relax.engine.filters.dynamic_sampling_filters.check_reward_nonzero_std":
        "relax_hpc.rollout.dynamic.check_reward_nonzero_std",
}
# Relax's defaults where relax_hpc's differ and the difference changes what is read: written out unless given
RELAX_DEFAULTS = {"data.input_key": "input", "data.label_key": None}


def split_flags(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``--flag v1 v2 --other=x --switch`` → [("--flag", ["v1", "v2"]), ("--other", ["x"]), ("--switch", [])]."""
    out: list[tuple[str, list[str]]] = []
    for tok in argv:
        if tok.startswith("--"):
            flag, eq, value = tok.partition("=")
            out.append((flag, [value] if eq else []))
        elif out:
            out[-1][1].append(tok)
        else:
            raise ValueError(f"{tok!r} comes before any --flag: give Relax's flags, e.g. --rollout-batch-size 32")
    return out


def _leaf_type(key: str) -> Any:
    """The schema type of recipe key ``a.b.c``, or None when it names a section (or nothing)."""
    cls: Any = Recipe
    hint: Any = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        hint = hints[part]
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        cls = inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else hint  # X | None: a section
    return None if dataclasses.is_dataclass(cls) else hint


def _scalar(text: str, hint: Any) -> Any:
    v = yaml.safe_load(text) if text.strip() else ""
    want = {int: int, float: float}.get(hint) or next(
        (t for t in (float, int) if t in typing.get_args(hint)), None)
    if isinstance(v, str) and want is not None:  # YAML 1.1 reads 1e-6 as a string
        try:
            return want(v)
        except ValueError:
            return v
    if isinstance(v, str):
        return FUNCTION_PATHS.get(v, v)
    return v


def _value(values: list[str], hint: Any) -> Any:
    if typing.get_origin(hint) is dict and len(values) % 2 == 0:  # Relax's NAME PATH [NAME PATH ...] pairs
        return dict(zip(values[::2], values[1::2]))
    parsed = [_scalar(v, hint) for v in values]
    is_list = typing.get_origin(hint) is list
    if not parsed:
        return [] if is_list else True  # a switch: Relax's store_true
    if is_list:
        return parsed
    return parsed[0] if len(parsed) == 1 else parsed


def _put(data: dict, key: str, value: Any) -> None:
    node = data
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def convert(argv: list[str]) -> tuple[dict, list[str]]:
    """(recipe data, notes): the recipe's keys for the flags that have one; a note for every flag that does not."""
    data: dict = {}
    notes: list[str] = []
    given: set[str] = set()
    flags = split_flags(argv)
    named = {relax_flag(f) for f, _ in flags}
    for flag, values in flags:
        name = relax_flag(flag)
        shown = " ".join([flag, *values])
        if name not in RELAX_NAMES:
            notes.append(f"{shown}: not in relax_hpc's table of Relax flags; left out")
            continue
        home = RELAX_NAMES[name]
        if home is None:
            notes.append(f"{shown}: not supported yet; left out (docs/migrating-from-relax.md)")
            continue
        if name in ONLY_WITH.values() and ": <" in home:  # a switch that says how Relax reads flags: no key of its own
            key, src = home.split(": <", 1)
            if relax_flag(src.rstrip(">")) not in named:
                notes.append(f"{shown}: without {src.rstrip('>')} (Relax refuses that); left out. Fix: set {key}")
            continue
        if name in ONLY_WITH and ONLY_WITH[name] not in named:
            notes.append(f"{shown}: Relax reads it only with {cli_flag(ONLY_WITH[name])}; left out")
            continue
        if name == "opd_type":  # which teacher: relax_hpc's is a server, at opd.teacher_url (no key of its own)
            if " ".join(values) not in OPD_TYPES:
                raise ValueError(f"{shown}: relax_hpc's OPD teacher is an SGLang server it asks for log-probs "
                                 "(opd.teacher_url); a teacher inside the trainer (--opd-type megatron, "
                                 "--opd-teacher-load) is not supported. Fix: serve the teacher with SGLang and pass "
                                 "--opd-type sglang --opd-teacher-url http://HOST:PORT/generate")
            continue
        if name == "use_wandb" and "wandb_mode" in named:  # the switch's mode is online unless --wandb-mode says
            continue
        if ": " in home:  # a flag that is a value of one key: --fully-async is mode: fully_async
            key, value = home.split(": ", 1)
            if values and not _value(values, bool):
                continue
            _put(data, key, yaml.safe_load(value))
            given.add(key)
            continue
        hint = _leaf_type(home)
        if hint is None:
            notes.append(f"{shown}: set {home} by hand (relax_hpc sizes it differently: docs/migrating-from-relax.md)")
            continue
        _put(data, home, _value(values, hint))
        given.add(home)
    for role, group in (data.get("roles") or {}).items():  # Relax runs one rank per GPU; relax_hpc says so
        if isinstance(group, dict) and group.get("gpus_per_node") and "tasks_per_node" not in group:
            group["tasks_per_node"] = group["gpus_per_node"]
            notes.append(f"roles.{role}.tasks_per_node: {group['gpus_per_node']}, one rank per GPU as in Relax")
    if (data.get("genrm") or {}).get("model_path") and "genrm" not in (data.get("roles") or {}):
        _put(data, "roles.genrm.enabled", True)  # Relax's --genrm-model-path enables the judge
        notes.append("roles.genrm.enabled: true, as --genrm-model-path enables Relax's judge (size it: roles.genrm)")
    if (data.get("opd") or {}).get("teacher_model_path") and "teacher" not in (data.get("roles") or {}):
        _put(data, "roles.teacher.enabled", True)  # Relax's --teacher-hf-checkpoint starts a managed teacher
        notes.append("roles.teacher.enabled: true, as --teacher-hf-checkpoint starts Relax's managed teacher "
                     "(size it: roles.teacher)")
    for key, value in RELAX_DEFAULTS.items():
        if key not in given:
            _put(data, key, value)
            notes.append(f"{key}: {value!r} is Relax's default (relax_hpc's differs), written out")
    _size_max_seq_len(data, notes)
    tr = data.get("train") or {}
    if "max_tokens_per_micro_batch" in tr and "micro_batch_size" in tr:  # packed by tokens: a sample count unused
        del tr["micro_batch_size"]
        notes.append("--micro-batch-size: left out; with --use-dynamic-batch-size micro-batches are packed by tokens "
                     "(train.max_tokens_per_micro_batch), as in Relax")
    if tr.get("sequence_parallel") is True and tr.get("tp", 1) == 1:  # Megatron turns it off at TP 1, with a warning
        del tr["sequence_parallel"]
        notes.append("--sequence-parallel: left out, as Megatron turns it off without tensor parallelism (train.tp 1)")
    ro = data.get("rollout") or {}
    if "max_context_len" in ro and not ro.get("interaction_env_path") and not ro.get("custom_config_path"):
        del ro["max_context_len"]  # single-turn: relax_hpc bounds a sample by train.max_seq_len (sized above)
        notes.append("--rollout-max-context-len: left out; it bounds multi-turn rollouts only in relax_hpc (a "
                     "single-turn sample is bounded by train.max_seq_len)")
    return data, notes


def _size_max_seq_len(data: dict, notes: list[str]) -> None:
    """``train.max_seq_len`` that holds the longest sample the flags allow, where that is more than the default: Relax's
    trainer takes a sample of any length, relax_hpc's refuses one longer than ``train.max_seq_len`` (and the
    validator refuses lengths that cannot fit). The bound: the context length, else prompt + response, else the
    response and the default's worth of prompt."""
    ro, default = data.get("rollout") or {}, TrainConfig().max_seq_len
    ctx, prompt, resp = (ro.get(k) for k in ("max_context_len", "max_prompt_len", "max_response_len"))
    ok = [isinstance(v, int) and not isinstance(v, bool) for v in (ctx, prompt, resp)]
    if ok[0]:
        need, why = ctx, "--rollout-max-context-len"
    elif ok[1] and ok[2]:
        need, why = prompt + resp, "--rollout-max-prompt-len + --rollout-max-response-len"
    elif ok[2]:
        need, why = resp + default, (f"--rollout-max-response-len + {default} tokens of prompt (set "
                                     "rollout.max_prompt_len to drop longer prompts)")
        tr = data.get("train") or {}
        budgets = [tr[k] for k in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch")
                   if isinstance(tr.get(k), int) and not isinstance(tr.get(k), bool)]
        if budgets and resp < min(budgets) < need:  # a guessed prompt length must not outgrow the token budget
            need, why = min(budgets), ("the token budget (--max-tokens-per-gpu / --log-probs-max-tokens-per-gpu): a "
                                       "sample must fit one micro-batch, so prompts are bounded by it too")
    else:
        return
    if need > default:
        _put(data, "train.max_seq_len", need)
        notes.append(f"train.max_seq_len: {need} = {why}: Relax trains a sample of any length, relax_hpc refuses one "
                     f"longer than train.max_seq_len (default {default})")


def to_yaml(data: dict, notes: list[str], argv: list[str]) -> str:
    head = ["# recipe made by relax-submit --from-relax-args from:", "#   " + " ".join(argv)]
    if notes:
        head.append("# not carried over, or worth a look:")
        head += [f"#   {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
