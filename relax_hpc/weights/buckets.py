"""Pack (name, tensor) pairs into flat buckets, the unit of one weight-sync broadcast, and unpack them.

A :class:`Bucket` is SGLang's ``"flattened_bucket"``: the tensors flattened and laid end to end in one contiguous 1-D
buffer, plus per tensor ``name, shape, dtype, start_idx, end_idx, numel``. The layout, the metadata and the dtype
names are the wire format's, :mod:`relax_hpc.engines.bucket_wire` (the one place both ends read them); this module
decides what goes into which bucket. The engine learns the names/dtypes/shapes from
``/update_weights_from_distributed``, allocates the buffer, receives it with one ``dist.broadcast`` and cuts it back
into views.

Every bucket holds **one dtype**: then SGLang 0.5.23's byte layout and older releases' ``torch.cat`` of the
flattened tensors (whose dtype is torch's promotion of the listed ones) are the same bytes, no bf16 weight travels
as fp32 (twice the bytes), no integer buffer is cast to float, and a bucket packs into a typed reusable buffer.
Tensors are taken in iteration order and appended to the open bucket of their dtype; a bucket is emitted when the
next tensor would push it over ``bucket_bytes``. A tensor larger than ``bucket_bytes`` goes alone in its own bucket
(no copy when it is already contiguous). At most one bucket per dtype is open at a time, so the memory held is about
``bucket_bytes × number of dtypes`` plus the bucket being sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from relax_hpc.engines import bucket_wire
# the wire format (layout, metadata, dtype names) is bucket_wire's; these names stay importable from here
from relax_hpc.engines.bucket_wire import TensorMeta, dtype_from_name, dtype_name, empty_flat, plan, unpack

__all__ = ["DEFAULT_BUCKET_BYTES", "IN_PLACE_MIN_BYTES", "MiB", "Bucket", "BufferRing", "PackedBuckets", "TensorMeta",
           "dtype_from_name",
           "dtype_name", "empty_flat", "iter_buckets", "pack", "plan", "unpack"]

MiB = 1 << 20
DEFAULT_BUCKET_BYTES = 512 * MiB  # Relax's --update-weight-buffer-size default


@dataclass
class Bucket:
    """A flat contiguous 1-D buffer of one dtype and the metadata to cut it back into named tensors."""

    flat: torch.Tensor
    metadata: list[TensorMeta]
    in_place: bool = False  # flat is the memory the tensors occupy in the sender's model (no copy was made)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]

    @property
    def dtypes(self) -> list[str]:
        """Wire names, as ``/update_weights_from_distributed`` takes them."""
        return [dtype_name(m.dtype) for m in self.metadata]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(m.shape) for m in self.metadata]

    def __len__(self) -> int:
        return len(self.metadata)

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, views of :attr:`flat`."""
        return unpack(self.flat, self.metadata)


class PackedBuckets(list):
    """Buckets cut and packed ahead (``relax_hpc.weights.push.Snapshot``'s): a sender takes them as they are, one
    broadcast each, without walking their tensors again (:func:`relax_hpc.weights.sync.send_buckets`)."""


def pack(named: list[tuple[str, torch.Tensor]], *, out: torch.Tensor | None = None) -> Bucket:
    """One bucket of ``named`` (all of one dtype, one device): :func:`relax_hpc.engines.bucket_wire.pack`, kept to
    one dtype (module docstring). ``out``: a 1-D buffer of that dtype with at least the total number of elements to
    pack into; the bucket's ``flat`` is then a view of its first elements. A single contiguous tensor is viewed."""
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) > 1:
        raise ValueError(f"a bucket holds one dtype, got {sorted(map(str, dtypes))}")
    return Bucket(*bucket_wire.pack(named, out=out))


class BufferRing:
    """Reusable pack buffers: ``n`` byte buffers handed out in turn, each viewed as the dtype of the bucket
    packed into it, grown when a bucket needs more. A bucket packed into buffer *i* stays valid until ``n``
    more buckets are packed: with ``n = 2`` one bucket can be on the wire while the next is packed.

    Why: fresh allocations of hundreds of MB per weight sync cost page faults (on some VMs as much as the
    copy itself). On GPU the CUDA caching allocator already reuses memory; there it is not needed."""

    def __init__(self, n: int = 2, device: torch.device | str | None = None):
        self.n = n
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None] * n
        self.i = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        i, self.i = self.i, (self.i + 1) % self.n
        b = self.bufs[i]
        if b is None or b.numel() < nbytes:
            self.bufs[i] = b = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return b[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs if b is not None)


IN_PLACE_MIN_BYTES = 4 * MiB  # below this a run goes through a pack copy: one broadcast (and one announce) fewer


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, ring: BufferRing | None = None,
                 in_place: Callable[[torch.Tensor], bool] | None = None,
                 in_place_min: int = IN_PLACE_MIN_BYTES) -> Iterator[Bucket]:
    """Group a stream of (name, tensor) into buckets of at most ``bucket_bytes`` each, one dtype per bucket.

    Streaming: a bucket is packed and yielded as soon as it is full, so the whole model is never held at
    once (the actor's gather yields tensors one by one). Order: tensors keep their relative order within a
    dtype; buckets come out when they fill, the rest at the end in order of each dtype's first tensor.
    Names must be unique. ``ring``: pack into its reusable buffers (see :class:`BufferRing` for how long a
    bucket then stays valid); a lone contiguous tensor is never copied either way.

    ``in_place(t)`` True: ``t`` is a view into memory that stays put for the whole send (the actor's
    parameters sit in Megatron's DDP param buffer, and the bridge exports most of them as views of it). Such
    tensors are not packed: they are held (no memory: views) to the end of the stream, sorted by address, and
    every run of them that lies end to end in one buffer, of ``in_place_min`` bytes or more, is sent as it lies,
    a bucket that is a view of that memory (cut at ``bucket_bytes``), its tensors announced in address order.
    Shorter runs are packed with the rest.
    """

    def emit(items):
        if ring is None or (len(items) == 1 and items[0][1].is_contiguous()):
            return pack(items)
        return pack(items, out=ring.take(sum(t.numel() for _, t in items), items[0][1].dtype))

    def add(name, t):
        nb = t.numel() * t.element_size()
        if nb > bucket_bytes:  # alone, and without disturbing the open bucket of its dtype
            yield emit([(name, t)])
            return
        d = t.dtype
        if d in open_ and size[d] + nb > bucket_bytes:
            yield emit(open_.pop(d))
            del size[d]
        open_.setdefault(d, []).append((name, t))
        size[d] = size.get(d, 0) + nb

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    size: dict[torch.dtype, int] = {}
    seen: set[str] = set()
    held: list[tuple[str, torch.Tensor]] = []
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if in_place is not None and t.is_contiguous() and t.numel() and in_place(t):
            held.append((name, t))
        else:
            yield from add(name, t)
    for run in _runs(held, bucket_bytes):
        if sum(t.numel() * t.element_size() for _, t in run) >= in_place_min:
            yield _view_bucket(run)
        else:
            for name, t in run:
                yield from add(name, t)
    for d in list(open_):
        yield emit(open_.pop(d))


def _runs(held: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The held tensors as runs that lie end to end in one buffer (same storage, dtype and device), in address
    order, each at most ``bucket_bytes`` (or one tensor)."""
    by_buf: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t in held:
        by_buf.setdefault((t.untyped_storage().data_ptr(), t.dtype, t.device), []).append((name, t))
    for items in by_buf.values():
        items.sort(key=lambda nt: nt[1].data_ptr())
        run: list[tuple[str, torch.Tensor]] = []
        end = nbytes = 0
        for name, t in items:
            nb = t.numel() * t.element_size()
            if run and (t.data_ptr() != end or nbytes + nb > bucket_bytes):  # a gap (or an overlap), or full
                yield run
                run, nbytes = [], 0
            run.append((name, t))
            end, nbytes = t.data_ptr() + nb, nbytes + nb
        if run:
            yield run


def _view_bucket(run: list[tuple[str, torch.Tensor]]) -> Bucket:
    """A bucket whose flat buffer is the memory the run's tensors already occupy: no copy."""
    meta = plan((n, tuple(t.shape), t.dtype) for n, t in run)
    first = run[0][1]  # the run lies end to end, as the wire's layout does: its memory is the flat buffer
    flat = first.detach().as_strided((bucket_wire.nbytes(meta) // first.element_size(),), (1,))
    return Bucket(flat, meta, in_place=True)
