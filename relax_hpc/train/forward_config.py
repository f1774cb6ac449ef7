"""The recipe's ``forward:`` section: the forward-only roles' own parallel layout and token budget.

The reference and actor_fwd roles hold the actor's model but only run forward passes (no gradients, no optimizer
state), so they fit on fewer GPUs than the actor and take bigger micro-batches. Relax says so with
``--ref-actor-config '{"tensor_model_parallel_size": 1, "max_tokens_per_gpu": 9216, "sequence_parallel": false}'``;
here it is ``forward: {tp: 1, max_tokens_per_micro_batch: 9216, sequence_parallel: false}``. A key left out is the
actor's (``train.*``). Both forward roles build their model with :func:`forward_train`
(:func:`relax_hpc.train.build.build_megatron`); the checkpoints they load reshard to any TP/PP.

Pure Python, as :mod:`relax_hpc.train.config` (the validator imports it on the login node).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from relax_hpc.train.config import TrainConfig

FORWARD_ROLES = ("reference", "actor_fwd")


@dataclass
class ForwardConfig:
    tp: int | None = None  # tensor-parallel size of reference and actor_fwd; None: train.tp
    pp: int | None = None  # pipeline-parallel size; None: train.pp
    sequence_parallel: bool | None = None  # None: train.sequence_parallel where the forward TP > 1, else off
    # tokens per packed forward micro-batch; None: the actor's log-prob budget (train.logprob_max_tokens_per_micro_batch,
    # else train.max_tokens_per_micro_batch)
    max_tokens_per_micro_batch: int | None = None


def forward_train(train: TrainConfig, fwd: ForwardConfig | None) -> TrainConfig:
    """The ``train`` config the forward roles build and run with: ``train`` with ``forward``'s keys over it."""
    if fwd is None:
        return train
    tp = train.tp if fwd.tp is None else fwd.tp
    sp = fwd.sequence_parallel if fwd.sequence_parallel is not None else (train.sequence_parallel and tp > 1)
    budget = fwd.max_tokens_per_micro_batch or train.logprob_max_tokens_per_micro_batch
    return dataclasses.replace(train, tp=tp, pp=train.pp if fwd.pp is None else fwd.pp, sequence_parallel=sp,
                               logprob_max_tokens_per_micro_batch=budget)


def role_train(recipe: Any, role: str) -> TrainConfig:
    """The ``train`` config role ``role`` builds its model with: the forward roles' :func:`forward_train`, the
    actor's ``train``."""
    return forward_train(recipe.train, recipe.forward) if role in FORWARD_ROLES else recipe.train


def check(recipe: Any) -> list[tuple[str, object, str]]:
    """(key, value, "problem. Fix: ...") for the forward roles' layout, as ``train.*`` is checked for the actor's: the
    ``forward`` keys themselves, and the effective TP × PP against each enabled forward role's ranks (from
    ``train`` when ``forward`` does not say; a layout that does not divide them fails at build otherwise)."""
    fwd, tr = recipe.forward, recipe.train
    out: list[tuple[str, object, str]] = []
    on = [r for r in FORWARD_ROLES if recipe.role(r).enabled]
    if fwd is not None:
        if not on:
            out.append(("forward", {k: v for k, v in dataclasses.asdict(fwd).items() if v is not None},
                        "sets the layout of roles.reference and roles.actor_fwd, and both are "
                        "disabled: it would change nothing. Fix: remove forward, or enable a forward role"))
        for key in ("tp", "pp", "max_tokens_per_micro_batch"):
            v = getattr(fwd, key)
            if v is not None and v < 1:
                out.append((f"forward.{key}", v, "must be at least 1, or null for the actor's (train.*). Fix: e.g. 1"))
        if fwd.max_tokens_per_micro_batch is not None and 1 <= fwd.max_tokens_per_micro_batch < tr.max_seq_len:
            out.append(("forward.max_tokens_per_micro_batch", fwd.max_tokens_per_micro_batch,
                        f"is below train.max_seq_len = {tr.max_seq_len}: the longest sample accepted must fit in one "
                        "micro-batch. Fix: at least max_seq_len tokens, or null for the actor's budget"))
        if out:
            return out
    eff = forward_train(tr, fwd)
    if fwd is None:  # the actor's own layout: train's checks said what there is to say about it
        pass
    elif eff.sequence_parallel and eff.tp == 1:
        out.append(("forward.sequence_parallel", True, "needs tensor parallelism, and the forward roles' TP is 1 "
                    "(forward.tp). Fix: forward.sequence_parallel: false, or forward.tp >= 2"))
    elif not eff.sequence_parallel and eff.tp > 1 and eff.ep > 1:
        out.append(("forward.sequence_parallel", False, f"must be on with both tensor and expert parallelism (TP "
                    f"{eff.tp}, train.ep = {eff.ep}): Megatron's MoE layers require it. Fix: true, or forward.tp: 1"))
    mp = eff.tp * eff.pp
    key = "forward.tp" if fwd is not None and (fwd.tp is not None or fwd.pp is not None) else "train.tp"
    for role in on:
        g = recipe.role(role)
        world = g.nodes * g.tasks_per_node
        if world % mp:
            out.append((key, eff.tp, f"TP × PP = {eff.tp} × {eff.pp} does not divide roles.{role}'s {world} ranks "
                        f"(nodes × tasks_per_node), which build their model with it. Fix: set forward.tp / forward.pp "
                        f"(the forward roles' own layout), or change roles.{role}'s size"))
        elif (world // mp) % max(1, eff.ep):
            out.append(("train.ep", eff.ep, f"does not divide roles.{role}'s data-parallel size {world // mp}. Fix: "
                        f"a forward layout (forward.tp / forward.pp) that leaves a multiple of {eff.ep}"))
    return out
