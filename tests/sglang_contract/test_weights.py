"""The weight payloads relax_hpc builds, read back by SGLang's own code (sglang_side/check_weights.py): the
``/update_weights_from_tensor`` entries (relax_hpc's buckets, serialized by :func:`relax_hpc.engines.tensor_wire.
serialize_named`, as :meth:`relax_hpc.weights.sync.WeightSync._hand_all` sends them) through SGLang's deserializer,
and the flat buckets of ``/update_weights_from_distributed`` (``load_format="flattened_bucket"``) through SGLang's
receive buffer and flattened-bucket reconstruction. Every tensor must come back as the actor's: name, shape, dtype,
values."""

from __future__ import annotations

import json

import pytest
import torch

from contract_support import run_sglang
from relax_hpc.engines.tensor_wire import serialize_named
from relax_hpc.weights.buckets import iter_buckets


def actor_weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(8, 4, generator=g).to(torch.bfloat16)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16)),
            ("model.layers.0.input_layernorm.weight", torch.randn(4, generator=g)),  # float32
            ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(3, generator=g).to(torch.float16)),
            ("lm_head.weight", torch.randn(8, 4, generator=g).to(torch.bfloat16))]


def write_payloads(d, named, *, corrupt_dtype: bool = False):
    """relax_hpc's payloads for ``named`` into ``d`` (64-byte buckets: several per dtype); the buckets are returned
    and must stay alive until SGLang read the tensor entries (they point into their shared memory)."""
    torch.save({n: t for n, t in named}, d / "expected.pt")
    buckets = list(iter_buckets(iter(named), 64))
    assert len(buckets) > 3 and {b.dtype for b in buckets} == {torch.bfloat16, torch.float32, torch.float16}
    (d / "tensor.json").write_text(json.dumps([serialize_named(b.unpack()) for b in buckets]))
    flat = []
    for k, b in enumerate(buckets):
        dtypes = b.dtypes
        if corrupt_dtype and b.dtype == torch.bfloat16:
            dtypes = ["float16"] * len(dtypes)  # the negative control: a bucket announced with the wrong dtype
        flat.append({"names": b.names, "dtypes": dtypes, "shapes": b.shapes})
        (d / f"flat-{k}.bin").write_bytes(b.flat.contiguous().view(torch.uint8).numpy().tobytes())
    (d / "flat.json").write_text(json.dumps(flat))
    return buckets


def check(sglang_python, d) -> tuple[int, dict]:
    r = run_sglang(sglang_python, "check_weights.py", str(d))
    assert r.stdout.strip(), f"check_weights.py printed nothing (exit {r.returncode}):\n{r.stderr[-3000:]}"
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])


def test_tensor_entries_and_flat_buckets_read_back_by_sglang(sglang_python, tmp_path):
    named = actor_weights()
    buckets = write_payloads(tmp_path, named)
    rc, out = check(sglang_python, tmp_path)
    assert rc == 0 and out["problems"] == [], out["problems"]
    names = sorted(n for n, _ in named)
    assert out["read"] == {"tensor": names, "flattened_bucket": names}
    del buckets


def test_wrong_dtype_in_a_bucket_fails(sglang_python, tmp_path):
    """Negative control: a bucket announced as float16 while its buffer holds bfloat16 comes back wrong from SGLang's
    reconstruction, and the check says which tensor."""
    buckets = write_payloads(tmp_path, actor_weights(), corrupt_dtype=True)
    rc, out = check(sglang_python, tmp_path)
    assert rc == 1
    assert any("model.embed_tokens.weight came back torch.float16" in p for p in out["problems"]), out["problems"]
    assert not any(p.startswith("tensor entry") for p in out["problems"])  # the tensor path was not corrupted
    del buckets


def test_tensor_entry_refused_when_not_a_tensor_list(sglang_python, tmp_path):
    """Negative control for the deserializer: an entry that pickles something other than tensors (here a foreign
    global) is refused by SGLang's restricted unpickler, and the check reports it."""
    import base64
    import pickle

    torch.save({}, tmp_path / "expected.pt")
    (tmp_path / "tensor.json").write_text(json.dumps([base64.b64encode(pickle.dumps([("x", pytest.approx)])).decode()]))
    rc, out = check(sglang_python, tmp_path)
    assert rc == 1 and "cannot deserialize" in out["problems"][0], out
