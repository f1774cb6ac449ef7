"""MoE routing replay (``train.routing_replay``, Relax's ``--use-rollout-routing-replay``, R3): the trainer's forward
routes each token to the experts the engine's router chose for it while sampling, so the trainer scores the tokens
with the expert mix that produced them.

megatron-core 0.16.1 has the mechanism (``moe_enable_routing_replay``: each ``TopKRouter`` gets a
``RouterReplay``; with action ``REPLAY_FORWARD`` its top-k is the given indices, and the probabilities are the
router's own scores gathered there, then the usual softmax over the k: gradients reach the router as without
replay). This module feeds it: :func:`replay` before each micro-batch's forward gives every router on this rank its
layer's indices from :attr:`~relax_hpc.train.batch.MicroBatch.routed_experts`, in Megatron's token order (sequence
major: ``[S, B]`` flattened; with sequence parallelism this TP rank's slice of the sequence), or turns replay off
for a micro-batch without them. Routers are found on the model chunk, not through megatron's class-wide list of
instances (which keeps every model a process ever built). The ids are checked against the built model first
(:func:`check`: its layers × top-k a token, ids below its number of experts, a token's top-k distinct): the
trainer's last line behind the rollout's check of each engine answer.

A token with no recorded routing (a -1 row: a sample's last token, padding, a token no engine ran, such as an
observation appended after the last engine call or a whole sample that failed before any generation) is routed by
the trainer's own router, its top-k of its scores, as without replay: megatron-core's ``RouterReplay`` would gather
at index -1, so each router's replay gets :func:`_replay_topk`, which takes the router's choice on those rows (the
replay's other rows are as megatron-core gives them). The backward needs no indices (autograd keeps the forward's);
activation recompute of a layer reruns its router with the indices last set, the same micro-batch's without
pipelining (with ``pp`` > 1 the schedule interleaves micro-batches: refused at build), and its own top-k of the
same scores on the -1 rows.
"""

from __future__ import annotations

import functools

import torch

from relax_hpc.errors import PermanentError
from relax_hpc.exchange.fields import Routing, routed_experts_problem


def routers(chunk) -> list:
    """The ``TopKRouter`` modules of a model chunk with a replay slot (``moe_enable_routing_replay``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = chunk.__dict__.get("_replay_routers")  # found once per chunk: a forward per micro-batch asks
    if found is None:
        found = [m for m in chunk.modules() if isinstance(m, TopKRouter) and getattr(m, "router_replay", None)]
        for r in found:  # -1 rows: the router's own choice (an instance attribute: megatron calls it on the instance)
            rr = r.router_replay
            rr.unrouted = None
            rr.get_replay_topk = functools.partial(_replay_topk, rr, type(rr).get_replay_topk.__get__(rr))
        chunk.__dict__["_replay_routers"] = found
    return found


def _replay_topk(rr, replay_topk, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                 default_compute_topk=None):
    """``RouterReplay.get_replay_topk`` (``replay_topk``, bound to ``rr``) with -1 rows honoured: in
    ``REPLAY_FORWARD``, the tokens of ``rr.unrouted`` (``[tokens, 1]`` bool, set by :func:`replay`; None: every
    token has its ids) take the router's own top-k of ``scores``, the others the replayed ids; probabilities are
    the scores gathered at the ids either way (what ``torch.topk`` gives for the router's own)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if rr.router_replay_action != RouterReplayAction.REPLAY_FORWARD or rr.unrouted is None:
        return replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    ids = torch.where(rr.unrouted.to(scores.device), own, rr.target_topk_idx.to(scores.device))
    return scores.gather(1, ids), ids


def forget_instances() -> None:
    """Empty megatron-core's class-wide list of replay instances (each built model adds its routers; the routers
    keep their own): a process that builds several models does not keep the old ones alive through it."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def replay(chunk, routed: torch.Tensor | None, batch_rows: int) -> int:
    """Set (``routed`` given: ``[B·S, layers × k]`` in row-major ``[B, S]`` token order, -1 where unrouted) or
    clear (None) the replayed routing of every router of ``chunk``; returns how many routers replay."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    found = routers(chunk)
    if routed is None:
        for r in found:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()
            r.router_replay.unrouted = None
        return 0
    if not found:
        return 0
    k = found[0].topk
    cfg = found[0].config
    check(routed, Routing(int(cfg.num_layers), int(k), int(cfg.num_moe_experts)))
    n, width = routed.shape
    layers = width // k
    S = n // batch_rows
    ids = routed.reshape(batch_rows, S, layers, k).transpose(0, 1)  # Megatron's [S, B, ...] order
    if cfg.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        ids = ids[rank * (S // tp): (rank + 1) * (S // tp)]
    ids = ids.reshape(-1, layers, k)
    unrouted = (ids < 0).any(-1, keepdim=True)  # [tokens, layers, 1]: a row is the engine's whole top-k, or none
    some = unrouted.any(0).reshape(-1).tolist()  # per layer, on the host: a layer without -1 rows gathers only
    ids = ids.clamp(min=0)  # the -1 rows' ids are never used (their router's own are)
    dev = next(chunk.parameters()).device
    for r in found:
        layer = int(r.layer_number) - 1  # global: check() made layers the model's num_layers
        rr = r.router_replay
        rr.clear_indices()
        rr.set_target_indices(ids[:, layer].contiguous().to(dev))
        rr.unrouted = unrouted[:, layer].contiguous().to(dev) if some[layer] else None
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return len(found)


def check(routed: torch.Tensor, routing: Routing) -> None:
    """The trainer's own check of a micro-batch's ids (``[tokens, width]``, -1 rows: tokens no engine ran, padding)
    against the model it builds: ``layers × top_k`` a token, ids in ``[0, num_experts)``, a token's top-k distinct
    per layer (:func:`~relax_hpc.exchange.fields.routed_experts_problem`). The rollout refuses such an engine's
    answer and the trainer's door (:func:`relax_hpc.train.plan.check_train_columns`) such rows; this catches what
    neither could know, e.g. ids that fit the engine's model but not this one, before an index out of range
    (a device-side assert on CUDA) or a silently wrong mixture."""
    problem = routed_experts_problem(routed.cpu().numpy(), int(routed.shape[0]), routing, unrouted=True)
    if problem is not None:
        raise PermanentError(
            f"routed_experts (train.routing_replay) do not fit the model the actor trains ({routing.layers} layers, "
            f"top-{routing.top_k} of {routing.num_experts} experts): {problem}. Fix: serve the same model on the "
            "engines as the actor trains (num_hidden_layers, num_experts_per_tok, num_experts), or "
            "train.routing_replay: false")


def topk_of(model: list) -> int | None:
    """The routers' top-k of a built model (None: no MoE routers with a replay slot)."""
    for chunk in model:
        found = routers(chunk)
        if found:
            return int(found[0].topk)
    return None
