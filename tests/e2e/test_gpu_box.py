"""One GPU box, the whole loop (issue #29): the local quickstart on a machine with one CUDA device.

The actor and the reference engine both put themselves on GPU 0; the sender sees the engine on its own GPU and
sends the weights by ``/update_weights_from_tensor`` (CUDA IPC), and the engine hands its memory over while the
actor trains (``rollout.engine.offload`` left at auto). Skipped without CUDA; ``tools/gpu-check`` runs it.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from relax_hpc.controller import run_controller

from .conftest import make_run, metrics, state
from .test_quickstart import RISE

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
STEPS = 30


def test_the_quickstart_completes_and_learns_on_one_gpu(tmp_path, tiny_model, local_executor):
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", name="gpu-box")
    t0 = time.monotonic()
    final = run_controller(run.path)
    wall = time.monotonic() - t0
    assert final["state"] == "COMPLETED", final
    summary = json.loads((run.path / "summary.json").read_text())
    first, last = summary["reward_first10"], summary["reward_last10"]
    assert last > first + RISE, f"reward did not rise on the GPU: {first:.3f} -> {last:.3f}"
    said = [e["detail"] for e in state(run)["events"] if e["event"] == "weights"]
    assert said and "CUDA IPC" in said[0], said  # chosen by itself: the engine is on the actor's GPU
    calls = re.findall(r"INFO call (/\w+)", (run.path / "logs" / "engine0.log").read_text())
    assert calls.count("/release_memory_occupation") == STEPS and "/update_weights_from_distributed" not in calls
    rows = metrics(run)
    assert all(r["weights/fingerprint_match"] == 1.0 and "perf/engine_release_time" in r for r in rows)
    print(f"gpu box: {STEPS} steps, reward {first:.3f} -> {last:.3f}, {wall:.0f} s")
