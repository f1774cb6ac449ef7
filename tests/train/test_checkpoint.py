"""Must-show 3: save at step k, resume in a fresh process, and the next steps' losses and grad norms are
bit-identical to the uninterrupted run (DistributedOptimizer sharded over DP=2 included); a TP=2
checkpoint resumes at TP=1 (and a DP=2 DistributedOptimizer checkpoint at DP=1).

The uninterrupted runs (K steps, save, N more) are part of the ``multi_run`` launch (conftest).
Timeouts everywhere: a dist_checkpointing save that loses its writer process hangs instead of failing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from train.conftest import RESUME_ARGS, part, resume_layouts
from train.launch import run_job

pytestmark = [pytest.mark.slow]


def _resume(tiny_models, multi_run, *, nproc: int, tp: int | None, out: str) -> tuple[dict, dict]:
    ref = part(multi_run, "resume_save")
    root = Path(multi_run["ckpt_root"])
    layouts = [dict(l, tp=tp or l["tp"]) for l in resume_layouts(root)]
    args = dict(RESUME_ARGS, mode="load", hf=tiny_models["qwen3"], layouts=layouts)
    got = run_job("resume", args, nproc=nproc, out_dir=root / out, timeout=300)
    assert "error" not in got, got.get("error")
    return ref, got


@pytest.mark.timeout(600)
def test_resume_same_layout_is_bit_exact(tiny_models, multi_run):
    ref, got = _resume(tiny_models, multi_run, nproc=2, tp=None, out="load_same")
    for name in ("dp2", "tp2"):
        print(f"[resume {name}] uninterrupted (loss, grad_norm) {ref[name]['steps']}\n"
              f"[resume {name}] resumed                       {got[name]['steps']}"
              f"  (save {ref[name]['save_s']:.1f} s, load {got[name]['load_s']:.1f} s)")
        assert got[name]["extra"] == {"data_pos": RESUME_ARGS["k"], "note": "hello"}
        assert got[name]["step_after_load"] == RESUME_ARGS["k"]
        assert all(g > 0 for _, g in ref[name]["steps"])  # real updates, not all-clipped
        assert got[name]["steps"] == ref[name]["steps"]  # float equality: bit-identical


@pytest.mark.timeout(600)
def test_resume_at_tp1(tiny_models, multi_run):
    ref, got = _resume(tiny_models, multi_run, nproc=1, tp=1, out="load_tp1")  # tp2 -> tp1, dp2 -> dp1
    for name in ("dp2", "tp2"):
        worst = max(abs(a - b) for s, t in zip(ref[name]["steps"], got[name]["steps"]) for a, b in zip(s, t))
        print(f"[resume {name} -> TP=1, 1 rank] max |diff| of losses and grad norms vs uninterrupted: {worst:.2e}")
        assert got[name]["step_after_load"] == RESUME_ARGS["k"]
        assert worst <= 1e-5, (ref[name]["steps"], got[name]["steps"])
