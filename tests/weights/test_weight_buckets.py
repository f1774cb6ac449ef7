"""Bucket packing (pure, no processes): round trips, limits, one dtype per bucket, SGLang's flattened layout."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.weights import buckets as B
from relax_hpc.weights.fingerprint import fingerprint

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


def make_named(n: int = 60, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        dt = DTYPES[i % len(DTYPES)]
        shape = [(3, 5), (17,), (2, 3, 4), (1,), (0, 4), ()][i % 6]
        x = torch.randn(shape, generator=g) * 100
        t = x > 0 if dt == torch.bool else x.to(dt)
        out.append((f"layer.{i}.w", t))
    return out


def roundtrip(named, bucket_bytes):
    got = {}
    buckets = list(B.iter_buckets(named, bucket_bytes))
    for b in buckets:
        for name, t in b.unpack():
            assert name not in got
            got[name] = t
    return buckets, got


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1000, B.DEFAULT_BUCKET_BYTES])
def test_roundtrip_many_dtypes(bucket_bytes):
    named = make_named()
    buckets, got = roundtrip(named, bucket_bytes)
    assert list(got) != [] and set(got) == {n for n, _ in named}
    for n, t in named:
        assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t), n
    for b in buckets:
        assert b.flat.dim() == 1 and b.flat.is_contiguous()
        assert {m.dtype for m in b.metadata} == {b.dtype}, "one dtype per bucket"
        assert len(b) == 1 or b.nbytes <= bucket_bytes
    assert fingerprint(named) == fingerprint(got)
    if bucket_bytes == B.DEFAULT_BUCKET_BYTES:
        assert len(buckets) == len(DTYPES)  # everything fits: one bucket per dtype


def test_bucket_limit_and_order_within_dtype():
    named = [(f"t{i}", torch.full((250,), float(i))) for i in range(10)]  # 1000 bytes each
    buckets = list(B.iter_buckets(named, bucket_bytes=2500))
    assert [b.names for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6", "t7"], ["t8", "t9"]]
    assert all(b.nbytes == 2000 for b in buckets)


def test_tensor_larger_than_bucket_goes_alone_without_copy():
    small = [(f"s{i}", torch.randn(10)) for i in range(3)]
    big = torch.randn(1000)
    named = small[:2] + [("big", big)] + small[2:]
    buckets = list(B.iter_buckets(named, bucket_bytes=100))
    alone = [b for b in buckets if b.names == ["big"]]
    assert len(alone) == 1 and alone[0].nbytes == 4000
    assert alone[0].flat.data_ptr() == big.data_ptr(), "a contiguous oversized tensor is viewed, not copied"
    # the oversized tensor did not flush the open bucket of its dtype: the small ones share one bucket
    assert [b.names for b in buckets if b.names != ["big"]] == [["s0", "s1"], ["s2"]]


def test_non_contiguous_and_oversized_non_contiguous():
    base = torch.randn(40, 30)
    named = [("t", base.t()), ("s", base[:, ::3]), ("big_t", torch.randn(100, 100).t())]
    _, got = roundtrip(named, bucket_bytes=8000)
    for n, t in named:
        assert torch.equal(got[n], t)


def test_sglang_flattened_layout():
    """Metadata and buffer exactly as SGLang's FlattenedTensorBucket: flatten in order, torch.cat, offsets."""
    named = [("a", torch.randn(2, 3)), ("b", torch.randn(4)), ("c", torch.randn(1, 1, 5))]
    (b,) = list(B.iter_buckets(named))
    assert torch.equal(b.flat, torch.cat([t.flatten() for _, t in named]))
    assert [m.to_json() for m in b.metadata] == [
        {"name": "a", "shape": [2, 3], "dtype": "float32", "start_idx": 0, "end_idx": 6, "numel": 6},
        {"name": "b", "shape": [4], "dtype": "float32", "start_idx": 6, "end_idx": 10, "numel": 4},
        {"name": "c", "shape": [1, 1, 5], "dtype": "float32", "start_idx": 10, "end_idx": 15, "numel": 5},
    ]
    assert b.metadata[1].offset == 6
    assert (b.names, b.dtypes, b.shapes) == (["a", "b", "c"], ["float32"] * 3, [[2, 3], [4], [1, 1, 5]])
    # the receiving side knows only names/dtypes/shapes (from /update_weights_from_distributed)
    meta = B.plan((n, s, B.dtype_from_name(d)) for n, d, s in zip(b.names, b.dtypes, b.shapes))
    assert meta == b.metadata
    recv = B.empty_flat(meta)
    assert recv.dtype == torch.float32 and recv.numel() == 15
    recv.copy_(b.flat)  # stands for the broadcast
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(B.unpack(recv, meta), named))
    assert [B.TensorMeta.from_json(m.to_json()) for m in meta] == meta


def test_buckets_speak_the_one_bucket_wire():
    """The layout, metadata and dtype names are engines/bucket_wire's (the receivers read the same), not a copy."""
    from relax_hpc.engines import bucket_wire as W

    assert (B.TensorMeta, B.plan, B.unpack, B.empty_flat, B.dtype_name) == (W.TensorMeta, W.plan, W.unpack,
                                                                            W.empty_flat, W.dtype_name)


def test_pack_into_reused_buffer():
    named = [("a", torch.randn(5)), ("b", torch.randn(2, 2))]
    out = torch.zeros(20)
    b = B.pack(named, out=out)
    assert b.flat.data_ptr() == out.data_ptr() and b.flat.numel() == 9
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(b.unpack(), named))
    with pytest.raises(ValueError, match="elements"):
        B.pack(named, out=torch.zeros(3))


def test_errors_and_edge_cases():
    assert list(B.iter_buckets([])) == []
    with pytest.raises(ValueError, match="twice"):
        list(B.iter_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))]))
    with pytest.raises(ValueError, match="one dtype"):
        B.pack([("a", torch.zeros(1)), ("b", torch.zeros(1, dtype=torch.int64))])
    with pytest.raises(ValueError):
        list(B.iter_buckets([("a", torch.zeros(1))], bucket_bytes=0))
    with pytest.raises(TypeError):
        list(B.iter_buckets([("a", [1.0])]))
    with pytest.raises(ValueError, match="needs"):
        B.unpack(torch.zeros(3), B.plan([("a", (4,), torch.float32)]))
    assert B.dtype_name(torch.bfloat16) == "bfloat16" and B.dtype_from_name("torch.float16") == torch.float16
    with pytest.raises(ValueError):
        B.dtype_from_name("float77")


def test_streaming_holds_one_open_bucket_per_dtype():
    """Buckets come out as soon as they are full: the source is not drained ahead of need."""
    pulled = []

    def source():
        for i in range(8):
            pulled.append(i)
            yield f"t{i}", torch.zeros(250)  # 1000 bytes

    it = B.iter_buckets(source(), bucket_bytes=2000)
    first = next(it)
    assert first.names == ["t0", "t1"] and pulled == [0, 1, 2]


def _ddp_like(sizes, seed=0):
    """Parameters as views of one flat buffer laid out in reverse order (as Megatron's DDP param buffer), plus
    a gap where a parameter is not exported as a view (QKV is split into fresh tensors)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(sum(sizes) + 7, generator=g)
    views, off = {}, 0
    for i in reversed(range(len(sizes))):
        views[i] = buf[off:off + sizes[i]].view(sizes[i] // 4, 4)
        off += sizes[i]
    return buf, views


def test_in_place_runs_go_out_as_they_lie():
    """Views of one buffer that lie end to end go out without a copy: the bucket's flat buffer is that memory,
    its tensors in address order; a gap (a tensor sent as a fresh copy) ends a run; runs are cut at the bucket
    size; short runs and fresh tensors are packed; every tensor arrives once and exact."""
    sizes = [64, 128, 32, 256, 64, 64]
    buf, views = _ddp_like(sizes)
    fresh = torch.randn(8, 4)
    named = [(f"p{i}", views[i]) for i in range(len(sizes)) if i != 3] + [("p3", views[3].clone()), ("fresh", fresh)]
    in_place = lambda t: t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # noqa: E731
    elem = 4
    buckets = list(B.iter_buckets(named, bucket_bytes=200 * elem, in_place=in_place, in_place_min=100 * elem))
    got = {n: t for b in buckets for n, t in b.unpack()}
    assert sorted(got) == sorted(n for n, _ in named)
    for n, t in named:
        assert torch.equal(got[n], t)
    placed = [b for b in buckets if b.in_place]
    # memory, from the buffer's start: p5 p4 | p3 (exported as a copy: a gap) | p2 p1 p0
    # runs: [p5, p4] = 128 elements; [p2, p1] = 160 (p0 would pass 200: cut); [p0] = 64 (< 100: packed)
    assert [b.names for b in placed] == [["p5", "p4"], ["p2", "p1"]]
    for b in placed:
        first = dict(named)[b.names[0]]
        assert b.flat.data_ptr() == first.data_ptr() and b.flat.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    packed = {n for b in buckets if not b.in_place for n in b.names}
    assert packed == {"p0", "p3", "fresh"}
    # without the predicate nothing is in place; with a minimum of 0 every run is
    assert not any(b.in_place for b in B.iter_buckets(named, 200 * elem))
    assert {n for b in B.iter_buckets(named, 200 * elem, in_place=in_place, in_place_min=0) if b.in_place for n in b.names} \
        == {"p0", "p1", "p2", "p4", "p5"}


def test_in_place_skips_what_cannot_lie_flat():
    buf = torch.arange(40.0)
    named = [("t", buf[:20].view(4, 5).t()), ("a", buf[20:30]), ("b", buf[25:35])]  # non-contiguous; overlapping
    buckets = list(B.iter_buckets(named, 1 << 20, in_place=lambda t: True, in_place_min=0))
    got = {n: t for b in buckets for n, t in b.unpack()}
    assert all(torch.equal(got[n], t) for n, t in named)
    assert "t" not in {n for b in buckets if b.in_place for n in b.names}  # not contiguous: packed
    assert not any(b.in_place and b.names == ["a", "b"] for b in buckets)  # overlapping: never one flat run
