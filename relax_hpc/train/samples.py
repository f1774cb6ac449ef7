"""Chunk files → columns: the trainer's side of the exchange.

The rollout role writes one step's samples as one chunk (:mod:`relax_hpc.exchange.chunk`) in
``RUN_DIR/exchange/step_<N>/`` (:func:`relax_hpc.rollout.write.write_step`, beside the producer); the chunk's ref
(path, checksum, size, ...) travels to the actor in its ``train`` task through the controller, and the trainer's roles read it back, checksum verified, as
columns (:func:`read_columns`: one numpy array per field, views into the verified bytes), which the data plan
(:mod:`relax_hpc.train.plan`) turns into the actor's batch. Which fields make the trip, their dtypes and who
writes them is :mod:`relax_hpc.exchange.fields`; this module only reads.

Representations of one sample on the way to the loss: the engine's response → :class:`Sample` → columns
(one numpy array per field) → the HDF5 chunk → flat columns read back → per-sample tensors of this DP rank's
share only (:class:`~relax_hpc.train.batch.TrainingSample`, views again, no copies) → the padded micro-batch of
:mod:`relax_hpc.train.batch`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from relax_hpc.exchange.chunk import ChunkRef, DamagedChunk, Ragged, columns_to_samples, read_chunk
from relax_hpc.exchange.fields import TRAIN_FIELDS

__all__ = ["as_ref", "read_columns", "read_samples"]


def as_ref(r: dict | ChunkRef) -> ChunkRef:
    """A chunk ref as tasks carry it (a dict) or already decoded."""
    return r if isinstance(r, ChunkRef) else ChunkRef.from_dict(r)


def read_columns(refs: Sequence[dict | ChunkRef], fields: Sequence[str] = TRAIN_FIELDS, *,
                 agree: bool = False) -> dict[str, Any]:
    """The ``fields`` of these chunks (samples in order) as columns: ``fixed`` → ndarray, ``ragged`` → one
    flat :class:`Ragged`, ``json`` → list. Raises DamagedChunk on a bad file.

    ``agree``: a collective of the role's ranks (each reads the same chunks): if any rank could not read, every
    rank raises DamagedChunk, so none goes on into a collective that the others never join."""
    parts: list[dict[str, Any]] = []
    damage = None
    try:
        parts = [read_chunk(as_ref(r), list(fields), ragged="flat") for r in refs]
    except DamagedChunk as e:
        damage = e
    if agree and _any_rank(damage is not None) and damage is None:
        path = as_ref(refs[0]).path if refs else "?"
        damage = DamagedChunk(path, "another rank of this role could not read this task's chunks")
    if damage is not None:
        raise damage
    return {name: _concat([p[name] for p in parts]) for name in fields}


def _concat(cols: list) -> Any:
    if len(cols) == 1:
        return cols[0]
    if cols and isinstance(cols[0], Ragged):
        lengths = np.concatenate([c.lengths() for c in cols])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Ragged(np.concatenate([c.data for c in cols]), offsets)
    if cols and isinstance(cols[0], np.ndarray):
        return np.concatenate(cols)
    return [v for c in cols for v in c]


def read_samples(refs: Sequence[dict | ChunkRef], fields: Sequence[str] = TRAIN_FIELDS, *,
                 agree: bool = False) -> list[dict[str, Any]]:
    """The samples of these chunks (in order) as dicts of ``fields``, for readers that walk samples one by
    one (the forward roles, people); the actor reads columns (:func:`read_train_batch`)."""
    cols = read_columns(refs, fields, agree=agree)
    return columns_to_samples({k: v.to_list() if isinstance(v, Ragged) else v for k, v in cols.items()})


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the role's process group (just ``flag`` without one)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


