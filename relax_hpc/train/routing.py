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
instances (which keeps every model a process ever built).

A token the engine did not route (a sample's last token, padding: -1) goes to experts 0..k-1; causal attention keeps
it from every real token's log-prob. The backward needs no indices (autograd keeps the forward's); activation
recompute of a layer reruns its router with the indices last set, the same micro-batch's without pipelining
(with ``pp`` > 1 the schedule interleaves micro-batches: refused at build).
"""

from __future__ import annotations

import torch

from relax_hpc.errors import PermanentError


def routers(chunk) -> list:
    """The ``TopKRouter`` modules of a model chunk with a replay slot (``moe_enable_routing_replay``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = chunk.__dict__.get("_replay_routers")  # found once per chunk: a forward per micro-batch asks
    if found is None:
        found = [m for m in chunk.modules() if isinstance(m, TopKRouter) and getattr(m, "router_replay", None)]
        chunk.__dict__["_replay_routers"] = found
    return found


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
        return 0
    if not found:
        return 0
    k = found[0].topk
    n, width = routed.shape
    if width % k:
        raise PermanentError(f"routed_experts: {width} expert ids per token is not a whole number of the model's "
                             f"top-{k} layers. Fix: serve the same model (num_experts_per_tok) as the actor trains")
    layers = width // k
    S = n // batch_rows
    ids = routed.reshape(batch_rows, S, layers, k).transpose(0, 1)  # Megatron's [S, B, ...] order
    cfg = found[0].config
    if cfg.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        ids = ids[rank * (S // tp): (rank + 1) * (S // tp)]
    ids = ids.reshape(-1, layers, k)
    unrouted = ids < 0
    ids = torch.where(unrouted, torch.arange(k).expand_as(ids), ids)
    dev = next(chunk.parameters()).device
    for r in found:
        layer = int(r.layer_number) - 1
        if not 0 <= layer < layers:
            raise PermanentError(f"routed_experts has {layers} layers of experts but the model's router {layer + 1} "
                                 "has none. Fix: serve the same model as the actor trains")
        r.router_replay.clear_indices()
        r.router_replay.set_target_indices(ids[:, layer].contiguous().to(dev))
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return len(found)


def topk_of(model: list) -> int | None:
    """The routers' top-k of a built model (None: no MoE routers with a replay slot)."""
    for chunk in model:
        found = routers(chunk)
        if found:
            return int(found[0].topk)
    return None
