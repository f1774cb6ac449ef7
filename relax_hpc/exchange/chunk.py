"""The chunk format: the one module that knows how samples lie on disk.

A *chunk* is a group of samples one producer wrote at once, in one HDF5 file
``<exchange_root>/step_<N>/chunk_<producer>_<seq>.h5``. Fields that other roles compute later live in
*side files* beside it, ``chunk_<producer>_<seq>.<writer>.<digest8>.h5``, in the same format.

File layout (both kinds)::

    bytes [0, 512)   HDF5 user block, ours: b"RELAXHPC-CHUNK\\n" + one JSON line
                     {"format", "v", "kind": "chunk"|"side", "checksum": "crc32c:…", "size", "n", "base"}
                     padded with NULs. HDF5 skips the user block.
    bytes [512, …)   the HDF5 file. "size" is the whole file's; "checksum" covers the whole file, user
                     block included, with the checksum's own hex digits read as zeros.

Inside the HDF5 file, one entry per field, all contiguous and uncompressed:

- ``fixed``  — one value (scalar or fixed-shape array) per sample: a dataset ``<field>`` of shape ``(n, …)``;
- ``ragged`` — one array per sample whose first axis varies (token ids, log-probs): a group ``<field>`` with
  ``data`` (the samples' arrays concatenated along axis 0) and ``offsets`` (int64, ``n + 1``; sample ``i`` is
  ``data[offsets[i]:offsets[i+1]]``);
- ``json``   — one JSON value per sample (metadata dicts, strings): like ragged, ``data`` being UTF-8 bytes.

One JSON root attribute, ``meta``, says which chunk it is (step, producer, seq, n; for a side file the chunk
id, writer and base checksum), each field's kind, and carries the producer's ``attrs``.

Writing is crash-safe: the file image is built in memory, written to a hidden temporary name
(``.<name>.<pid>.<rand>.tmp``), fsynced, then hard-linked to its final name (which fails rather than replace
an existing file) and the directory fsynced. A reader therefore sees a complete file or none; a killed
writer leaves only a hidden ``.tmp`` file (:func:`sweep_tmp` removes old ones). Reading verifies the size
and the checksum against the values the caller got from the broker (its journal) before HDF5 sees a byte;
any mismatch or unreadable file raises :class:`DamagedChunk`.
"""

from __future__ import annotations

import errno
import functools
import io
import itertools
import json
import os
import re
import secrets
import threading
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import h5py
import numpy as np

from relax_hpc.rundir import fsync_dir as _fsync_dir

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
_ids = itertools.count()


class DamagedChunk(Exception):
    """A chunk or side file that is missing, truncated, altered or not readable as a chunk."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class ChunkExists(FileExistsError):
    """The final name is taken: chunks are never replaced (pick another seq)."""


# ------------------------------------------------------------------------------------------- refs ---


@dataclass(frozen=True)
class SideRef:
    """A side file: fields ``writer`` added to ``chunk`` (a chunk id, ``step_<N>/chunk_<producer>_<seq>``)."""

    chunk: str
    writer: str
    file: str  # file name inside the partition directory
    fields: tuple[str, ...]
    checksum: str
    size: int

    def to_dict(self) -> dict:
        return {"chunk": self.chunk, "writer": self.writer, "file": self.file, "fields": list(self.fields),
                "checksum": self.checksum, "size": self.size}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SideRef":
        return cls(chunk=d["chunk"], writer=d["writer"], file=d["file"], fields=tuple(d["fields"]),
                   checksum=d["checksum"], size=int(d["size"]))


@dataclass(frozen=True)
class ChunkRef:
    """Where a chunk is and how to check it: what the broker journals and hands to consumers."""

    path: str  # absolute path of the main file
    step: int
    n: int  # samples
    fields: tuple[str, ...]  # fields in the main file
    checksum: str
    size: int
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    sides: tuple[SideRef, ...] = ()

    @property
    def name(self) -> str:  # chunk_<producer>_<seq>
        return Path(self.path).name[: -len(".h5")]

    @property
    def id(self) -> str:  # step_<N>/chunk_<producer>_<seq>: unique in the exchange
        return f"step_{self.step}/{self.name}"

    @property
    def dir(self) -> Path:
        return Path(self.path).parent

    @property
    def all_fields(self) -> frozenset[str]:
        return frozenset(self.fields).union(*(s.fields for s in self.sides))

    def file_of(self, name: str) -> tuple[Path, str, int]:
        """(path, checksum, size) of the file holding field ``name``."""
        if name in self.fields:
            return Path(self.path), self.checksum, self.size
        for s in self.sides:
            if name in s.fields:
                return self.dir / s.file, s.checksum, s.size
        raise KeyError(f"{self.id} has no field {name!r} (it has {sorted(self.all_fields)})")

    def files(self) -> list[tuple[Path, str, int]]:
        return [(Path(self.path), self.checksum, self.size)] + [(self.dir / s.file, s.checksum, s.size) for s in self.sides]

    def to_dict(self) -> dict:
        return {"path": self.path, "step": self.step, "n": self.n, "fields": list(self.fields),
                "checksum": self.checksum, "size": self.size, "attrs": self.attrs,
                "sides": [s.to_dict() for s in self.sides]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ChunkRef":
        return cls(path=d["path"], step=int(d["step"]), n=int(d["n"]), fields=tuple(d["fields"]),
                   checksum=d["checksum"], size=int(d["size"]), attrs=dict(d.get("attrs") or {}),
                   sides=tuple(SideRef.from_dict(s) for s in d.get("sides", ())))

    def with_side(self, side: SideRef) -> "ChunkRef":
        return replace(self, sides=self.sides + (side,))


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


def _ragged_from(values: list, name: str) -> Ragged:
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


def _column_len(kind: str, payload: Any) -> int:
    return payload.shape[0] if kind == "fixed" else len(payload)


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


def _image(columns: Mapping[str, tuple[str, Any]], meta: Mapping[str, Any]) -> bytes:
    """The HDF5 file (without our user block) as bytes, built in memory. ``meta`` (plus each field's kind)
    goes into one JSON root attribute: one attribute is much cheaper than one per fact."""
    payload = sum((p.nbytes if k == "fixed" else p.data.nbytes + p.offsets.nbytes) for k, p in columns.values())
    name = f"relax-chunk-{os.getpid()}-{threading.get_ident()}-{next(_ids)}.h5"
    block = max(1 << 16, min(payload + (1 << 16), 1 << 30))
    f = h5py.File(name, "w", driver="core", backing_store=False, block_size=block, userblock_size=HEADER_SIZE,
                  libver=("v110", "latest"))  # smaller object headers; readable by HDF5 >= 1.10
    try:
        f.attrs["meta"] = json.dumps({**meta, "fields": {name: kind for name, (kind, _) in columns.items()}},
                                     separators=(",", ":"))
        for fname, (kind, p) in columns.items():
            if kind == "fixed":
                f.create_dataset(fname, data=p)
            else:
                g = f.create_group(fname)
                g.create_dataset("data", data=p.data)
                g.create_dataset("offsets", data=p.offsets)
        f.flush()
        return f.id.get_file_image()
    finally:
        f.close()


def _seal(kind: str, image: bytes, n: int, base: str | None, algo: str) -> tuple[str, bytes]:
    """(checksum, header): the checksum covers the whole file, header included, with its own hex digits
    read as zeros; so every byte but those digits (which are compared with the expected value) is covered."""
    size = HEADER_SIZE + len(image)
    checksum = digest((_header(kind, _placeholder(algo), size, n, base), image), algo)
    return checksum, _header(kind, checksum, size, n, base)


def _header(kind: str, checksum: str, size: int, n: int, base: str | None) -> bytes:
    meta = {"format": FORMAT, "v": VERSION, "kind": kind, "checksum": checksum, "size": size, "n": n, "base": base}
    h = MAGIC + json.dumps(meta, separators=(",", ":")).encode() + b"\n"
    if len(h) > HEADER_SIZE:
        raise AssertionError("chunk header too long")
    return h.ljust(HEADER_SIZE, b"\0")


_WRITE_BLOCK = 8 << 20


def _write_all(fd: int, data: bytes | memoryview) -> None:
    mv = memoryview(data)
    while mv:
        k = os.write(fd, mv[:_WRITE_BLOCK])
        mv = mv[k:]


def _publish(directory: Path, final: str, header: bytes, image: bytes) -> int:
    """Write header+image to a hidden tmp name, fsync, link to ``final`` (never replacing), fsync the dir."""
    if not directory.is_dir():
        raise FileNotFoundError(f"partition directory {directory} does not exist (has the step been started?)")
    tmp = directory / f".{final}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _write_all(fd, header)
        _write_all(fd, image)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    os.close(fd)
    dest = directory / final
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
    _fsync_dir(directory)
    return len(header) + len(image)


def _unlink_quiet(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def _encode_all(fields: Mapping[str, Any]) -> tuple[dict[str, tuple[str, Any]], int]:
    if not fields:
        raise ValueError("a chunk needs at least one field")
    cols = {name: encode_column(name, v) for name, v in fields.items()}
    lens = {name: _column_len(k, p) for name, (k, p) in cols.items()}
    if len(set(lens.values())) != 1:
        raise ValueError(f"fields differ in sample count: {lens}")
    (n,) = set(lens.values())
    if n < 1:
        raise ValueError("a chunk needs at least one sample")
    return cols, n


def write_chunk(root: str | os.PathLike, step: int, producer: str, seq: int, fields: Mapping[str, Any],
                attrs: Mapping[str, Any] | None = None, *, algo: str = CHECKSUM_ALGO) -> ChunkRef:
    """Write a chunk to ``<root>/step_<step>/chunk_<producer>_<seq>.h5`` (the directory must exist).

    ``fields`` maps a field name to one column (see :func:`encode_column`); ``attrs`` is JSON (at most 64 KiB),
    returned in the :class:`ChunkRef`. Raises :class:`ChunkExists` if that name is taken. The file is
    durable and complete when this returns; announce the returned ref to the broker.
    """
    name = chunk_name(producer, seq)
    attrs = dict(attrs or {})
    attrs_json = json.dumps(attrs, separators=(",", ":"))
    if len(attrs_json) > MAX_ATTRS_BYTES:
        raise ValueError(f"attrs are {len(attrs_json)} bytes of JSON; the limit is {MAX_ATTRS_BYTES}")
    cols, n = _encode_all(fields)
    image = _image(cols, {"format": FORMAT, "v": VERSION, "kind": "chunk", "step": int(step),
                          "producer": producer, "seq": int(seq), "n": n, "attrs": attrs})
    checksum, header = _seal("chunk", image, n, None, algo)
    size = HEADER_SIZE + len(image)
    directory = partition_dir(root, step)
    _publish(directory, name + ".h5", header, image)
    return ChunkRef(path=str((directory / (name + ".h5")).absolute()), step=int(step), n=n, fields=tuple(cols),
                    checksum=checksum, size=size, attrs=attrs)


def write_fields(ref: ChunkRef, writer: str, fields: Mapping[str, Any], *, algo: str = CHECKSUM_ALGO) -> SideRef:
    """Write a side file with ``fields`` for chunk ``ref`` (one value per sample, ``ref.n`` samples).

    The name carries the first 8 hex digits of the file's checksum, so a retry with other content never
    replaces what may already be announced; a retry with the same content finds the same file and returns it.
    Hand the :class:`SideRef` to the broker's ``add_fields``.
    """
    check_name(writer, "writer")
    cols, n = _encode_all(fields)
    if n != ref.n:
        raise ValueError(f"{ref.id} has {ref.n} samples; the fields have {n}")
    clash = set(cols) & ref.all_fields
    if clash:
        raise ValueError(f"{ref.id} already has fields {sorted(clash)}")
    image = _image(cols, {"format": FORMAT, "v": VERSION, "kind": "side", "chunk": ref.id, "writer": writer,
                          "n": n, "base": ref.checksum})
    checksum, header = _seal("side", image, n, ref.checksum, algo)
    size = HEADER_SIZE + len(image)
    file = f"{ref.name}.{writer}.{checksum.split(':', 1)[1][:8]}.h5"
    try:
        _publish(ref.dir, file, header, image)
    except ChunkExists:
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


def load_verified(path: str | os.PathLike, checksum: str | None = None, size: int | None = None) -> tuple[dict, bytearray]:
    """(header, whole file bytes) after checking size and checksum; the expected values default to the
    header's own (a self-check, for files the journal does not know)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if size is not None and actual != size:
                raise DamagedChunk(path, f"size {actual} bytes, expected {size} ({'truncated' if actual < size else 'grown'})")
            buf = bytearray(actual)  # writable: the arrays read_chunk returns are views into it
            got_n = f.readinto(buf)
            if got_n != actual:
                del buf[got_n:]
    except OSError as e:
        raise DamagedChunk(path, f"cannot read: {e.strerror or e}") from None
    if len(buf) < HEADER_SIZE:
        raise DamagedChunk(path, f"truncated: {len(buf)} bytes, shorter than the header")
    meta = _parse_header(bytes(buf[:HEADER_SIZE]), path)
    want = checksum if checksum is not None else meta["checksum"]
    want_size = size if size is not None else meta.get("size")
    if len(buf) != want_size:
        raise DamagedChunk(path, f"size {len(buf)} bytes, expected {want_size}")
    if meta["checksum"] != want:
        raise DamagedChunk(path, f"header checksum {meta['checksum']}, expected {want}")
    key = b'"checksum":"' + want.encode() + b'"'
    head = bytes(buf[:HEADER_SIZE])
    if head.count(key) != 1:
        raise DamagedChunk(path, "header checksum field is damaged")
    try:
        blank = head.replace(key, b'"checksum":"' + _placeholder(_algo_of(want)).encode() + b'"')
        got = digest((blank, memoryview(buf)[HEADER_SIZE:]), _algo_of(want))
    except ValueError as e:
        raise DamagedChunk(path, str(e)) from None
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
    if off + ds.size * ds.dtype.itemsize > len(buf):
        raise ValueError(f"dataset {ds.name} runs past the end of the file")
    return np.frombuffer(buf, dtype=ds.dtype, count=ds.size, offset=off).reshape(ds.shape)


def _decode(f: h5py.File, buf: bytearray, kinds: Mapping[str, str], name: str, ragged: str, path: Path) -> Any:
    obj = f.get(name)
    if obj is None or name not in kinds:
        raise DamagedChunk(path, f"field {name!r} is missing from the file")
    kind = kinds[name]
    if kind == "fixed" and isinstance(obj, h5py.Dataset):
        return _array(obj, buf)
    if kind in ("ragged", "json") and isinstance(obj, h5py.Group):
        r = Ragged(_array(obj["data"], buf), _array(obj["offsets"], buf))
        if kind == "json":
            raw = r.data.tobytes()
            return [json.loads(raw[r.offsets[i] : r.offsets[i + 1]]) for i in range(len(r))]
        return r if ragged == "flat" else r.to_list()
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
