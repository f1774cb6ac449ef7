"""The video quickstart learns to watch: a shortened run of recipes/quickstart-video.yaml on the local executor.

A tiny Qwen2.5-VL (tools/make-tiny-model --arch qwen2_5_vl) is trained with GRPO to tell which way a square moves
across 4 frames (relax_hpc/tasks/dots.py): the frames travel from the data through the engine's ``video_data`` and
the exchange (the image processor's ``pixel_values_videos`` and ``video_grid_thw``, written once) into the actor's
forward. Checked: the reward rises; the watching itself, on the recipe's held-out set (32 videos of another seed,
each way 8 times): an answer that does not watch, whatever its letters, is right on 1/4 of them, so a pass@1 far
above that is the answer depending on the video; the actor's log-probs are the engine's (it saw the same frames);
one row whose frame is corrupt fails its own sample only, with its line and reason, while the run completes.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from relax_hpc.controller import run_controller

from .conftest import REPO, make_run, make_tiny_model, metrics

RECIPE = REPO / "recipes" / "quickstart-video.yaml"
DATA = REPO / "recipes" / "data" / "dots.jsonl"
HELDOUT = REPO / "recipes" / "data" / "dots-eval.jsonl"
STEPS = 30  # the recipe's 60 shortened: twice its prompts a step and 1.5 × its lr
FASTER = ("rollout.rollout_batch_size=32", "train.lr=0.0075")
RISE = 0.2
CHANCE = 0.25  # pass@1 of any answer that does not watch, on the way-balanced held-out set
WATCHED = 0.375  # held-out pass@1 at the end: 1.5 × CHANCE
BAD_ROW = 5  # 0-based: line 6 of the data copy


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """The video quickstart's model: tools/make-tiny-model --arch qwen2_5_vl --seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("e2e-vlm") / "tiny-qwen2_5_vl", arch="qwen2_5_vl", seed=0)


@pytest.mark.slow
def test_video_quickstart_learns_and_a_corrupt_frame_fails_only_its_sample(tmp_path, tiny_vlm, local_executor):
    rows = DATA.read_text().splitlines()
    bad = json.loads(rows[BAD_ROW])
    bad["video"][2] = base64.b64encode(b"\x89PNG\r\n\x1a\n but then no frame at all").decode()
    rows[BAD_ROW] = json.dumps(bad)
    data = tmp_path / "dots-one-bad.jsonl"
    data.write_text("\n".join(rows) + "\n")

    run = make_run(tmp_path, tiny_vlm, f"data.path={data}", f"run.steps={STEPS}", *FASTER,
                   f"rollout.eval_interval={STEPS}", f"data.eval_prompt_data.heldout={HELDOUT}", recipe=RECIPE,
                   name="video")
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final

    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["state"] == "COMPLETED"
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary
    evals = {r["step"]: r for r in metrics(run) if "eval/heldout-pass@1" in r}
    assert sorted(evals) == [0, STEPS], evals
    assert evals[0]["eval/heldout-pass@1"] < CHANCE, evals[0]  # the untrained model answers over its vocabulary
    assert evals[STEPS]["eval/heldout-pass@1"] > WATCHED, evals[STEPS]  # it watches: chance is 0.25 without
    gaps = sorted(r["train/train_rollout_logprob_abs_diff"] for r in metrics(run)
                  if "train/train_rollout_logprob_abs_diff" in r)
    assert gaps and gaps[-1] < 1e-3, gaps  # the actor saw the engine's frames

    log = (run.path / "logs" / "rollout.0.log").read_text()
    failed = [line for line in log.splitlines() if "its videos cannot be used" in line]
    assert len(failed) >= 1 and all(f"line {BAD_ROW + 1}:" in line and "frame 2: not an image" in line
                                    for line in failed), failed
