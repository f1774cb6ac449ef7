"""The vision quickstart learns: a shortened run of recipes/quickstart-vision.yaml on the local executor.

A tiny Qwen2.5-VL (tools/make-tiny-model --arch qwen2_5_vl) is trained with GRPO to name the colour or the shape of
a picture (relax_hpc/tasks/shapes.py): the images travel from the data through the engine's ``image_data`` and the
exchange (the image processor's outputs, written once) into the actor's forward. Checked: the reward rises well
above its start (the text alone cannot tell the answer), every step's weights reach the engine (fingerprint), and
one row of the data whose image is corrupt fails its own sample only, with its line and reason, while the run
completes.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from relax_hpc.controller import run_controller

from .conftest import REPO, make_run, make_tiny_model, metrics

RECIPE = REPO / "recipes" / "quickstart-vision.yaml"
DATA = REPO / "recipes" / "data" / "shapes.jsonl"
STEPS = 20  # 2.5 passes over the 128 rows (16 prompts a step): every row drawn, the bad one too
RISE = 0.15
BAD_ROW = 5  # 0-based: line 6 of the data copy


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """The vision quickstart's model: tools/make-tiny-model --arch qwen2_5_vl --seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("e2e-vlm") / "tiny-qwen2_5_vl", arch="qwen2_5_vl", seed=0)


@pytest.mark.slow
def test_vision_quickstart_learns_and_a_corrupt_image_fails_only_its_sample(tmp_path, tiny_vlm, local_executor):
    rows = DATA.read_text().splitlines()
    bad = json.loads(rows[BAD_ROW])
    bad["images"] = [base64.b64encode(b"\x89PNG\r\n\x1a\n but then no image at all").decode()]
    rows[BAD_ROW] = json.dumps(bad)
    data = tmp_path / "shapes-one-bad.jsonl"
    data.write_text("\n".join(rows) + "\n")

    run = make_run(tmp_path, tiny_vlm, f"data.path={data}", f"run.steps={STEPS}", recipe=RECIPE, name="vision")
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final

    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["state"] == "COMPLETED"
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary
    rows_m = [r for r in metrics(run) if "weights/fingerprint_match" in r]
    assert len(rows_m) >= STEPS - 1 and all(r["weights/fingerprint_match"] == 1.0 for r in rows_m), rows_m
    gaps = sorted(r["train/train_rollout_logprob_abs_diff"] for r in metrics(run)
                  if "train/train_rollout_logprob_abs_diff" in r)
    assert gaps and gaps[len(gaps) // 2] < 1e-3, gaps  # the actor saw the engine's images (a step holding the failed
    # sample counts its placeholder log-prob 0 against the actor's)

    log = (run.path / "logs" / "rollout.0.log").read_text()
    failed = [line for line in log.splitlines() if "its images cannot be used" in line]
    assert len(failed) >= 1 and all(f"line {BAD_ROW + 1}:" in line and "not an image" in line for line in failed), \
        failed
