"""``relax-submit --from-relax-args ARGS...``: a Relax launch script's flags, as a recipe.

Why: a team moving from Relax has working launch scripts (``python train.py --hf-checkpoint ... --rollout-batch-size
32 ...``). Typing each flag into a recipe by hand is where values get lost, so this turns the flags into the
recipe's YAML, using the same table the recipe's errors use (:mod:`relax_hpc.recipe.relax_names`). Flags that have
no home yet, or that relax_hpc describes differently (GPU counts become role sizes), are listed as comments at the
top of the YAML, never silently dropped. The result is validated like any recipe before it is printed.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import typing
from typing import Any

import yaml

from relax_hpc.recipe.relax_names import (ARCHITECTURE, ONLY_WITH, OPD_TYPES, RELAX_NAMES, SAME_AS_HERE, WHY, cli_flag,
                                          relax_flag)
from relax_hpc.recipe.schema import Recipe
from relax_hpc.train.config import TrainConfig

# Relax's own functions that relax_hpc ships under another path
FUNCTION_PATHS = {
    "relax.engine.filters.dynamic_sampling_filters.check_reward_nonzero_std":
        "relax_hpc.rollout.dynamic.check_reward_nonzero_std",
}
# Relax's defaults where relax_hpc's differ and the difference changes what is read: written out unless given
RELAX_DEFAULTS = {"data.input_key": "input", "data.label_key": None}
# Flags that say where roles run and how big they are: read together after the others (size_roles, _forward)
LAYOUT = ("resource", "rollout_num_gpus", "rollout_num_gpus_per_engine", "num_gpus_per_node", "ref_actor_config",
          "ref_load", "offload")
# --ref-actor-config's keys (Megatron's names) and their forward.* keys
REF_ACTOR_KEYS = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
                  "sequence_parallel": "sequence_parallel", "max_tokens_per_gpu": "max_tokens_per_micro_batch"}


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


def _is_key(key: str) -> bool:
    """Whether ``a.b.c`` names a key (or section) of this relax_hpc's schema."""
    cls: Any = Recipe
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        inner = [a for a in typing.get_args(hints[part]) if a is not type(None)]
        cls = inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else hints[part]
    return True


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
    layout: dict[str, list[str]] = {}
    arch: list[str] = []
    engine_args: list[str] = []
    for flag, values in flags:
        name = relax_flag(flag)
        shown = " ".join([flag, *values])
        if name in ARCHITECTURE:
            arch.append(shown)
            continue
        if name not in RELAX_NAMES and name.startswith("sglang_") and not name.startswith("sglang_router_"):
            engine_args += ["--" + flag.removeprefix("--sglang-"), *values]  # Relax's --sglang-<field>: SGLang's own
            continue
        if name not in RELAX_NAMES:
            notes.append(f"{shown}: not in relax_hpc's table of Relax flags; left out")
            continue
        if name in LAYOUT:
            layout[name] = values
            continue
        if name in SAME_AS_HERE and " ".join(values) == SAME_AS_HERE[name][0]:
            notes.append(f"{shown}: {SAME_AS_HERE[name][1]}")
            continue
        home = RELAX_NAMES[name]
        if home is None:
            notes.append(f"{shown}: {WHY.get(name, 'not supported yet')}; left out (docs/migrating-from-relax.md)")
            continue
        if not _is_key(home.split(":")[0]):  # a key of a newer relax_hpc than this one
            notes.append(f"{shown}: {WHY.get(name, 'not supported yet')} (no {home}); left out")
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
    if arch:
        notes.append(f"{' '.join(arch)}: the model's architecture; relax_hpc reads it from model.path's config.json "
                     "(megatron-bridge); left out")
    if engine_args:  # Relax's engines are SGLang's
        _put(data, "rollout.engine.kind", "sglang")
        _put(data, "rollout.engine.args", engine_args)
    colocate = data.get("mode", "colocate") == "colocate" and "colocate" in named
    size_roles(data, notes, layout, colocate)
    _forward(data, notes, layout.get("ref_actor_config"),
             dynamic="use_dynamic_batch_size" in named)
    _offload(data, notes, layout, colocate, named)
    _kl_reference(data, notes, colocate)
    if "fp16" not in named and "bf16" not in named:  # Megatron under Relax: bf16 unless --fp16
        _put(data, "train.bf16", True)
        notes.append("train.bf16: true, as Relax trains in bf16 (fp32 master weights) unless --fp16")
    if "ref_load" in layout:
        ref = " ".join(layout["ref_load"])
        model = (data.get("model") or {}).get("path")
        same = model is not None and ref.rstrip("/") == str(model).rstrip("/")
        notes.append(f"--ref-load {ref}: " + ("the reference starts from model.path, as here" if same else
                                              WHY["ref_load"] + "; left out"))
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
    _lora(data, notes)
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


def _count(flag: str, values: list[str] | None, default: int) -> int:
    if values is None:
        return default
    try:
        n = int(" ".join(values))
    except ValueError:
        raise ValueError(f"{flag} {' '.join(values)}: not a whole number of GPUs") from None
    if n < 1:
        raise ValueError(f"{flag} {n}: must be at least 1")
    return n


def _nodes(what: str, gpus: int, per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of ``gpus`` GPUs on nodes of ``per_node``: relax_hpc gives a role the same count on each
    of its nodes."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        raise ValueError(f"{what}: {gpus} GPUs do not fill whole nodes of {per_node} (--num-gpus-per-node), and "
                         f"relax_hpc gives a role the same GPUs on each of its nodes. Fix: a multiple of {per_node}")
    return gpus // per_node, per_node


def size_roles(data: dict, notes: list[str], layout: dict[str, list[str]], colocate: bool) -> None:
    """Relax's ``--resource '{"actor": [1, 8], "rollout": [1, 8], ...}'`` (each role's GPUs), ``--rollout-num-gpus``,
    ``--rollout-num-gpus-per-engine`` (an engine's TP) and ``--num-gpus-per-node``, as ``roles.*``: one rank per GPU
    for the Megatron roles; for rollout one task per engine (TP = gpus_per_node / tasks_per_node). Under
    ``--colocate`` rollout shares the actor's GPUs (``share_with: actor``), as Relax forces. ``--actor-num-nodes`` and
    ``--actor-num-gpus-per-node`` win over the resource's actor, as in Relax."""
    per_node = _count("--num-gpus-per-node", layout.get("num_gpus_per_node"), 8)
    gpus: dict[str, int] = {}
    if "resource" in layout:
        text = " ".join(layout["resource"])
        try:
            res = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--resource {text}: not JSON ({e}). Fix: e.g. --resource "
                             "'{\"actor\": [1, 8], \"rollout\": [1, 8]}'") from None
        if not isinstance(res, dict):
            raise ValueError(f"--resource {text}: not a JSON object of role: [1, GPUs]")
        for role, spec in res.items():
            if not (isinstance(spec, list) and len(spec) == 2 and all(type(x) is int and x >= 0 for x in spec)):
                raise ValueError(f"--resource {role}: {spec!r} is not [replicas, GPUs]. Fix: e.g. \"{role}\": [1, 8]")
            if spec[0] != 1:
                raise ValueError(f"--resource {role}: {spec[0]} replicas; Relax (and relax_hpc) run one. "
                                 "Fix: [1, GPUs]")
            gpus[role] = spec[1]
    if "rollout_num_gpus" in layout:
        gpus["rollout"] = _count("--rollout-num-gpus", layout["rollout_num_gpus"], 1)
    roles = data.setdefault("roles", {})
    for role in ("actor", "reference", "actor_fwd"):
        if role not in gpus:
            continue
        if gpus[role] == 0:
            notes.append(f"--resource {role}: [1, 0]: no GPUs for a Megatron role; left out")
            continue
        nodes, per = _nodes(f"--resource {role}", gpus[role], per_node)
        group = roles.setdefault(role, {})
        if role != "actor":
            group["enabled"] = True
        group.setdefault("nodes", nodes)
        group.setdefault("gpus_per_node", per)
        group.setdefault("tasks_per_node", group["gpus_per_node"])
        notes.append(f"roles.{role}: {group['nodes']} node(s) x {group['gpus_per_node']} GPUs, one rank per GPU "
                     f"(--resource {role} [1, {gpus[role]}])")
    for role in sorted(set(gpus) - {"actor", "reference", "actor_fwd", "rollout"}):
        why = {"advantages": "relax_hpc computes advantages beside the controller, on no GPU",
               "genrm": "size the judge by hand: roles.genrm (docs/agentic.md)",
               "teacher": "size the teacher by hand: roles.teacher (docs/distillation.md)"}.get(role,
                                                                                                "not supported yet")
        notes.append(f"--resource {role}: [1, {gpus[role]}]: {why}; left out")
    _size_rollout(roles, notes, gpus.get("rollout"), layout, per_node, colocate)
    if not roles:
        del data["roles"]
    own = [r for r, g in roles.items() if g.get("enabled", True) and "share_with" not in g and g.get("gpus_per_node")]
    if len(own) > 1:  # Slurm never puts two het components of one job on one node
        notes.append(f"roles {', '.join(own)}: each is a het component of its own, on nodes of its own "
                     f"({sum(roles[r].get('nodes', 1) for r in own)} nodes in all), as Slurm places components; Relax "
                     "packs them onto shared machines. To pack a forward role onto the actor's nodes: "
                     "roles.<role>.share_with: actor (it then uses the actor's GPUs)")


def _size_rollout(roles: dict, notes: list[str], total: int | None, layout: dict[str, list[str]], per_node: int,
                  colocate: bool) -> None:
    per_engine = _count("--rollout-num-gpus-per-engine", layout.get("rollout_num_gpus_per_engine"), 1)
    if colocate:  # Relax: rollout_num_gpus is forced to the actor's total under --colocate
        actor = roles.get("actor") or {}
        nodes, per = actor.get("nodes", 1), actor.get("gpus_per_node", 0)
        if not per:
            if total is not None or "rollout_num_gpus_per_engine" in layout:
                notes.append("rollout: shares the actor's GPUs under --colocate, and the actor has none here; "
                             "size roles.actor (--resource actor [1, GPUs])")
            return
        if total is not None and total != nodes * per:
            notes.append(f"--resource rollout [1, {total}]: Relax uses the actor's {nodes * per} GPUs under --colocate "
                         "(and so does this recipe)")
        group = {"share_with": "actor", **({"nodes": nodes} if nodes > 1 else {}), "gpus_per_node": per}
        how = "on the actor's GPUs (--colocate)"
    elif total is None:
        if "rollout_num_gpus_per_engine" in layout:
            notes.append(f"--rollout-num-gpus-per-engine {per_engine}: rollout has no GPUs in --resource; "
                         "size roles.rollout by hand")
        return
    else:
        nodes, per = _nodes("--resource rollout", total, per_node)
        group = {"nodes": nodes, "gpus_per_node": per}
        how = f"{nodes} node(s) x {per} GPUs of its own"
    if per_engine > per or per % per_engine:
        raise ValueError(f"--rollout-num-gpus-per-engine {per_engine}: an engine must fit on one node's {per} GPUs "
                         f"with none left over (relax_hpc runs each engine within one node). Fix: a divisor of {per}")
    group["tasks_per_node"] = per // per_engine
    roles["rollout"] = {**group, **{k: v for k, v in (roles.get("rollout") or {}).items() if k not in group}}
    notes.append(f"roles.rollout: {group.get('nodes', 1) * group['tasks_per_node']} SGLang engine(s) of TP "
                 f"{per_engine} (--rollout-num-gpus-per-engine), {how}")


def _forward(data: dict, notes: list[str], values: list[str] | None, dynamic: bool) -> None:
    """``--ref-actor-config '{"tensor_model_parallel_size": 1, "max_tokens_per_gpu": 9216, ...}'`` (Relax's arguments
    for reference and actor_fwd over the actor's) as the ``forward:`` section."""
    if values is None:
        return
    text = " ".join(values)
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--ref-actor-config {text}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--ref-actor-config {text}: not a JSON object of Relax's argument names")
    roles = data.get("roles") or {}
    if not any((roles.get(r) or {}).get("enabled") for r in ("reference", "actor_fwd")):
        notes.append(f"--ref-actor-config {text}: no reference or actor_fwd in --resource; left out")
        return
    fwd: dict = {}
    for key, value in cfg.items():
        home = REF_ACTOR_KEYS.get(key)
        if key == "only_load_weight":
            notes.append(f"--ref-actor-config {key}: always so in relax_hpc (the forward roles load weights only)")
        elif key == "max_tokens_per_gpu" and not (dynamic or cfg.get("use_dynamic_batch_size")):
            notes.append(f"--ref-actor-config {key}: Relax reads it only with --use-dynamic-batch-size; left out")
        elif home is None:
            notes.append(f"--ref-actor-config {key}: not supported yet for the forward roles; left out")
        elif type(value) is not (bool if home == "sequence_parallel" else int):
            want = "true or false" if home == "sequence_parallel" else "a whole number"
            raise ValueError(f"--ref-actor-config {key}: {value!r} is not {want}")
        else:
            fwd[home] = value
    tp = fwd.get("tp", (data.get("train") or {}).get("tp", 1))
    if fwd.get("sequence_parallel") is True and tp == 1:
        del fwd["sequence_parallel"]
        notes.append("--ref-actor-config sequence_parallel: left out, as Megatron turns it off at TP 1")
    if fwd:
        data["forward"] = fwd


def _offload(data: dict, notes: list[str], layout: dict[str, list[str]], colocate: bool, named: set[str]) -> None:
    """``--offload`` is Relax's ``--offload-train`` with ``--offload-rollout``, and ``--colocate`` implies both."""
    if "offload" in layout:
        if _is_key("train.offload"):
            _put(data, "train.offload", True)
        else:
            notes.append(f"--offload: {WHY['offload_train']} (no train.offload); the engines' part is carried over")
        _put(data, "rollout.engine.offload", True)
    elif colocate:
        if "offload_rollout" not in named:
            _put(data, "rollout.engine.offload", True)
            notes.append("rollout.engine.offload: true, as Relax's --colocate implies --offload-rollout")
        if "offload_train" not in named and _is_key("train.offload"):
            _put(data, "train.offload", True)
            notes.append("train.offload: true, as Relax's --colocate implies --offload-train")


def _kl_reference(data: dict, notes: list[str], colocate: bool) -> None:
    """Relax's colocated actor computes π_ref itself; relax_hpc's comes from the reference role. A KL term of weight 0
    (Relax's scripts log it) is left out rather than given a role; a real one gets the reference on the actor's
    GPUs under --colocate."""
    algo, roles = data.get("algorithm") or {}, data.get("roles") or {}
    if not algo.get("use_kl_loss") or (roles.get("reference") or {}).get("enabled"):
        return
    if not algo.get("kl_loss_coef"):
        for key in ("use_kl_loss", "kl_loss_coef", "kl_loss_type"):
            algo.pop(key, None)
        if not algo:
            del data["algorithm"]
        notes.append("--use-kl-loss: left out, as --kl-loss-coef is 0 (the term adds nothing to the loss) and "
                     "there is no reference in --resource; Relax's colocated actor logs the KL it computes itself")
    elif colocate and (roles.get("actor") or {}).get("gpus_per_node"):
        a = roles["actor"]
        roles["reference"] = {"enabled": True, "share_with": "actor", **({"nodes": a["nodes"]} if a.get("nodes", 1) > 1
                                                                          else {}),
                              "gpus_per_node": a["gpus_per_node"], "tasks_per_node": a["tasks_per_node"]}
        notes.append("roles.reference: on the actor's GPUs (share_with: actor), for --use-kl-loss: Relax's colocated "
                     "actor computes π_ref itself, relax_hpc's reference role does")
    else:
        notes.append("--use-kl-loss: needs a reference role (roles.reference; Relax: reference in --resource)")


def _lora(data: dict, notes: list[str]) -> None:
    """Relax trains LoRA only with a --lora-rank above 0 (its default, 0, is full fine-tuning); its
    --lora-target-modules all-linear is every linear of the layers."""
    tr = data.get("train") or {}
    lora = tr.get("lora")
    if lora is None:
        return
    if not lora.get("rank"):
        del tr["lora"]
        notes.append("--lora-*: left out, as Relax trains LoRA only with --lora-rank above 0 "
                     "(full fine-tuning here too)")
        return
    targets = lora.get("target_modules")
    if isinstance(targets, str):
        targets = [t for t in targets.replace(",", " ").split() if t]
    if targets in (["all-linear"], ["all_linear"]):
        targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    if targets is not None:
        lora["target_modules"] = targets


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
    head = ["# recipe made by relax-submit --from-relax-args from:", "#   " + shlex.join(argv)]
    if notes:
        head.append("# not carried over, or worth a look:")
        head += [f"#   {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
