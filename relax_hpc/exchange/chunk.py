"""The chunk format: the one module that knows how samples lie on disk.

A *chunk* is a group of samples one producer wrote at once, in one HDF5 file
``<exchange_root>/step_<N>/chunk_<producer>_<seq>.h5``. Fields that other roles compute later live in
*side files* beside it, ``chunk_<producer>_<seq>.<writer>.<digest8>.h5``, in the same format.

File layout (both kinds)::

    bytes [0, ub)    HDF5 user block, ours (ub: 512, or the next power of two that holds the index):
                     b"RELAXHPC-CHUNK\n" + one JSON line within the first 512 bytes
                     {"format", "v", "kind": "chunk"|"side", "checksum": "crc32c:…", "size", "n", "base"[, "ub"]},
                     then one JSON line, the index {"fields": {field: kind}, "ds": {dataset: [offset, dtype, shape]}},
                     padded with NULs. HDF5 skips the user block.
    bytes [ub, …)    the HDF5 file. "size" is the whole file's; "checksum" covers the whole file, user
                     block included, with the checksum's own hex digits read as zeros.

Inside the HDF5 file, one contiguous, uncompressed dataset per field (64-byte aligned from 64 bytes on):

- ``fixed``  — one value (scalar or fixed-shape array) per sample: a dataset ``<field>`` of shape ``(n, …)``;
- ``ragged`` — one array per sample whose first axis varies (token ids, log-probs): a dataset ``<field>`` (the
  samples' arrays concatenated along axis 0) and beside it ``<field>.offsets`` (int64, ``n + 1``; sample ``i``
  is ``<field>[offsets[i]:offsets[i+1]]``; a field name has no ``.``);
- ``json``   — one JSON value per sample (metadata dicts, strings): like ragged, the data being UTF-8 bytes.

One JSON root attribute, ``meta``, says which chunk it is (step, producer, seq, n; for a side file the chunk
id, writer and base checksum), each field's kind, and carries the producer's ``attrs``. Any HDF5 tool reads
the file; our reader does not need HDF5 (below).

Writing touches each array once, from the caller's memory: HDF5 writes only the metadata, with every dataset
allocated and never filled; the arrays go to their offsets with ``pwritev`` (a ragged column given as
per-sample arrays is not concatenated first), a block at a time, each block handed to the device at once
(``sync_file_range``) so the disk writes while the rest is copied; the checksum runs over the arrays in memory
and over the few KiB of metadata read back. Writing is crash-safe: all of it goes to a hidden temporary name
(``.<name>.<pid>.<rand>.tmp``), fsynced, then hard-linked to its final name (which fails rather than replace
an existing file) and the directory fsynced. A reader therefore sees a complete file or none; a killed
writer leaves only a hidden ``.tmp`` file (:func:`sweep_tmp` removes old ones).

Reading fills one buffer with the file, piece by piece, and checksums each piece as it lands (one pass in
all): the size and the checksum are checked against the values the caller got from the broker (its journal)
before a byte is used; any mismatch or unreadable file raises :class:`DamagedChunk`. The arrays are then views
into that buffer at the offsets of the (verified) index: no HDF5 call, no copy. A chunk from before the index is read through HDF5.
"""

from __future__ import annotations

import errno
import functools
import io
import itertools
import json
import math
import os
import re
import secrets
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import h5py
import numpy as np

from relax_hpc.exchange.refs import ChunkRef, SideRef  # noqa: F401 - the refs live beside, without h5py
from relax_hpc.rundir import fsync_dir as _fsync_dir, start_writeback

MAGIC = b"RELAXHPC-CHUNK\n"
HEADER_SIZE = 512
FORMAT = "relax_hpc.chunk"
VERSION = 1
CHECKSUM_ALGO = "crc32c"  # damage detection, not authentication (the run directory is private); see docs
MAX_ATTRS_BYTES = 64 << 10  # attrs travel in announces and journal records

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # producer, writer (no '.', which separates)
_FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_CHUNK_RE = re.compile(r"^chunk_(.+)_(\d+)\.h5$")
_NUMERIC = "biufc"


class DamagedChunk(Exception):
    """A chunk or side file that is missing, truncated, altered or not readable as a chunk."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class ChunkExists(FileExistsError):
    """The final name is taken: chunks are never replaced (pick another seq)."""


@dataclass(frozen=True)
class Ragged:
    """Per-sample arrays as flat ``data`` + ``offsets`` (n + 1 int64); what a reader may ask for to avoid splitting."""

    data: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __iter__(self):  # explicit: the __getitem__ fallback would run one past the end
        return (self[i] for i in range(len(self)))

    def to_list(self) -> list[np.ndarray]:
        return list(self)

    @classmethod
    def from_list(cls, arrays: Sequence[np.ndarray]) -> "Ragged":
        return _ragged_from(list(arrays), "<ragged>")


# ------------------------------------------------------------------------------------------ names ---


def partition_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{int(step)}"


def chunk_name(producer: str, seq: int) -> str:
    check_name(producer, "producer")
    if not isinstance(seq, (int, np.integer)) or isinstance(seq, bool) or seq < 0:
        raise ValueError(f"seq must be an int >= 0, not {seq!r}")
    return f"chunk_{producer}_{int(seq)}"


def parse_chunk_file(name: str) -> tuple[str, int] | None:
    """``chunk_<producer>_<seq>.h5`` → (producer, seq); None for anything else (side files, tmp files)."""
    m = _CHUNK_RE.match(name)
    if not m or "." in m.group(1):
        return None
    return m.group(1), int(m.group(2))


def check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{what} name {name!r}: use 1-64 of [A-Za-z0-9_-], starting with a letter or digit")


def check_field_name(name: str) -> None:
    if not isinstance(name, str) or not _FIELD_RE.match(name):
        raise ValueError(f"field name {name!r}: use [A-Za-z_][A-Za-z0-9_]* (at most 128)")


# --------------------------------------------------------------------------------------- checksum ---


_HEX_LEN = {"crc32c": 8, "crc32": 8, "sha256": 64, "blake2b": 128}
ALGOS = ", ".join(_HEX_LEN)


def digest(parts: Iterable[bytes | memoryview], algo: str = CHECKSUM_ALGO) -> str:
    """``<algo>:<hex>`` over the concatenation of ``parts``. CRC-32C (the ``crc32c`` package, SSE4.2/ARMv8 CRC
    instructions: 23 GB/s on the dev VM against zlib's CRC-32 at 4 GB/s) keeps CRC-32's guarantees: every burst
    of up to 32 bits is caught. ``crc32`` (zlib) is still read: chunks of runs from before."""
    if algo == "crc32c":
        import crc32c

        crc = 0
        for p in parts:
            crc = crc32c.crc32c(p, value=crc)
        return f"crc32c:{crc & 0xFFFFFFFF:08x}"
    if algo == "crc32":
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return f"crc32:{crc & 0xFFFFFFFF:08x}"
    if algo in ("sha256", "blake2b"):
        import hashlib

        h = hashlib.new(algo)
        for p in parts:
            h.update(p)
        return f"{algo}:{h.hexdigest()}"
    raise ValueError(f"unknown checksum algorithm {algo!r} ({ALGOS})")


def _algo_of(checksum: str) -> str:
    return checksum.split(":", 1)[0]


def _placeholder(algo: str) -> str:
    if algo not in _HEX_LEN:
        raise ValueError(f"unknown checksum algorithm {algo!r} ({ALGOS})")
    return f"{algo}:{'0' * _HEX_LEN[algo]}"


# ---------------------------------------------------------------------------------------- columns ---


def _is_scalar(v: Any) -> bool:
    if isinstance(v, (bool, int, float, complex, np.bool_, np.number)):
        return True
    return isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in _NUMERIC


def _ragged_parts(values: list, name: str) -> tuple[np.dtype, tuple[int, ...], list[np.ndarray], np.ndarray]:
    """(dtype, trailing shape, per-sample arrays, offsets) of a ragged column, nothing concatenated yet."""
    arrays = []
    for v in values:
        a = v if isinstance(v, np.ndarray) else np.asarray(v)
        if a.ndim == 0 or a.dtype.kind not in _NUMERIC:
            raise TypeError(f"field {name!r}: not an array of numbers per sample")
        arrays.append(a)
    # dtype and trailing shape from the samples that carry them (an empty Python list says nothing)
    informative = [a for v, a in zip(values, arrays) if isinstance(v, np.ndarray) or a.size] or arrays
    dtype = functools.reduce(np.promote_types, {a.dtype for a in informative})
    trail = {a.shape[1:] for a in informative}
    if len(trail) != 1:
        raise ValueError(f"field {name!r}: per-sample arrays differ beyond the first axis: {sorted(trail)}")
    (tail,) = trail
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parts = [a if a.shape[1:] == tail else a.reshape((0,) + tail) for a in arrays]  # only empties differ
    return dtype, tail, parts, offsets


def _ragged_from(values: list, name: str) -> Ragged:
    dtype, tail, parts, offsets = _ragged_parts(values, name)
    data = np.concatenate(parts, axis=0).astype(dtype, copy=False) if parts else np.zeros((0,) + tail, dtype)
    return Ragged(np.ascontiguousarray(data), offsets)


def _json_from(values: list, name: str) -> Ragged:
    try:
        blobs = [json.dumps(v, separators=(",", ":"), allow_nan=True).encode() for v in values]
    except TypeError as e:
        raise TypeError(f"field {name!r}: values are neither numbers, arrays nor JSON: {e}") from None
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return Ragged(np.frombuffer(b"".join(blobs), dtype=np.uint8), offsets)


def encode_column(name: str, values: Any) -> tuple[str, Any]:
    """(kind, payload) for one field: ``fixed`` → ndarray (n, …); ``ragged``/``json`` → :class:`Ragged`.

    The rule: an ndarray is ``fixed`` (one row per sample); a :class:`Ragged` is ``ragged``; a list whose
    items are all numbers is ``fixed``; a list whose items are all arrays (or lists of numbers) is
    ``ragged``; any other list (dicts, strings, None, mixed) is ``json``. Pass ndarrays to control dtypes.
    """
    check_field_name(name)
    if isinstance(values, Ragged):
        if values.offsets.ndim != 1 or len(values.offsets) < 1 or values.offsets[0] != 0 or values.offsets[-1] != len(values.data):
            raise ValueError(f"field {name!r}: offsets must run from 0 to len(data)")
        return "ragged", Ragged(np.ascontiguousarray(values.data), np.asarray(values.offsets, dtype=np.int64))
    if isinstance(values, np.ndarray):
        if values.ndim == 0:
            raise ValueError(f"field {name!r}: a 0-d array is not a column (one value per sample is needed)")
        if values.dtype.kind in _NUMERIC:
            return "fixed", np.ascontiguousarray(values)
        values = values.tolist()  # strings, objects: JSON
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"field {name!r}: expected a list (one item per sample) or an ndarray, got {type(values).__name__}")
    values = list(values)
    if values and all(_is_scalar(v) for v in values):
        return "fixed", np.asarray(values)
    if values and all(isinstance(v, (np.ndarray, list, tuple)) for v in values):
        try:
            return "ragged", _ragged_from(values, name)
        except (TypeError, ValueError):
            if any(isinstance(v, np.ndarray) for v in values):
                raise
            # lists that are not numeric arrays (strings, nested ragged lists): JSON below
    return "json", _json_from(values, name)


def samples_to_columns(samples: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """A list of per-sample dicts (same keys in each) → ``{field: [value per sample]}`` for :func:`write_chunk`."""
    if not samples:
        raise ValueError("no samples")
    keys = list(samples[0])
    for i, s in enumerate(samples):
        if set(s) != set(keys):
            raise ValueError(f"sample {i} has fields {sorted(s)}, sample 0 has {sorted(keys)}")
    return {k: [s[k] for s in samples] for k in keys}


def columns_to_samples(columns: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Inverse of :func:`samples_to_columns` for what :func:`read_chunk` returns."""
    if not columns:
        return []
    lens = {k: len(v) for k, v in columns.items()}
    if len(set(lens.values())) != 1:
        raise ValueError(f"columns differ in length: {lens}")
    (n,) = set(lens.values())
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


# ---------------------------------------------------------------------------------------- writing ---


@dataclass(frozen=True)
class _Dataset:
    """One HDF5 dataset to write: its path in the file, dtype and shape, and the buffers whose bytes, in
    order, are its contents (several for a ragged field given as per-sample arrays: written with one
    ``pwritev``, never concatenated)."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    buffers: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _datasets(name: str, values: Any) -> tuple[str, list[_Dataset]]:
    """(kind, datasets) of one field, without copying the arrays when they are contiguous and of the
    column's dtype already (a rollout's per-sample arrays, a flat :class:`Ragged`)."""
    check_field_name(name)
    if (isinstance(values, (list, tuple)) and values
            and all(isinstance(v, np.ndarray) and v.ndim and v.dtype.kind in _NUMERIC for v in values)):
        dtype, tail, arrays, offsets = _ragged_parts(list(values), name)
        bufs = tuple(np.ascontiguousarray(a.astype(dtype, copy=False)) for a in arrays if a.size)
        return "ragged", [_Dataset(name, dtype, (int(offsets[-1]),) + tail, bufs),
                          _Dataset(f"{name}.offsets", offsets.dtype, offsets.shape, (offsets,))]
    kind, p = encode_column(name, values)
    if kind == "fixed":
        return kind, [_Dataset(name, p.dtype, p.shape, (p,))]
    return kind, [_Dataset(name, p.data.dtype, p.data.shape, (p.data,)),
                  _Dataset(f"{name}.offsets", p.offsets.dtype, p.offsets.shape, (p.offsets,))]


def _encode_all(fields: Mapping[str, Any]) -> tuple[dict[str, tuple[str, list[_Dataset]]], int]:
    if not fields:
        raise ValueError("a chunk needs at least one field")
    cols = {name: _datasets(name, v) for name, v in fields.items()}
    lens = {name: ds[0].shape[0] if kind == "fixed" else ds[1].shape[0] - 1 for name, (kind, ds) in cols.items()}
    if len(set(lens.values())) != 1:
        raise ValueError(f"fields differ in sample count: {lens}")
    (n,) = set(lens.values())
    if n < 1:
        raise ValueError("a chunk needs at least one sample")
    return cols, n


def _header(kind: str, checksum: str, size: int, n: int, base: str | None, index: Mapping | None = None,
            ub: int | None = HEADER_SIZE) -> bytes:
    """The user block: MAGIC, one JSON line that fits the first 512 bytes (what :func:`read_header` reads),
    then one JSON line with the index (where each dataset's bytes lie), NUL-padded to ``ub``."""
    meta = {"format": FORMAT, "v": VERSION, "kind": kind, "checksum": checksum, "size": size, "n": n, "base": base}
    if ub != HEADER_SIZE:
        meta["ub"] = ub or 1 << 30  # (None: measuring, unpadded)
    h = MAGIC + json.dumps(meta, separators=(",", ":")).encode() + b"\n"
    if len(h) > HEADER_SIZE:
        raise AssertionError("chunk header too long")
    if index is not None:
        h += json.dumps(index, separators=(",", ":")).encode() + b"\n"
    if ub is None:
        return h
    if len(h) > ub:
        raise AssertionError("chunk index longer than its user block")
    return h.ljust(ub, b"\0")


def _user_block(kind: str, n: int, base: str | None, algo: str, kinds: Mapping[str, str],
                dsets: Mapping[str, _Dataset]) -> int:
    """The user block's size: a power of two >= 512 that holds the header with an index of the widest
    offsets (HDF5 wants a power of two; offsets are known only once HDF5 has placed the datasets)."""
    widest = {"fields": kinds, "ds": {p: [10**15, d.dtype.str, list(d.shape)] for p, d in dsets.items()}}
    need = len(_header(kind, _placeholder(algo), 10**15, n, base, widest, None))
    ub = HEADER_SIZE
    while ub < need:
        ub *= 2
    return ub


_DCPL = None


def _dcpl():
    """Contiguous, allocated when created, never filled: HDF5 writes only metadata, the data is ours."""
    global _DCPL
    if _DCPL is None:
        p = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        p.set_layout(h5py.h5d.CONTIGUOUS)
        p.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        p.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        p.set_obj_track_times(False)  # no timestamps: the same columns give the same bytes (side-file retries)
        _DCPL = p
    return _DCPL


def _layout(path: Path, kinds: Mapping[str, str], dsets: Mapping[str, _Dataset], meta: Mapping[str, Any],
            ub: int) -> dict[str, int]:
    """Create ``path`` as the HDF5 file's metadata with every dataset allocated but unwritten; return each
    non-empty dataset's offset in the file. HDF5 itself never copies or writes a byte of the data."""
    offsets = {}
    with h5py.File(path, "w-", userblock_size=ub, libver=("v110", "latest"),  # smaller object headers; HDF5 >= 1.10
                   alignment_threshold=64, alignment_interval=64,  # arrays 64-byte aligned for the reader's views
                   locking=False) as f:  # a private tmp file (and Lustre without flock must not fail the write)
        # one JSON attribute (plus each field's kind): one attribute is much cheaper than one per fact
        f.attrs["meta"] = json.dumps({**meta, "fields": kinds}, separators=(",", ":"))
        for d in dsets.values():
            sid = h5py.h5s.create_simple(d.shape) if d.shape else h5py.h5s.create(h5py.h5s.SCALAR)
            ds = h5py.h5d.create(f.id, d.path.encode(), h5py.h5t.py_create(d.dtype), sid, dcpl=_dcpl())
            if d.nbytes:
                offsets[d.path] = ds.get_offset()
    return offsets


_WRITE_BLOCK = 2 << 20  # bytes per write call and per writeback handed to the device (a test slows writes per call)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """``pwritev`` until every byte is out (a call may write less); returns the end offset."""
    bufs = list(bufs)
    while bufs:
        k = os.pwritev(fd, bufs, offset)
        offset += k
        while bufs and k >= len(bufs[0]):
            k -= len(bufs.pop(0))
        if k:
            bufs[0] = bufs[0][k:]
    return offset


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Handoff:
    """Hands a file's written bytes to the device (:func:`~relax_hpc.rundir.start_writeback`) as they are
    written, so the disk writes while the rest is copied and checksummed, and the closing fsync waits only for
    the tail. In whole pages, each once, ``_WRITE_BLOCK`` bytes at least: a page handed over while partly
    written would go to the disk twice, and on a device with stable pages the next write into it would wait for
    the first. The pages of the header (``[0, ub)``, written last) are left to the fsync."""

    def __init__(self, fd: int, ub: int):
        self.fd, self.done = fd, -(-ub // _PAGE) * _PAGE

    def written(self, end: int) -> None:
        """Every byte below ``end`` is final (the datasets are written in file order; HDF5's metadata between
        them went first)."""
        upto = end - end % _PAGE
        if upto - self.done >= _WRITE_BLOCK:
            start_writeback(self.fd, self.done, upto - self.done)
            self.done = upto


def _pwrite_pieces(fd: int, buffers: Iterable[np.ndarray], offset: int, handoff: _Handoff) -> Iterator[memoryview]:
    """Write the buffers back to back at ``offset``, straight from their memory, ``_WRITE_BLOCK`` bytes (or
    ``_IOV_MAX`` buffers) per ``pwritev``, each block then offered to ``handoff``; yield each piece once it is out."""
    batch: list[memoryview] = []
    n = 0
    for b in buffers:
        mv = memoryview(b).cast("B")
        while mv:
            piece = mv[: _WRITE_BLOCK - n]
            mv = mv[len(piece):]
            batch.append(piece)
            n += len(piece)
            if n >= _WRITE_BLOCK or len(batch) >= _IOV_MAX:
                offset = _pwritev_all(fd, batch, offset)
                handoff.written(offset)
                yield from batch
                batch, n = [], 0
    if batch:
        handoff.written(_pwritev_all(fd, batch, offset))
        yield from batch


def _written(fd: int, ub: int, size: int, placed: list[tuple[int, _Dataset]]) -> Iterator[bytes | memoryview]:
    """Write the datasets and yield the file's bytes from ``ub`` to ``size`` in order, for the checksum: the
    dataset pieces once written (from the caller's buffers, not read back) and HDF5's metadata between the
    datasets read back (a few KiB). (Smaller pieces, hashed while still in the CPU cache, measured no faster
    end to end.)"""
    handoff = _Handoff(fd, ub)
    pos = ub
    for off, d in placed:
        if off > pos:
            yield os.pread(fd, off - pos, pos)
        yield from _pwrite_pieces(fd, d.buffers, off, handoff)
        pos = off + d.nbytes
    if size > pos:
        yield os.pread(fd, size - pos, pos)


def _write_file(directory: Path, final: Callable[[str], str], kind: str, cols: Mapping[str, tuple[str, list[_Dataset]]],
                meta: Mapping[str, Any], n: int, base: str | None, algo: str) -> tuple[str, str, int]:
    """Write a chunk or side file under a hidden tmp name, fsync, link to ``final(checksum)`` (never
    replacing), fsync the dir. Returns (name, checksum, size)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"partition directory {directory} does not exist (has the step been started?)")
    kinds = {name: k for name, (k, _) in cols.items()}
    dsets = {d.path: d for _, ds in cols.values() for d in ds}
    ub = _user_block(kind, n, base, algo, kinds, dsets)
    tmp = directory / f".{final('')}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        offsets = _layout(tmp, kinds, dsets, meta, ub)
        os.chmod(tmp, 0o600)  # HDF5 created it with the umask's mode: private, like the rest of the run dir
        placed = sorted((offsets[p], dsets[p]) for p in offsets)
        fd = os.open(tmp, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for off, d in placed:
                if off < ub or off + d.nbytes > size:
                    raise AssertionError(f"HDF5 placed {d.path} at {off}+{d.nbytes}, outside [{ub}, {size})")
            index = {"fields": kinds, "ds": {p: [offsets.get(p, 0), d.dtype.str, list(d.shape)] for p, d in dsets.items()}}
            # (a checksum thread beside the writes was measured slower: both are memory-bound, on 2 cores)
            checksum = digest(itertools.chain([_header(kind, _placeholder(algo), size, n, base, index, ub)],
                                              _written(fd, ub, size, placed)), algo)
            _pwritev_all(fd, [memoryview(_header(kind, checksum, size, n, base, index, ub))], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    name = final(checksum)
    try:
        _link(tmp, directory / name)
    except ChunkExists as e:
        e.checksum, e.size = checksum, size  # what was written: a caller may compare it with the file there
        raise
    _fsync_dir(directory)
    return name, checksum, size


def _link(tmp: Path, dest: Path) -> None:
    """Give the durable tmp file its final name; fail (and remove tmp) if the name is taken."""
    try:
        os.link(tmp, dest)  # atomic, and fails if dest exists: a published chunk is never replaced
    except FileExistsError:
        _unlink_quiet(tmp)
        raise ChunkExists(errno.EEXIST, "chunk file exists", str(dest)) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            _unlink_quiet(tmp)
            raise
        if dest.exists():  # no hard links on this filesystem: rename, checking first (best effort)
            _unlink_quiet(tmp)
            raise ChunkExists(errno.EEXIST, "chunk file exists", str(dest)) from None
        os.rename(tmp, dest)
    else:
        os.unlink(tmp)


def _unlink_quiet(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def write_chunk(root: str | os.PathLike, step: int, producer: str, seq: int, fields: Mapping[str, Any],
                attrs: Mapping[str, Any] | None = None, *, algo: str = CHECKSUM_ALGO) -> ChunkRef:
    """Write a chunk to ``<root>/step_<step>/chunk_<producer>_<seq>.h5`` (the directory must exist).

    ``fields`` maps a field name to one column (see :func:`encode_column`); ``attrs`` is JSON (at most 64 KiB),
    returned in the :class:`ChunkRef`. Raises :class:`ChunkExists` if that name is taken. The file is
    durable and complete when this returns; announce the returned ref to the broker.
    """
    name = chunk_name(producer, seq)
    _placeholder(algo)
    attrs = dict(attrs or {})
    attrs_json = json.dumps(attrs, separators=(",", ":"))
    if len(attrs_json) > MAX_ATTRS_BYTES:
        raise ValueError(f"attrs are {len(attrs_json)} bytes of JSON; the limit is {MAX_ATTRS_BYTES}")
    cols, n = _encode_all(fields)
    directory = partition_dir(root, step)
    _, checksum, size = _write_file(directory, lambda _: name + ".h5", "chunk", cols,
                                 {"format": FORMAT, "v": VERSION, "kind": "chunk", "step": int(step),
                                  "producer": producer, "seq": int(seq), "n": n, "attrs": attrs}, n, None, algo)
    return ChunkRef(path=str((directory / (name + ".h5")).absolute()), step=int(step), n=n, fields=tuple(cols),
                    checksum=checksum, size=size, attrs=attrs)


def write_fields(ref: ChunkRef, writer: str, fields: Mapping[str, Any], *, algo: str = CHECKSUM_ALGO) -> SideRef:
    """Write a side file with ``fields`` for chunk ``ref`` (one value per sample, ``ref.n`` samples).

    The name carries the first 8 hex digits of the file's checksum, so a retry with other content never
    replaces what may already be announced; a retry with the same content finds the same file and returns it.
    Hand the :class:`SideRef` to the broker's ``add_fields``.
    """
    check_name(writer, "writer")
    _placeholder(algo)
    cols, n = _encode_all(fields)
    if n != ref.n:
        raise ValueError(f"{ref.id} has {ref.n} samples; the fields have {n}")
    clash = set(cols) & ref.all_fields
    if clash:
        raise ValueError(f"{ref.id} already has fields {sorted(clash)}")
    meta = {"format": FORMAT, "v": VERSION, "kind": "side", "chunk": ref.id, "writer": writer, "n": n, "base": ref.checksum}
    file = None

    def name(checksum: str) -> str:
        nonlocal file
        file = f"{ref.name}.{writer}.{checksum.split(':', 1)[1][:8]}.h5" if checksum else f"{ref.name}.{writer}"
        return file

    try:
        _, checksum, size = _write_file(ref.dir, name, "side", cols, meta, n, ref.checksum, algo)
    except ChunkExists as e:
        checksum, size = e.checksum, e.size
        try:
            check_file(ref.dir / file, checksum, size)  # the same bytes, written before: idempotent
        except DamagedChunk:
            raise ChunkExists(errno.EEXIST, "a different side file has this name", str(ref.dir / file)) from None
    return SideRef(chunk=ref.id, writer=writer, file=file, fields=tuple(cols), checksum=checksum, size=size)


# ---------------------------------------------------------------------------------------- reading ---


def _parse_header(raw: bytes, path: Path) -> dict:
    if not raw.startswith(MAGIC):
        raise DamagedChunk(path, "not a relax_hpc chunk (bad magic)")
    try:
        end = raw.index(b"\n", len(MAGIC))
        meta = json.loads(raw[len(MAGIC) : end])
        if meta.get("format") != FORMAT or not isinstance(meta.get("checksum"), str):
            raise ValueError("not a chunk header")
    except ValueError as e:
        raise DamagedChunk(path, f"unreadable header: {e}") from None
    if meta.get("v") != VERSION:
        raise DamagedChunk(path, f"chunk format version {meta.get('v')}, this reader knows {VERSION}")
    return meta


def read_header(path: str | os.PathLike) -> dict:
    """The JSON of a chunk file's user block (checksum, size, n, kind, base). Raises :class:`DamagedChunk`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise DamagedChunk(path, f"cannot read: {e.strerror or e}") from None
    if len(raw) < HEADER_SIZE:
        raise DamagedChunk(path, f"truncated: {len(raw)} bytes, shorter than the header")
    return _parse_header(raw, path)


def check_file(path: str | os.PathLike, checksum: str, size: int) -> dict:
    """Cheap check (one stat, one 512-byte read): present, the expected size, the expected header checksum."""
    path = Path(path)
    try:
        actual = os.stat(path).st_size
    except OSError as e:
        raise DamagedChunk(path, f"missing: {e.strerror or e}") from None
    if actual != size:
        raise DamagedChunk(path, f"size {actual} bytes, expected {size} ({'truncated' if actual < size else 'grown'})")
    meta = read_header(path)
    if meta["checksum"] != checksum or meta.get("size") != size:
        raise DamagedChunk(path, f"header says {meta['checksum']}/{meta.get('size')}, expected {checksum}/{size}")
    return meta


def _pread_full(fd: int, mv: memoryview, offset: int) -> int:
    """Fill ``mv`` from ``offset``; fewer bytes only at the end of the file. Returns how many."""
    done = 0
    while done < len(mv):
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k == 0:
            break
        done += k
    return done


_READ_PIECE = 256 << 10


def _read_pieces(fd: int, mv: memoryview, start: int, path: Path) -> Iterator[memoryview]:
    """Fill ``mv[start:]`` from the file, ``_READ_PIECE`` bytes at a time, yielding each piece as it lands so
    the checksum reads it from the CPU cache rather than from memory (14 MB read + verified: 1.6 → 1.45 ms)."""
    for off in range(start, len(mv), _READ_PIECE):
        piece = mv[off:off + _READ_PIECE]
        if _pread_full(fd, piece, off) != len(piece):
            raise DamagedChunk(path, "truncated while read")
        yield piece


def load_verified(path: str | os.PathLike, checksum: str | None = None, size: int | None = None) -> tuple[dict, np.ndarray]:
    """(header, whole file bytes) after checking size and checksum; the expected values default to the
    header's own (a self-check, for files the journal does not know)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise DamagedChunk(path, f"cannot read: {e.strerror or e}") from None
    try:
        return _load_verified(fd, path, checksum, size)
    except OSError as e:
        raise DamagedChunk(path, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _load_verified(fd: int, path: Path, checksum: str | None, size: int | None) -> tuple[dict, np.ndarray]:
    actual = os.fstat(fd).st_size
    if size is not None and actual != size:
        raise DamagedChunk(path, f"size {actual} bytes, expected {size} ({'truncated' if actual < size else 'grown'})")
    if actual < HEADER_SIZE:
        raise DamagedChunk(path, f"truncated: {actual} bytes, shorter than the header")
    buf = np.empty(actual, np.uint8)  # writable: the arrays read_chunk returns are views into it; not zero-filled
    mv = memoryview(buf)
    if _pread_full(fd, mv[:HEADER_SIZE], 0) < HEADER_SIZE:
        raise DamagedChunk(path, "truncated while read")
    head = bytes(mv[:HEADER_SIZE])
    meta = _parse_header(head, path)
    want = checksum if checksum is not None else meta["checksum"]
    want_size = size if size is not None else meta.get("size")
    if actual != want_size:
        raise DamagedChunk(path, f"size {actual} bytes, expected {want_size}")
    if meta["checksum"] != want:
        raise DamagedChunk(path, f"header checksum {meta['checksum']}, expected {want}")
    key = b'"checksum":"' + want.encode() + b'"'
    if head.count(key) != 1:
        raise DamagedChunk(path, "header checksum field is damaged")
    try:
        blank = head.replace(key, b'"checksum":"' + _placeholder(_algo_of(want)).encode() + b'"')
    except ValueError as e:
        raise DamagedChunk(path, str(e)) from None
    got = digest(itertools.chain([blank], _read_pieces(fd, mv, HEADER_SIZE, path)), _algo_of(want))
    if got != want:
        raise DamagedChunk(path, f"checksum {got}, expected {want}: the file was altered")
    return meta, buf


def verify_file(path: str | os.PathLike, checksum: str | None = None, size: int | None = None) -> dict:
    """Full check of one file (reads it all); returns its header. Raises :class:`DamagedChunk`."""
    return load_verified(path, checksum, size)[0]


class _MemFile(io.RawIOBase):
    """A read-only file over a buffer, for h5py's file-object driver: no copy of the buffer (BytesIO makes one)."""

    def __init__(self, buf: bytearray):
        self._mv = memoryview(buf)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else len(self._mv) + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        chunk = self._mv[self._pos : self._pos + len(b)]
        b[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _array(ds: h5py.Dataset, buf: bytearray) -> np.ndarray:
    """The dataset as a view into the verified buffer (datasets are contiguous: no copy), else read."""
    if ds.size == 0:
        return np.empty(ds.shape, ds.dtype)
    off = ds.id.get_offset()
    if off is None or ds.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS:
        return ds[()]
    return _at(buf, off, ds.dtype, ds.shape, 0, ds.name)


def _indexed(meta: Mapping, buf: np.ndarray) -> tuple[dict, dict] | None:
    """(kinds, datasets) from the header's index line, or None for a file without one (written before it)."""
    ub = meta.get("ub", HEADER_SIZE)
    lines = bytes(buf[:ub]).rstrip(b"\0").split(b"\n")  # MAGIC, the header, the index (MAGIC ends in \n)
    if len(lines) < 4 or not lines[2].startswith(b"{"):
        return None
    index = json.loads(lines[2])
    return index["fields"], index["ds"]


def _view(buf: np.ndarray, entry: list, ub: int) -> np.ndarray:
    """One dataset as a view into the verified bytes, where the header's index says it lies."""
    return _at(buf, int(entry[0]), np.dtype(entry[1]), tuple(entry[2]), ub, f"the dataset at {entry[0]}")


def _at(buf: np.ndarray, off: int, dtype: np.dtype, shape: tuple, lo: int, what: str) -> np.ndarray:
    """The array of ``dtype`` and ``shape`` at byte ``off`` of the verified buffer, as a view (no copy);
    ValueError if it does not lie within ``[lo, len(buf))``."""
    count = math.prod(shape)
    if count == 0:
        return np.empty(shape, dtype)
    if off < lo or off + count * dtype.itemsize > len(buf):
        raise ValueError(f"{what} runs outside the file")
    return np.frombuffer(buf, dtype=dtype, count=count, offset=off).reshape(shape)


def _decode_indexed(kinds: Mapping[str, str], ds: Mapping[str, list], buf: np.ndarray, ub: int, name: str,
                    ragged: str, path: Path) -> Any:
    kind = kinds.get(name)
    if kind == "fixed" and name in ds:
        return _view(buf, ds[name], ub)
    if kind in ("ragged", "json") and name in ds and f"{name}.offsets" in ds:
        return _column_of(kind, Ragged(_view(buf, ds[name], ub), _view(buf, ds[f"{name}.offsets"], ub)), ragged)
    raise DamagedChunk(path, f"field {name!r} is missing from the file" if kind is None else f"field {name!r} has unknown kind {kind!r}")


def _column_of(kind: str, r: Ragged, ragged: str) -> Any:
    if kind == "json":
        raw = r.data.tobytes()
        return [json.loads(raw[r.offsets[i] : r.offsets[i + 1]]) for i in range(len(r))]
    return r if ragged == "flat" else r.to_list()


def _decode(f: h5py.File, buf: bytearray, kinds: Mapping[str, str], name: str, ragged: str, path: Path) -> Any:
    obj = f.get(name)
    if obj is None or name not in kinds:
        raise DamagedChunk(path, f"field {name!r} is missing from the file")
    kind = kinds[name]
    if kind == "fixed" and isinstance(obj, h5py.Dataset):
        return _array(obj, buf)
    if kind in ("ragged", "json") and isinstance(obj, h5py.Group):
        return _column_of(kind, Ragged(_array(obj["data"], buf), _array(obj["offsets"], buf)), ragged)
    raise DamagedChunk(path, f"field {name!r} has unknown kind {kind!r}")


def read_chunk(ref: ChunkRef, fields: Iterable[str] | None = None, *, ragged: str = "list") -> dict[str, Any]:
    """Read ``fields`` (default: all) of a chunk, from its main file and side files, each verified first.

    Returns ``{field: column}``: ``fixed`` → ndarray (n, …); ``ragged`` → list of n ndarrays (or one
    :class:`Ragged` with ``ragged="flat"``); ``json`` → list of n values. The arrays are writable views into
    the file's verified bytes (read once, never copied). Only the files holding the asked fields are read.
    Raises :class:`DamagedChunk` (and returns nothing) if any of them fails its check.
    """
    if ragged not in ("list", "flat"):
        raise ValueError("ragged must be 'list' or 'flat'")
    names = list(ref.all_fields if fields is None else fields)
    by_file: dict[Path, tuple[str, int, list[str]]] = {}
    for name in names:
        path, checksum, size = ref.file_of(name)
        by_file.setdefault(path, (checksum, size, []))[2].append(name)
    out: dict[str, Any] = {}
    for path, (checksum, size, wanted) in by_file.items():
        meta, buf = load_verified(path, checksum, size)
        kind, base = ("chunk", None) if path == Path(ref.path) else ("side", ref.checksum)
        if meta.get("n") != ref.n or meta.get("kind") != kind or meta.get("base") != base:
            raise DamagedChunk(path, f"header kind={meta.get('kind')} n={meta.get('n')} base={meta.get('base')} "
                                     f"does not belong to {ref.id}")
        try:
            indexed = _indexed(meta, buf)
            if indexed is not None:  # where each array lies is in the verified header: no HDF5 on this path
                for name in wanted:
                    out[name] = _decode_indexed(*indexed, buf, meta.get("ub", HEADER_SIZE), name, ragged, path)
            else:  # a chunk written before the index: HDF5 finds the arrays
                with h5py.File(_MemFile(buf), "r") as f:
                    kinds = json.loads(f.attrs["meta"])["fields"]
                    for name in wanted:
                        out[name] = _decode(f, buf, kinds, name, ragged, path)
        except DamagedChunk:
            raise
        except Exception as e:  # verified bytes that HDF5 cannot read: written damaged
            raise DamagedChunk(path, f"HDF5 cannot read it: {e}") from None
        for name in wanted:
            if len(out[name]) != ref.n:
                raise DamagedChunk(path, f"field {name!r} has {len(out[name])} samples, expected {ref.n}")
    return {name: out[name] for name in names}


# ----------------------------------------------------------------------------------- housekeeping ---


def is_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def sweep_tmp(root: str | os.PathLike, older_than_s: float = 3600.0) -> list[Path]:
    """Remove temporary files (left by killed writers) older than ``older_than_s`` in every partition."""
    removed = []
    now = time.time()
    for d in Path(root).glob("step_*"):
        if not d.is_dir():
            continue
        for e in os.scandir(d):
            if is_tmp(e.name):
                try:
                    if now - e.stat().st_mtime >= older_than_s:
                        os.unlink(e.path)
                        removed.append(Path(e.path))
                except FileNotFoundError:
                    pass
    return removed


def visible_chunks(root: str | os.PathLike, step: int) -> list[Path]:
    """The main chunk files a directory listing shows for ``step`` (tmp and side files excluded)."""
    d = partition_dir(root, step)
    if not d.is_dir():
        return []
    return sorted(Path(e.path) for e in os.scandir(d) if parse_chunk_file(e.name))
