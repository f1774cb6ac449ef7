"""The wire format of ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``: one bucket of
named tensors as one flat buffer, said in one place for the sender (:mod:`relax_hpc.weights`) and the receivers
(:mod:`relax_hpc.engines.receiver`, :func:`relax_hpc.weights.sync.receive`). Its sibling for
``/update_weights_from_tensor`` is :mod:`relax_hpc.engines.tensor_wire`.

What travels: the HTTP call announces ``names``, ``dtypes`` (torch names: ``"bfloat16"``) and ``shapes``; then one
``dist.broadcast`` carries the buffer as bytes (``uint8``), in which each tensor's bytes lie end to end in announced
order, each tensor's bytes starting where the previous one's end. That is SGLang 0.5.23's ``FlattenedTensorBucket``
(``sglang.srt.weight_sync.tensor_bucket``): its receive buffer (``FlattenedTensorBucket.empty``) is ``uint8``, every
tensor's byte offset must be a multiple of its dtype's size, and no dimension may be negative; both are refused here
too (:func:`plan`), before any byte is received.

The per-tensor :class:`TensorMeta` counts in elements of the tensor's own dtype (``start_idx``, ``end_idx``,
``numel``; the byte offset is ``start_idx × itemsize``). Only names, dtypes, shapes and the bytes go on the wire, so
this unit is ours (SGLang keeps bytes in its metadata's fields). For a bucket of one dtype, the only kind the sender
makes (:mod:`relax_hpc.weights.buckets`), the buffer is that dtype's ``torch.cat`` of the flattened tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name SGLang resolves with ``getattr(torch, name)``: ``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """The dtype a wire name (``"bfloat16"``, ``"torch.bfloat16"``) names; ValueError naming it if none."""
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {str(name)[:80]!r}: give a torch dtype name such as 'bfloat16' or 'float32'")
    return dt


class TensorMeta(NamedTuple):
    """One tensor inside a bucket: elements ``[start_idx, end_idx)`` of its own dtype from the buffer's start,
    viewed as ``shape`` (bytes ``[byte_start, byte_end)``). A named tuple: a bucket of hundreds of tensors is planned
    at both ends of every sync, and a frozen dataclass costs three times as much to make."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    @property
    def offset(self) -> int:
        return self.start_idx

    @property
    def byte_start(self) -> int:
        return self.start_idx * self.dtype.itemsize

    @property
    def byte_end(self) -> int:
        return self.end_idx * self.dtype.itemsize

    def to_json(self) -> dict:
        """SGLang's FlattenedTensorMetadata fields, with the dtype as its wire name."""
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype),
                "start_idx": self.start_idx, "end_idx": self.end_idx, "numel": self.numel}

    @classmethod
    def from_json(cls, d: dict) -> "TensorMeta":
        return cls(str(d["name"]), tuple(int(s) for s in d["shape"]), dtype_from_name(d["dtype"]),
                   int(d["start_idx"]), int(d["end_idx"]), int(d["numel"]))


def plan(metas: Iterable[tuple[str, torch.Size | Sequence[int], torch.dtype]]) -> list[TensorMeta]:
    """The layout of one bucket holding these (name, shape, dtype) in order: each tensor's bytes where the previous
    one's end. ValueError (as SGLang's receive buffer refuses them) for a negative dimension or a tensor whose byte
    offset is not a multiple of its dtype's size."""
    out, off = [], 0  # off: bytes
    for name, shape, dtype in metas:
        shape = tuple(map(int, shape))
        if shape and min(shape) < 0:
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {list(shape)}")
        size = dtype.itemsize
        if off % size:
            raise ValueError(f"tensor {name!r} ({dtype_name(dtype)}) would start at byte {off}, not a multiple of "
                             f"{size}: SGLang refuses such a bucket. Fix: order the tensors so that each starts "
                             "aligned (e.g. larger dtypes first), or send one dtype per bucket")
        n = 1
        for s in shape:
            n *= s
        start = off // size
        out.append(TensorMeta(str(name), shape, dtype, start, start + n, n))
        off += n * size
    return out


def announced(names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]
              ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The (name, shape, dtype) of each tensor ``/update_weights_from_distributed`` announces, what a receiver knows
    before the broadcast (:func:`plan` gives a flattened bucket's layout of them). ValueError naming the problem:
    lists empty or of different lengths, an unknown dtype name, a negative dimension."""
    names, dtypes, shapes = list(names or []), list(dtypes or []), list(shapes or [])
    if not names or not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must be non-empty and equally long "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    out = []
    for n, d, s in zip(names, dtypes, shapes):
        shape = tuple(int(x) for x in s)
        if any(x < 0 for x in shape):
            raise ValueError(f"tensor {str(n)!r} has a negative dimension in shape {list(shape)}")
        out.append((str(n), shape, dtype_from_name(d)))
    return out


def nbytes(metadata: Sequence[TensorMeta]) -> int:
    """The buffer's length in bytes (what one broadcast carries)."""
    return max((m.byte_end for m in metadata), default=0)


def as_bytes(flat: torch.Tensor) -> torch.Tensor:
    """What one broadcast carries of a flat buffer, at both ends: its bytes (SGLang 0.5.23 receives into ``uint8``;
    both ends must broadcast the same dtype)."""
    return flat.view(torch.uint8)


def empty_flat(metadata: Sequence[TensorMeta], device: torch.device | str | None = None) -> torch.Tensor:
    """The receiving side's buffer for ``metadata``: of the bucket's dtype when it has one, else ``uint8``; receive
    into :func:`as_bytes` of it."""
    if not metadata:
        raise ValueError("an empty bucket has no buffer: announce at least one tensor")
    dtypes = {m.dtype for m in metadata}
    dt = dtypes.pop() if len(dtypes) == 1 else torch.uint8
    return torch.empty(nbytes(metadata) // dt.itemsize, dtype=dt, device=device)


def unpack(flat: torch.Tensor, metadata: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Cut ``flat`` (1-D, contiguous, any dtype: its bytes are read) back into (name, tensor) views, as SGLang's
    ``FlattenedTensorBucket.reconstruct_tensors`` does."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"a flat bucket is a contiguous 1-D tensor, got shape {tuple(flat.shape)} stride "
                         f"{tuple(flat.stride())}")
    raw = as_bytes(flat)
    total = nbytes(metadata)
    if total > raw.numel():
        raise ValueError(f"bucket metadata needs {total} bytes, the buffer has {raw.numel()}")
    dtypes = {m.dtype for m in metadata}
    dt = next(iter(dtypes)) if len(dtypes) == 1 else None
    if dt is not None and raw.storage_offset() % dt.itemsize == 0:  # the sender's kind: one op a tensor, not three
        typed = raw[:total].view(dt)
        base = typed.storage_offset()
        return [(m.name, typed.as_strided(m.shape, _strides(m.shape), base + m.start_idx)) for m in metadata]
    return [(m.name, raw[m.byte_start:m.byte_end].view(m.dtype).view(m.shape)) for m in metadata]


@functools.lru_cache(maxsize=4096)  # a model's few distinct shapes, at every sync
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides for ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def pack(named: Sequence[tuple[str, torch.Tensor]], *, out: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, list[TensorMeta]]:
    """The flat buffer and layout of ``named`` (one device). One dtype: a buffer of that dtype (a single contiguous
    tensor is viewed, never copied); several: a ``uint8`` buffer. ``out``: a 1-D buffer of that dtype with at least
    the elements needed to pack into (reused between pushes to skip an allocation); the result is a view of its
    first elements."""
    if not named:
        raise ValueError("cannot pack an empty bucket")
    meta = plan((n, tuple(t.shape), t.dtype) for n, t in named)
    dtypes = {m.dtype for m in meta}
    dt = dtypes.pop() if len(dtypes) == 1 else torch.uint8
    total = nbytes(meta) // dt.itemsize
    if out is None and len(named) == 1 and named[0][1].is_contiguous():
        return named[0][1].detach().reshape(-1), meta
    if out is None:
        out = torch.empty(total, dtype=dt, device=named[0][1].device)
    elif out.dim() != 1 or out.numel() < total or out.dtype != dt:
        raise ValueError(f"out must be 1-D {dt} with ≥ {total} elements, got {out.dtype} {tuple(out.shape)}")
    flat = out[:total]
    parts = [t.detach().reshape(-1) for _, t in named]
    if dt == torch.uint8:
        parts = [as_bytes(p) for p in parts]
    with torch.no_grad():  # one C++ call for the whole bucket (a per-tensor copy_ loop costs ~2× here)
        torch.cat(parts, out=flat)
    return flat, meta
