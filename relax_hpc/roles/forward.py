"""The forward-only worker shared by the ``reference`` and ``actor_fwd`` roles.

Both roles hold the same Megatron model as the actor (built from ``model.path`` over the role's own group
with ``train.tp``/``train.pp``, or the recipe's ``forward:`` layout and token budget where it sets them:
:mod:`relax_hpc.train.forward_config`) but never train it: ``forward_only`` gives bare chunks without DDP or an
optimizer (no gradient buffers, no optimizer state: a fraction of the actor's memory), and the only thing
they do is a forward pass that turns response tokens into per-token log-probs, which rank 0 adds to the
exchange as a side file of each chunk (:func:`relax_hpc.exchange.chunk.write_fields`). The reference keeps
its initial weights (π_ref, ``ref_log_probs``), refreshed from the actor's checkpoints (``load``) with
``algorithm.ref_update_interval``. actor_fwd follows the actor (π_old, ``log_probs``) through the weight-sync group,
like an engine (:mod:`relax_hpc.weights.follower`): every sync stages the new weights on its rank 0, and a
``logprobs`` task names the version to compute with; a resume starts it from the checkpoint (``load``).

Tasks (:mod:`relax_hpc.roles.tasks`; their fields and results: :mod:`relax_hpc.controller.messages`):

- ``logprobs {chunks: [ChunkRef], field?}``: every rank reads the samples (checksums verified) and
  runs the forward (a collective); rank 0 writes ``field`` (default: the role's) for each chunk that lacks
  it (a chunk that has it already returns its existing side). Returns ``{"sides": [SideRef], "metrics":
  {"perf/<field>_time": s}}`` on rank 0: Relax's timer names, ``perf/ref_log_probs_time`` (reference) and
  ``perf/log_probs_time`` (actor_fwd). With ``version`` (actor_fwd), the staged weights of that version are
  copied into the model first, once per version (every rank takes part; rank 0 broadcasts them).
- ``follow``: rank 0 starts answering the weight sync; returns ``{"url": ...}``.
- ``load {path}``: a checkpoint root (with ``latest``) or step dir (with ``meta.json``), model weights only.
  Returns ``{"step": the checkpoint's step}``.
- ``stop``.

Without ``model.path`` the role only bootstraps (the launch smoke tests).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from relax_hpc.roles.runtime import RoleContext, resolve

if TYPE_CHECKING:
    from relax_hpc.exchange.chunk import ChunkRef, SideRef


def compute_and_write(actor: Any, refs: Sequence[dict | ChunkRef], field: str, writer: str,
                      rank: int) -> list[SideRef]:
    """Log-probs of every response token of these chunks as side field ``field`` (ragged float32).

    Collective (every rank calls it with the same refs); rank 0 writes the side files and returns their
    :class:`~relax_hpc.exchange.chunk.SideRef` in the order of ``refs``, the other ranks ``[]``."""
    import numpy as np  # here, not at the top: a role imports numpy, h5py and torch after its hello

    from relax_hpc.exchange.chunk import write_fields
    from relax_hpc.exchange.fields import LOGPROB_FIELDS, MEDIA_FIELDS
    from relax_hpc.train.plan import logprob_batch
    from relax_hpc.train.samples import as_ref, read_columns

    chunks = [as_ref(r) for r in refs]
    todo = [c for c in chunks if field not in c.all_fields]
    images = tuple(f for f in MEDIA_FIELDS if todo and all(f in c.all_fields for c in todo))  # VLM / omni chunks
    batch = logprob_batch(read_columns(todo, (*LOGPROB_FIELDS, *images), agree=True)) if todo else []
    lps = actor.compute_log_probs(batch) if batch else []
    if rank != 0:
        return []
    sides, pos = {}, 0
    for c in todo:
        arrays = [lp.detach().cpu().numpy().astype(np.float32) for lp in lps[pos: pos + c.n]]
        pos += c.n
        sides[c.id] = write_fields(c, writer, {field: arrays})
    for c in chunks:  # chunks that had the field already: their existing side
        if c.id not in sides:
            sides[c.id] = next(s for s in c.sides if field in s.fields)
    return [sides[c.id] for c in chunks]


def load_weights(actor: Any, path: str) -> int:
    """Collective: the model weights of a Megatron checkpoint (root with ``latest`` or a step dir); its step."""
    p = Path(path)
    if not ((p / "latest").exists() or (p / "meta.json").exists()):
        raise ValueError(f"{path} is not a Megatron checkpoint (no 'latest' or 'meta.json' in it)")
    actor.load_checkpoint(p, load_optimizer=False)
    return actor.step


def take_version(actor: Any, follower: Any, version: str, world: int) -> None:
    """Collective: the follower's staged weights of ``version`` into the model (rank 0 holds them, and broadcasts
    them to the other ranks of the role: the bridge wants every full tensor on every rank)."""
    import torch
    import torch.distributed as dist

    named, error = None, None
    if follower is not None:
        try:
            named = follower.take(version)
        except RuntimeError as e:
            error = str(e)
    if world > 1:
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        meta = [error if error is not None else
                [(n, tuple(t.shape), t.dtype) for n, t in named.items()] if named is not None else None]
        dist.broadcast_object_list(meta, src=0)  # rank 0's refusal too, so no rank waits in the next collective
        if isinstance(meta[0], str):
            raise RuntimeError(meta[0])
        named = {n: (named[n].to(dev) if named is not None else torch.empty(shape, dtype=dt, device=dev))
                 for n, shape, dt in meta[0]}
        for t in named.values():
            dist.broadcast(t, src=0)
    if error is not None:
        raise RuntimeError(error)
    actor.load_hf_weights(named)


def work_forward(ctx: RoleContext, comm: Any, field: str) -> None:
    """The role's work: build the model, then serve ``logprobs``/``load``/``stop`` until ``stop``."""
    if ctx.recipe.model.path is None:
        return
    from relax_hpc.controller import messages as M
    from relax_hpc.roles.tasks import serve
    from relax_hpc.train.build import build_megatron
    from relax_hpc.train.logprobs import set_progress_hook

    role, rank = ctx.ident.role, ctx.ident.rank
    actor = build_megatron(ctx.recipe, role, resolve(ctx.recipe.model.path), forward_only=True)
    set_progress_hook(ctx.progress)
    ctx.report("ready", model=resolve(ctx.recipe.model.path))
    st: dict[str, Any] = {"follower": None, "version": "0"}  # the weights in the model: "0" is the model on disk

    def follow(task: M.FollowTask) -> M.FollowResult:
        from relax_hpc.identity import reachable_host
        from relax_hpc.weights.follower import Follower

        # staging tensors of the actor's export (names, shapes, order): a collective walk, rank 0 keeps them
        params = {n: t.detach().clone() if rank == 0 else None for n, t in actor.named_hf_weights()}
        if rank != 0:
            return M.FollowResult(url="")
        st["follower"] = Follower(params, st["version"])
        from relax_hpc.roles.engine_host import engine_listen_host

        host = engine_listen_host(ctx.ident.node == "localhost")  # where the engines listen: not every interface
        url = st["follower"].serve(host, ctx.run.api_key())
        return M.FollowResult(url=url.replace("0.0.0.0", reachable_host(ctx.ident)))

    def logprobs(task: M.LogprobsTask) -> M.LogprobsResult:
        t0 = time.monotonic()
        if task.version is not None and task.version != st["version"]:
            take_version(actor, st["follower"], task.version, comm.world)
            st["version"] = task.version
        sides = compute_and_write(actor, task.chunks, task.field or field, role, rank)
        if rank != 0:
            return M.LogprobsResult()
        return M.LogprobsResult(sides=sides, metrics={f"perf/{field}_time": time.monotonic() - t0})  # Relax's

    def load(task: M.LoadTask) -> M.LoadResult:
        step = load_weights(actor, task.path)
        st["version"] = str(step)
        return M.LoadResult(step=step)

    try:
        serve(ctx, comm, {"logprobs": logprobs, "load": load, "follow": follow, "stop": lambda task: M.StopResult()})
    finally:
        if st["follower"] is not None:
            st["follower"].close()
