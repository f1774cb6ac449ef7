"""The recipe's ``rollout.engine`` section, the inference servers' own settings, and its check.

Pure Python on purpose (no torch, no httpx): the recipe's schema and validator import this on the login node.
:func:`check_engine_args` takes the whole recipe, typed ``Any``: engines/ imports nothing of the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Problem = tuple[str, object, str]


@dataclass
class EngineConfig:
    """The inference servers' own settings."""

    # extra sglang.launch_server arguments (e.g. ["--attention-backend", "fa3", "--mem-fraction-static", "0.8"]);
    # the ones relax_hpc sets itself are refused (ENGINE_ARGS_SET below); the CPU engine has none to take
    args: list[str] = field(default_factory=list)
    max_restarts: int = 2  # an engine found dead is started again this many times (it rejoins at the next sync)
    # which server generates: "sglang" (needs RELAX_SGLANG_PYTHON and a GPU on the node), "reference" (relax_hpc's
    # own server, on the node's GPU when there is one, else its CPU), "auto": SGLang where both are there, else reference
    kind: Literal["auto", "sglang", "reference"] = "auto"
    # hand the GPU over while the actor trains (Relax --offload-rollout): the engines release their memory after
    # generating, take it back before the weight sync, and get the weights by CUDA IPC (/update_weights_from_tensor)
    # instead of a weight-sync group; null = when the engines share a GPU with the actor (a one-GPU box, share_with)
    offload: bool | None = None


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


def check_engine_args(r: Any) -> list[Problem]:
    """``rollout.engine``: its restarts, the server arguments relax_hpc sets itself, the GPU hand-over's mode."""
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
