"""The one bucket wire (relax_hpc.engines.bucket_wire) against SGLang's own FlattenedTensorBucket (run by
sglang_side/check_weights.py): a bucket of several dtypes laid out by bucket_wire is read back by SGLang's receive
buffer and reconstruction as the tensors it holds, and the layout bucket_wire refuses (a tensor whose byte offset is
not a multiple of its dtype's size) SGLang refuses too."""

from __future__ import annotations

import json

import pytest
import torch

from contract_support import run_sglang
from relax_hpc.engines import bucket_wire


def test_mixed_dtype_layout_is_sglangs(sglang_python, tmp_path):
    named = [("model.a", torch.tensor([1.5, -2.0, 0.25])), ("model.b", torch.tensor([[3, -4]], dtype=torch.int16)),
             ("model.c", torch.tensor([0.5, 7.0], dtype=torch.bfloat16)), ("model.d", torch.tensor([True, False])),
             ("model.e", torch.tensor([9, 8, 7], dtype=torch.uint8))]
    flat, metas = bucket_wire.pack(named)
    torch.save(dict(named), tmp_path / "expected.pt")
    (tmp_path / "flat-0.bin").write_bytes(flat.numpy().tobytes())
    unaligned = [["model.x", "model.y"], ["bfloat16", "float32"], [[3], [2]]]
    with pytest.raises(ValueError, match="would start at byte 6"):
        bucket_wire.plan(bucket_wire.announced(*unaligned))
    (tmp_path / "flat-1.bin").write_bytes(bytes(14))  # what a sender packing bytes end to end would send
    (tmp_path / "flat.json").write_text(json.dumps([
        {"names": [m.name for m in metas], "dtypes": [bucket_wire.dtype_name(m.dtype) for m in metas],
         "shapes": [list(m.shape) for m in metas]},
        dict(zip(("names", "dtypes", "shapes"), unaligned))]))
    r = run_sglang(sglang_python, "check_weights.py", str(tmp_path))
    assert r.stdout.strip(), f"check_weights.py printed nothing (exit {r.returncode}):\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["read"]["flattened_bucket"] == sorted(n for n, _ in named)
    assert len(out["problems"]) == 1 and out["problems"][0].startswith("bucket 1: ValueError: Unaligned"), out
