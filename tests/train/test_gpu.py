"""The same jobs on a GPU (NCCL, no CPU layer): skipped on machines without CUDA.

On a GPU box ``cpu_compat`` stays inactive, so these run megatron-core and the bridge as upstream wrote
them (TE layers if transformer_engine is installed, else the local spec). Tolerances are looser than
on CPU because GPU kernels (and TE, if present) reduce in other orders.
"""

from __future__ import annotations

import pytest
import torch

from train.conftest import RESUME_ARGS, TRAIN_ARGS, part
from train.launch import run_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _nproc() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0


@pytest.mark.timeout(600)
def test_gpu_parity_train_resume(tiny_models, tmp_path):
    n = _nproc()
    ck = {"name": "gpu", "tp": n, "distopt": True, "ckpt": str(tmp_path / "ck")}
    jobs = {
        "parity": ["parity", {"tp": n, "models": tiny_models}],
        "train": ["train", dict(TRAIN_ARGS, hf=tiny_models["qwen3"], layouts=[{"tp": n}])],
        "save": ["resume", dict(RESUME_ARGS, mode="save", hf=tiny_models["qwen3"], layouts=[ck])],
    }
    res = run_job("suite", jobs, nproc=n, out_dir=tmp_path / "run", timeout=500)
    for arch, r in part(res, "parity").items():
        print(f"[gpu parity tp={n} {arch}] {r}")
        assert r["logits_max_diff"] <= 1e-4 and r["export_logits_max_diff"] <= 1e-4 and r["weights_max_diff"] == 0
    r = next(iter(part(res, "train").values()))
    losses = [s["loss"] for s in r["steps"]]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(c * a > 0 for a, c in zip(r["advantage"], r["logprob_change"]))
    ref = part(res, "save")["gpu"]
    got = run_job("resume", dict(RESUME_ARGS, mode="load", hf=tiny_models["qwen3"], layouts=[ck]),
                  nproc=n, out_dir=tmp_path / "load", timeout=400)["gpu"]
    assert got["step_after_load"] == RESUME_ARGS["k"]
    assert got["steps"] == ref["steps"]  # bit-identical on the same GPU layout
