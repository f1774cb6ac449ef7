"""The forward-only worker shared by the ``reference`` and ``actor_fwd`` roles.

Both roles hold the same Megatron model as the actor (built from ``model.path`` over the role's own group
with ``train.tp``/``train.pp``) but never train it: ``forward_only`` gives bare chunks without DDP or an
optimizer (no gradient buffers, no optimizer state: a fraction of the actor's memory), and the only thing
they do is a forward pass that turns response tokens into per-token log-probs, which rank 0 adds to the
exchange as a side file of each chunk (:func:`relax_hpc.exchange.chunk.write_fields`). The reference keeps
its initial weights (π_ref, ``ref_log_probs``); actor_fwd follows the actor (π_old, ``log_probs``). There is
one weight source, the actor's checkpoints (``load``): no second path to keep in step with training.

Tasks (:mod:`relax_hpc.roles.tasks`; their fields and results: :mod:`relax_hpc.controller.messages`):

- ``logprobs {chunks: [ChunkRef dicts], field?}``: every rank reads the samples (checksums verified) and
  runs the forward (a collective); rank 0 writes ``field`` (default: the role's) for each chunk that lacks
  it (a chunk that has it already returns its existing side). Returns ``{"sides": [SideRef dicts], "metrics":
  {"perf/<role>_time": s}}`` on rank 0.
- ``load {path}``: a checkpoint root (with ``latest``) or step dir (with ``meta.json``), model weights only.
  Returns ``{"step": the checkpoint's step}``.
- ``stop``.

Without ``model.path`` the role only bootstraps (the launch smoke tests).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from relax_hpc.roles.runtime import RoleContext

if TYPE_CHECKING:
    from relax_hpc.exchange.chunk import ChunkRef

def compute_and_write(actor: Any, refs: Sequence[dict | ChunkRef], field: str, writer: str, rank: int) -> list[dict]:
    """Log-probs of every response token of these chunks as side field ``field`` (ragged float32).

    Collective (every rank calls it with the same refs); rank 0 writes the side files and returns their
    :class:`~relax_hpc.exchange.chunk.SideRef` dicts in the order of ``refs``, the other ranks ``[]``."""
    import numpy as np  # here, not at the top: a role imports numpy, h5py and torch after its hello

    from relax_hpc.exchange.chunk import write_fields
    from relax_hpc.roles.samples import LOGPROB_FIELDS, as_ref, logprob_batch, read_columns

    chunks = [as_ref(r) for r in refs]
    todo = [c for c in chunks if field not in c.all_fields]
    batch = logprob_batch(read_columns(todo, LOGPROB_FIELDS, agree=True)) if todo else []
    lps = actor.compute_log_probs(batch) if batch else []
    if rank != 0:
        return []
    sides, pos = {}, 0
    for c in todo:
        arrays = [lp.detach().cpu().numpy().astype(np.float32) for lp in lps[pos: pos + c.n]]
        pos += c.n
        sides[c.id] = write_fields(c, writer, {field: arrays}).to_dict()
    for c in chunks:  # chunks that had the field already: their existing side
        if c.id not in sides:
            sides[c.id] = next(s.to_dict() for s in c.sides if field in s.fields)
    return [sides[c.id] for c in chunks]


def load_weights(actor: Any, path: str) -> int:
    """Collective: the model weights of a Megatron checkpoint (root with ``latest`` or a step dir); its step."""
    p = Path(path)
    if not ((p / "latest").exists() or (p / "meta.json").exists()):
        raise ValueError(f"{path} is not a Megatron checkpoint (no 'latest' or 'meta.json' in it)")
    actor.load_checkpoint(p, load_optimizer=False)
    return actor.step


def work_forward(ctx: RoleContext, comm: Any, field: str) -> None:
    """The role's work: build the model, then serve ``logprobs``/``load``/``stop`` until ``stop``."""
    if ctx.recipe.model.path is None:
        return
    from relax_hpc.controller import messages as M
    from relax_hpc.roles.model import build_megatron, resolve
    from relax_hpc.roles.tasks import serve
    from relax_hpc.train.logprobs import set_progress_hook

    role, rank = ctx.ident.role, ctx.ident.rank
    actor = build_megatron(ctx.recipe, role, forward_only=True)
    set_progress_hook(ctx.progress)
    ctx.report("ready", model=resolve(ctx.recipe.model.path))

    def logprobs(task: M.LogprobsTask) -> M.LogprobsResult:
        t0 = time.monotonic()
        sides = compute_and_write(actor, task.chunks, task.field or field, role, rank)
        if rank != 0:
            return M.LogprobsResult()
        return M.LogprobsResult(sides=sides, metrics={f"perf/{role}_time": time.monotonic() - t0})

    def load(task: M.LoadTask) -> M.LoadResult:
        return M.LoadResult(step=load_weights(actor, task.path))

    serve(ctx, comm, {"logprobs": logprobs, "load": load, "stop": lambda task: M.StopResult()})
