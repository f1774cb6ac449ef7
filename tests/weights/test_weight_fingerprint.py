"""Weight fingerprints (pure)."""

from __future__ import annotations

import torch

from relax_hpc.weights.fingerprint import engine_fingerprint, fingerprint


def test_fingerprint_exact_and_order_free():
    a = {"x": torch.randn(4, 3), "y": torch.randn(7).to(torch.bfloat16)}
    assert fingerprint(a) == fingerprint(list(reversed(list(a.items()))))
    assert fingerprint(a) == fingerprint({"x": a["x"].clone(), "y": a["y"].clone()})
    b = dict(a, x=a["x"].clone())
    b["x"][1, 2] = torch.nextafter(b["x"][1, 2], torch.tensor(float("inf")))  # one ulp
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) != fingerprint({"x": a["x"], "z": a["y"]})  # names count
    assert fingerprint({"x": torch.zeros(2, 3)}) != fingerprint({"x": torch.zeros(3, 2)})  # shapes count
    # values, not storage dtype: a bf16 tensor and its exact float32 copy agree (what JSON from an engine gives)
    assert fingerprint({"y": a["y"]}) == fingerprint({"y": a["y"].float()})


def test_engine_fingerprint_from_json_rows():
    t = {"w": torch.randn(5, 3), "b": torch.randn(4)}

    class FakeEngine:  # /get_weights_by_name: param[:truncate_size] as nested float lists
        def get_weights_by_name(self, name, truncate_size=100):
            return t[name][:truncate_size].float().tolist()

    assert engine_fingerprint(FakeEngine(), ["w", "b"]) == fingerprint(t)
