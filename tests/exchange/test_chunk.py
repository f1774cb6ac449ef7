"""The chunk format: round trips, side files, and damage that must never be read back as data."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relax_hpc.exchange import chunk as chunkmod
from relax_hpc.exchange.chunk import (
    HEADER_SIZE,
    ChunkExists,
    DamagedChunk,
    Ragged,
    columns_to_samples,
    encode_column,
    partition_dir,
    read_chunk,
    read_header,
    samples_to_columns,
    sweep_tmp,
    verify_file,
    visible_chunks,
    write_chunk,
    write_fields,
)

from .helpers import flip_byte, fresh_dir, sample_fields, tokens_for, truncate

DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64, np.bool_, np.complex64, np.complex128]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def same_array(a, b) -> bool:
    """Bit-for-bit: dtype, shape and bytes (NaNs and -0.0 included)."""
    return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def columns(draw):
    n = draw(st.integers(1, 6))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=4, unique=True))
    out = {}
    for name in names:
        kind = draw(st.sampled_from(["fixed", "ragged", "json"]))
        if kind == "json":
            out[name] = ("json", [{"v": draw(json_values)} for _ in range(n)])
            continue
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        tail = draw(st.sampled_from([(), (3,), (2, 2)]))
        if kind == "fixed":
            out[name] = ("fixed", draw(hnp.arrays(dtype, (n,) + tail)))
        else:
            lens = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
            out[name] = ("ragged", [draw(hnp.arrays(dtype, (k,) + tail)) for k in lens])
    return n, out


def check_same(kind, want, got):
    if kind == "fixed":
        assert same_array(want, got)
    elif kind == "ragged":
        assert isinstance(got, list) and len(got) == len(want)
        for w, g in zip(want, got):
            assert same_array(w, g)
    else:
        assert got == want


@FAST
@given(data=columns(), attrs=st.dictionaries(st.text(max_size=5), json_values, max_size=3))
def test_round_trip_any_dtype_and_kind(data, attrs):
    n, cols = data
    root = fresh_dir()
    try:
        partition_dir(root, 3).mkdir()
        ref = write_chunk(root, 3, "rollout-0", 7, {k: v for k, (_, v) in cols.items()}, attrs)
        assert ref.n == n and ref.step == 3 and ref.id == "step_3/chunk_rollout-0_7" and ref.attrs == attrs
        assert set(ref.fields) == set(cols)
        got = read_chunk(ref)
        for name, (kind, want) in cols.items():
            check_same(kind, want, got[name])
        # a subset reads only what was asked for; flat ragged gives the same arrays
        name = next(iter(cols))
        assert list(read_chunk(ref, [name])) == [name]
        flat = read_chunk(ref, ragged="flat")
        for name, (kind, want) in cols.items():
            if kind == "ragged":
                assert isinstance(flat[name], Ragged) and len(flat[name]) == n
                for i in range(n):
                    assert same_array(want[i], flat[name][i])
        # the ref survives the wire
        assert type(ref).from_dict(ref.to_dict()) == ref
    finally:
        shutil.rmtree(root)


def test_side_files_add_fields_and_are_idempotent(xroot):
    partition_dir(xroot, 0).mkdir()
    ref = write_chunk(xroot, 0, "p", 0, sample_fields([1, 2, 3], [4, 0, 2]))
    lp = [np.full(k, 0.25, np.float32) for k in (4, 0, 2)]
    side = write_fields(ref, "actor_fwd", {"log_probs": lp})
    assert side.chunk == ref.id and side.fields == ("log_probs",)
    assert side.file.startswith("chunk_p_0.actor_fwd.") and (ref.dir / side.file).exists()
    again = write_fields(ref, "actor_fwd", {"log_probs": lp})  # same bytes: the same file, no error
    assert again == side
    other = write_fields(ref, "actor_fwd", {"log_probs": [x + 1 for x in lp]})  # other bytes: another file
    assert other.file != side.file and (ref.dir / side.file).exists()
    full = ref.with_side(side).with_side(write_fields(ref, "advantages", {"advantages": lp, "returns": lp}))
    got = read_chunk(full, ["tokens", "log_probs", "returns"])
    assert [list(x) for x in got["log_probs"]] == [list(x) for x in lp]
    assert set(full.all_fields) == {"sid", "tokens", "reward", "log_probs", "advantages", "returns"}
    with pytest.raises(ValueError, match="already has"):
        write_fields(full, "x", {"log_probs": lp})
    with pytest.raises(ValueError, match="3 samples"):
        write_fields(ref, "x", {"y": [1.0, 2.0]})
    with pytest.raises(KeyError):
        read_chunk(ref, ["log_probs"])  # a ref without the side does not know the field


def test_samples_columns_helpers(xroot):
    samples = [{"tokens": [1, 2, 3], "reward": 1.0, "meta": {"src": "a"}, "ok": True},
               {"tokens": [], "reward": 0.5, "meta": {"src": "b"}, "ok": False},
               {"tokens": [9], "reward": -1.0, "meta": {}, "ok": True}]
    cols = samples_to_columns(samples)
    partition_dir(xroot, 0).mkdir()
    ref = write_chunk(xroot, 0, "p", 0, cols)
    back = columns_to_samples(read_chunk(ref))
    assert [s["tokens"].tolist() for s in back] == [[1, 2, 3], [], [9]]
    assert all(s["tokens"].dtype == np.int64 for s in back)  # an empty list does not make it float
    assert [float(s["reward"]) for s in back] == [1.0, 0.5, -1.0]
    assert [s["meta"] for s in back] == [{"src": "a"}, {"src": "b"}, {}]
    assert [bool(s["ok"]) for s in back] == [True, False, True]
    with pytest.raises(ValueError):
        samples_to_columns([{"a": 1}, {"b": 2}])


def test_column_kinds_and_refusals():
    assert encode_column("a", np.zeros((2, 3)))[0] == "fixed"
    assert encode_column("a", [1, 2.5])[0] == "fixed"
    assert encode_column("a", [np.zeros(2), np.zeros(5)])[0] == "ragged"
    assert encode_column("a", [[1, 2], [3]])[0] == "ragged"
    assert encode_column("a", ["x", "yz"])[0] == "json"
    assert encode_column("a", [[1, [2]], [3]])[0] == "json"
    assert encode_column("a", Ragged(np.arange(5), np.array([0, 2, 5])))[0] == "ragged"
    with pytest.raises(ValueError):
        encode_column("a", [np.zeros((2, 3)), np.zeros((2, 4))])  # trailing shapes differ
    for bad in ("a/b", "", "1x", "x.y"):
        with pytest.raises(ValueError):
            encode_column(bad, [1])
    with pytest.raises(ValueError):
        encode_column("a", np.array(1.0))


def test_names_and_sample_counts(xroot):
    partition_dir(xroot, 0).mkdir()
    with pytest.raises(ValueError):
        write_chunk(xroot, 0, "bad.name", 0, {"a": [1]})
    with pytest.raises(ValueError, match="sample count"):
        write_chunk(xroot, 0, "p", 0, {"a": [1, 2], "b": [1]})
    with pytest.raises(ValueError):
        write_chunk(xroot, 0, "p", 0, {})
    with pytest.raises(FileNotFoundError, match="started"):
        write_chunk(xroot, 9, "p", 0, {"a": [1]})  # no partition directory
    with pytest.raises(ValueError, match="attrs"):
        write_chunk(xroot, 0, "p", 0, {"a": [1]}, {"big": "x" * (70 << 10)})


def test_a_published_chunk_is_never_replaced(xroot):
    partition_dir(xroot, 0).mkdir()
    ref = write_chunk(xroot, 0, "p", 0, {"a": [1, 2]})
    with pytest.raises(ChunkExists):
        write_chunk(xroot, 0, "p", 0, {"a": [3, 4]})
    assert read_chunk(ref)["a"].tolist() == [1, 2]
    assert os.stat(ref.path).st_mode & 0o777 == 0o600  # private, whatever the umask
    assert [p.name for p in visible_chunks(xroot, 0)] == ["chunk_p_0.h5"]
    assert not [n for n in os.listdir(ref.dir) if n.endswith(".tmp")]  # the loser's tmp is gone


def test_a_failed_write_leaves_nothing(xroot, monkeypatch):
    partition_dir(xroot, 0).mkdir()
    calls = []
    real = os.pwritev

    def failing_write(fd, buffers, offset):  # the array goes out, then the disk fills up (at the header)
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(chunkmod.os, "pwritev", failing_write)
    with pytest.raises(OSError, match="space"):
        write_chunk(xroot, 0, "p", 0, {"a": [1, 2]})
    monkeypatch.undo()
    assert os.listdir(partition_dir(xroot, 0)) == []


# ------------------------------------------------------------------------------------------ damage ---


@pytest.fixture(scope="module")
def pristine():
    root = fresh_dir()
    partition_dir(root, 0).mkdir()
    ref = write_chunk(root, 0, "p", 0, sample_fields([5, 6, 7], [40, 3, 0]), {"weight_version": 2})
    side = write_fields(ref, "w", {"lp": [np.ones(k, np.float32) for k in (40, 3, 0)]})
    ref = ref.with_side(side)
    files = {"main": open(ref.path, "rb").read(), "side": open(ref.dir / side.file, "rb").read()}
    yield ref, files
    shutil.rmtree(root)


def _restore(ref, files):
    open(ref.path, "wb").write(files["main"])
    open(ref.dir / ref.sides[0].file, "wb").write(files["side"])


def _path(ref, which):
    return ref.path if which == "main" else ref.dir / ref.sides[0].file


@FAST
@given(which=st.sampled_from(["main", "side"]), frac=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_any_altered_byte_is_caught(pristine, which, frac, mask):
    ref, files = pristine
    _restore(ref, files)
    path = _path(ref, which)
    offset = int(frac * len(files[which]))
    flip_byte(path, offset, mask)
    field = "tokens" if which == "main" else "lp"
    with pytest.raises(DamagedChunk):
        read_chunk(ref, [field])
    with pytest.raises(DamagedChunk):
        verify_file(path)  # also caught by the file's own header, without the journal's values
    _restore(ref, files)
    read_chunk(ref)


@FAST
@given(which=st.sampled_from(["main", "side"]), frac=st.floats(0, 1, exclude_max=True))
def test_any_truncation_is_caught(pristine, which, frac):
    ref, files = pristine
    _restore(ref, files)
    path = _path(ref, which)
    truncate(path, int(frac * len(files[which])))
    with pytest.raises(DamagedChunk):
        read_chunk(ref, ["tokens", "lp"])
    _restore(ref, files)


def test_other_damage(pristine):
    ref, files = pristine
    _restore(ref, files)
    with open(ref.path, "ab") as f:
        f.write(b"x")
    with pytest.raises(DamagedChunk, match="grown"):
        read_chunk(ref)
    os.unlink(ref.path)
    with pytest.raises(DamagedChunk, match="cannot read"):
        read_chunk(ref)
    # a sound file that is not the one the ref names (a swapped or rewritten chunk)
    open(ref.path, "wb").write(files["side"])
    with pytest.raises(DamagedChunk):
        read_chunk(ref, ["tokens"])
    _restore(ref, files)
    assert read_header(ref.path)["checksum"] == ref.checksum
    # reading only the main file's fields does not need the side file
    os.unlink(ref.dir / ref.sides[0].file)
    assert len(read_chunk(ref, ["tokens"])["tokens"]) == 3
    with pytest.raises(DamagedChunk):
        read_chunk(ref, ["lp"])
    _restore(ref, files)
    assert read_header(ref.path)["size"] == ref.size and ref.size > HEADER_SIZE


def test_sweep_tmp(xroot):
    d = partition_dir(xroot, 0)
    d.mkdir()
    (d / ".chunk_p_0.h5.123.ab.tmp").write_bytes(b"partial")
    write_chunk(xroot, 0, "p", 1, {"a": [1]})
    assert sweep_tmp(xroot, older_than_s=3600) == []
    assert [p.name for p in sweep_tmp(xroot, older_than_s=0)] == [".chunk_p_0.h5.123.ab.tmp"]
    assert [p.name for p in visible_chunks(xroot, 0)] == ["chunk_p_1.h5"]


def test_read_arrays_are_private_writable_views(xroot):
    partition_dir(xroot, 0).mkdir()
    ref = write_chunk(xroot, 0, "p", 0, sample_fields([1, 2], [5, 0]))
    a, b = read_chunk(ref), read_chunk(ref, ragged="flat")
    a["tokens"][0][:] = -1  # a consumer may modify what it got in place
    a["sid"][0] = 42
    assert b["tokens"][0].tolist() == read_chunk(ref)["tokens"][0].tolist() != [-1] * 5
    assert b["sid"].tolist() == [1, 2] and b["tokens"].lengths().tolist() == [5, 0]
    verify_file(ref.path)  # the file is untouched


def test_a_chunk_written_and_read_in_many_pieces_round_trips_and_damage_in_any_piece_is_caught(xroot, monkeypatch):
    # writes go out (and to the device) block by block, reads are checksummed piece by piece: small pieces
    # here make a 100 kB chunk dozens of each
    monkeypatch.setattr(chunkmod, "_WRITE_BLOCK", 4096)
    monkeypatch.setattr(chunkmod, "_READ_PIECE", 4096)
    handed: list[tuple[int, int]] = []
    real = chunkmod.start_writeback
    monkeypatch.setattr(chunkmod, "start_writeback", lambda fd, off, n: handed.append((off, n)) or real(fd, off, n))
    partition_dir(xroot, 0).mkdir()
    lengths = [3000, 7, 9000, 0, 12000]
    ref = write_chunk(xroot, 0, "p", 0, sample_fields(list(range(5)), lengths))
    size = os.path.getsize(ref.path)
    assert size > 25 * 4096
    # the device got the file as it was written: whole pages, each once, in order, none of the header's
    page = chunkmod._PAGE
    assert len(handed) >= 10
    assert all(off % page == 0 and n % page == 0 and n >= 4096 for off, n in handed)
    assert handed[0][0] >= page and all(a + n == b for (a, n), (b, _) in zip(handed, handed[1:]))
    assert handed[-1][0] + handed[-1][1] <= size
    got = read_chunk(ref)
    assert [t.tolist() for t in got["tokens"]] == [tokens_for(i, k).tolist() for i, k in enumerate(lengths)]
    pristine = open(ref.path, "rb").read()
    for offset in (chunkmod.HEADER_SIZE + 4096 + 17, size // 2, size - 1):  # in the 2nd, a middle and the last piece
        flip_byte(ref.path, offset)
        with pytest.raises(DamagedChunk, match="checksum"):
            read_chunk(ref, ["tokens"])
        open(ref.path, "wb").write(pristine)
    read_chunk(ref)


@pytest.mark.parametrize("algo", ["crc32c", "crc32", "sha256"])
def test_each_checksum_is_written_named_and_verified(xroot, algo):
    """CRC-32C by default; zlib's CRC-32 (chunks from before CRC-32C) and a cryptographic hash still read."""
    partition_dir(xroot, 0).mkdir()
    ref = write_chunk(xroot, 0, "p", 0, sample_fields([1, 2], [3, 1]), algo=algo)
    assert ref.checksum.startswith(f"{algo}:") and read_header(ref.path)["checksum"] == ref.checksum
    got = read_chunk(ref, ["tokens"])["tokens"]
    assert [list(x) for x in got] == [list(tokens_for(1, 3)), list(tokens_for(2, 1))]
    flip_byte(ref.path, ref.size - 3)
    with pytest.raises(DamagedChunk, match="checksum"):
        verify_file(ref.path, ref.checksum, ref.size)



def test_a_chunk_is_plain_hdf5_one_dataset_per_field(xroot):
    """Standard HDF5 tools read a chunk without us: one contiguous dataset per field, a ragged field's offsets
    beside it (``<field>.offsets``), the JSON ``meta`` attribute; arrays of 64 bytes or more 64-byte aligned. What read_chunk takes
    from the header's index is what HDF5 finds."""
    import h5py

    partition_dir(xroot, 0).mkdir()
    cols = sample_fields([1, 2, 3], [5, 0, 70])
    ref = write_chunk(xroot, 0, "p", 0, cols, {"group_size": 3})
    ours = read_chunk(ref, ragged="flat")
    with h5py.File(ref.path, "r") as f:  # HDF5 skips the user block
        assert set(f) == {"sid", "tokens", "tokens.offsets", "reward"}
        meta = json.loads(f.attrs["meta"])
        assert meta["fields"] == {"sid": "fixed", "tokens": "ragged", "reward": "fixed"} and meta["attrs"] == {"group_size": 3}
        assert same_array(f["sid"][()], ours["sid"]) and same_array(f["reward"][()], ours["reward"])
        assert same_array(f["tokens"][()], ours["tokens"].data)
        assert same_array(f["tokens.offsets"][()], ours["tokens"].offsets)
        for name in f:
            assert f[name].id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
        assert f["tokens"].nbytes >= 64 and f["tokens"].id.get_offset() % 64 == 0  # (smaller arrays: not aligned)


def _legacy_chunk(directory, name, cols):
    """A chunk as written before the header index: a group per ragged field (data, offsets), no index line."""
    import h5py

    tmp = directory / ".legacy.tmp"
    with h5py.File(tmp, "w", userblock_size=HEADER_SIZE) as f:
        f.attrs["meta"] = json.dumps({"format": chunkmod.FORMAT, "v": 1, "kind": "chunk", "n": 2,
                                      "fields": {k: kind for k, (kind, _) in cols.items()}})
        for k, (kind, v) in cols.items():
            if kind == "fixed":
                f.create_dataset(k, data=v)
            else:
                g = f.create_group(k)
                g.create_dataset("data", data=v.data)
                g.create_dataset("offsets", data=v.offsets)
    body = tmp.read_bytes()[HEADER_SIZE:]
    size = HEADER_SIZE + len(body)
    checksum = chunkmod.digest([chunkmod._header("chunk", chunkmod._placeholder("crc32c"), size, 2, None), body])
    (directory / name).write_bytes(chunkmod._header("chunk", checksum, size, 2, None) + body)
    tmp.unlink()
    return checksum, size


def test_a_chunk_written_before_the_index_still_reads(xroot):
    partition_dir(xroot, 0).mkdir()
    toks = Ragged.from_list([np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32)])
    checksum, size = _legacy_chunk(partition_dir(xroot, 0), "chunk_p_0.h5",
                                   {"sid": ("fixed", np.array([7, 8])), "tokens": ("ragged", toks)})
    ref = chunkmod.ChunkRef(path=str(partition_dir(xroot, 0) / "chunk_p_0.h5"), step=0, n=2, fields=("sid", "tokens"),
                            checksum=checksum, size=size)
    got = read_chunk(ref)
    assert got["sid"].tolist() == [7, 8] and [t.tolist() for t in got["tokens"]] == [[0, 1, 2], [0, 1, 2, 3, 4]]
