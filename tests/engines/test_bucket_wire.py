"""The one bucket wire (relax_hpc.engines.bucket_wire): the sender's packed bytes and metadata, pinned to what the
code before it produced (weights/buckets.py), and the receivers' layout of an announcement, pinned to what the CPU
engine's receiver computed (engines/receiver.py). The pinned values were taken from that code before it was
replaced; a change of layout changes them."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.engines import bucket_wire as W
from relax_hpc.weights.buckets import iter_buckets


def f32_named():
    return [("a", (torch.arange(6, dtype=torch.float32) / 4 - 0.5).view(2, 3)),
            ("b", torch.tensor([1.0, -2.0, 3.5, 1e-3], dtype=torch.float32))]


def bf16_named():
    return [("w", torch.tensor([[1.5, -2.0], [0.25, 3.0]], dtype=torch.bfloat16)),
            ("v", torch.tensor([7.0, -0.125, 0.0], dtype=torch.bfloat16))]


# (flat bytes as hex, metadata, announced names/dtypes/shapes) as the old weights/buckets.py packed them
OLD_SENDER = {
    "f32": ("000000bf000080be000000000000803e0000003f0000403f0000803f000000c0000060406f12833a",
            [{"name": "a", "shape": [2, 3], "dtype": "float32", "start_idx": 0, "end_idx": 6, "numel": 6},
             {"name": "b", "shape": [4], "dtype": "float32", "start_idx": 6, "end_idx": 10, "numel": 4}],
            (["a", "b"], ["float32", "float32"], [[2, 3], [4]])),
    "bf16": ("c03f00c0803e4040e04000be0000",
             [{"name": "w", "shape": [2, 2], "dtype": "bfloat16", "start_idx": 0, "end_idx": 4, "numel": 4},
              {"name": "v", "shape": [3], "dtype": "bfloat16", "start_idx": 4, "end_idx": 7, "numel": 3}],
             (["w", "v"], ["bfloat16", "bfloat16"], [[2, 2], [3]])),
}
# an announcement of mixed dtypes (SGLang 0.5.23 takes them): the buffer length and each tensor's byte range, as the
# old CPU engine's receiver cut the received bytes
MIXED = (["m0", "m1", "m2", "m3", "m4"], ["float32", "bfloat16", "float16", "float32", "int8"],
         [[2], [3, 1], [], [0, 4], [5]])
OLD_RECEIVER_MIXED = (21, [(0, 8), (8, 14), (14, 16), (16, 16), (16, 21)])


@pytest.mark.parametrize("key, named", [("f32", f32_named()), ("bf16", bf16_named())])
def test_sender_bytes_and_metadata_are_the_old_ones(key, named):
    hexbytes, meta, announce = OLD_SENDER[key]
    flat, metas = W.pack(named)
    assert flat.view(torch.uint8).numpy().tobytes().hex() == hexbytes
    assert [m.to_json() for m in metas] == meta
    (b,) = list(iter_buckets(named))  # the sender's whole path: the same bytes and the same announcement
    assert b.flat.contiguous().view(torch.uint8).numpy().tobytes().hex() == hexbytes
    assert (b.names, b.dtypes, b.shapes) == announce and [m.to_json() for m in b.metadata] == meta
    # the receiving side, from the announcement alone, lays it out the same and cuts the same tensors back
    recv = W.plan(W.announced(*announce))
    assert recv == metas and W.nbytes(recv) == len(hexbytes) // 2
    buf = W.empty_flat(recv)
    buf.view(torch.uint8).copy_(torch.frombuffer(bytearray.fromhex(hexbytes), dtype=torch.uint8))  # the broadcast
    got = W.unpack(buf, recv)
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(t.dtype == x.dtype and torch.equal(t, x) for (_, t), (_, x) in zip(got, named))


def test_receiver_layout_of_mixed_dtypes_is_the_old_cpu_engines():
    total, ranges = OLD_RECEIVER_MIXED
    metas = W.plan(W.announced(*MIXED))
    assert W.nbytes(metas) == total and [(m.byte_start, m.byte_end) for m in metas] == ranges
    flat = W.empty_flat(metas)
    assert flat.dtype == torch.uint8 and flat.numel() == total  # several dtypes: received as bytes
    flat.copy_(torch.arange(total, dtype=torch.uint8))
    for (name, t), m, (a, b), d, s in zip(W.unpack(flat, metas), metas, ranges, MIXED[1], MIXED[2]):
        assert name == m.name and t.dtype == getattr(torch, d) and list(t.shape) == s
        assert t.reshape(-1).view(torch.uint8).tolist() == list(range(a, b)), name


def test_mixed_dtype_pack_and_unpack_agree():
    """The wire takes several dtypes (the sender's buckets keep one): packed as bytes, cut back exactly."""
    named = [("x", torch.tensor([1.0, -2.5])), ("y", torch.tensor([[3, 4, 5]], dtype=torch.int16)),
             ("z", torch.tensor(True)), ("u", torch.tensor([7, 8, 9], dtype=torch.uint8))]
    flat, metas = W.pack(named)
    assert flat.dtype == torch.uint8 and flat.numel() == 8 + 6 + 1 + 3 == W.nbytes(metas)
    assert metas == W.plan(W.announced([n for n, _ in named], [W.dtype_name(t.dtype) for _, t in named],
                                       [list(t.shape) for _, t in named]))
    for (n, t), (m, x) in zip(W.unpack(flat, metas), named):
        assert n == m and t.dtype == x.dtype and torch.equal(t, x)


def test_single_tensor_is_viewed_and_out_buffer_reused():
    t = torch.randn(3, 4)
    flat, _ = W.pack([("t", t)])
    assert flat.data_ptr() == t.data_ptr()
    out = torch.zeros(32)
    flat, metas = W.pack(f32_named(), out=out)
    assert flat.data_ptr() == out.data_ptr() and flat.numel() == 10
    with pytest.raises(ValueError, match="≥ 10 elements"):
        W.pack(f32_named(), out=torch.zeros(9))


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"'m1' \(float32\) would start at byte 6, not a multiple of 4"):
        W.plan(W.announced(["m0", "m1"], ["bfloat16", "float32"], [[3], [2]]))  # SGLang refuses it too
    with pytest.raises(ValueError, match="'w' has a negative dimension"):
        W.announced(["w"], ["float32"], [[2, -1]])
    with pytest.raises(ValueError, match="unknown dtype 'float77'"):
        W.announced(["w"], ["float77"], [[2]])
    with pytest.raises(ValueError, match=r"equally long \(2, 1, 1\)"):
        W.announced(["w", "v"], ["float32"], [[2]])
    with pytest.raises(ValueError, match="non-empty"):
        W.announced([], [], [])
    with pytest.raises(ValueError, match="needs 40 bytes, the buffer has 36"):
        W.unpack(torch.zeros(9), W.pack(f32_named())[1])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        W.unpack(torch.zeros(20)[::2], W.plan([("a", (2,), torch.float32)]))
