"""The vision quickstart learns to look: a shortened run of recipes/quickstart-vision.yaml on the local executor.

A tiny Qwen2.5-VL (tools/make-tiny-model --arch qwen2_5_vl) is trained with GRPO to name the colour of a picture
(relax_hpc/tasks/shapes.py): the images travel from the data through the engine's ``image_data`` and the exchange
(the image processor's outputs, written once) into the actor's forward. Checked: the reward rises; the looking
itself, on the recipe's held-out eval set (32 pictures of another seed, each colour 8 times): an answer that
ignores the image, whatever its letters, is right on 1/4 of them (sampled pass@1 mean 0.25, sd ~0.03 over its 256
samples), so a pass@1 far above that is the answer depending on the picture; every step's weights reach the
engine (fingerprint); one row of the data whose image is corrupt fails its own sample only, with its line and
reason, while the run completes.
"""

from __future__ import annotations

import base64
import json
import pytest

from relax_hpc.controller import run_controller

from .conftest import REPO, make_run, metrics

RECIPE = REPO / "recipes" / "quickstart-vision.yaml"
DATA = REPO / "recipes" / "data" / "shapes.jsonl"
HELDOUT = REPO / "recipes" / "data" / "shapes-eval.jsonl"
STEPS = 20  # 5 passes over the 128 rows (32 prompts a step): every row drawn, the bad one too
# Shortened: twice the recipe's prompts a step and 1.5 × its lr, so the looking shows within 20 steps (the recipe's
# 16 prompts at lr 0.005 need ~40; faster still collapses onto one letter now and then).
FASTER = ("rollout.rollout_batch_size=32", "train.lr=0.0075")
RISE = 0.2  # measured 0.15 -> 0.48; the looking itself is LOOKED's check
CHANCE = 0.25  # pass@1 of any answer that ignores the image, on the colour-balanced held-out set
LOOKED = 0.375  # held-out pass@1 at the end (measured 0.67): 1.5 × CHANCE, ~4 sd above it
BAD_ROW = 5  # 0-based: line 6 of the data copy


@pytest.mark.slow
def test_vision_quickstart_learns_and_a_corrupt_image_fails_only_its_sample(tmp_path, tiny_vlm, local_executor):
    rows = DATA.read_text().splitlines()
    bad = json.loads(rows[BAD_ROW])
    bad["images"] = [base64.b64encode(b"\x89PNG\r\n\x1a\n but then no image at all").decode()]
    rows[BAD_ROW] = json.dumps(bad)
    data = tmp_path / "shapes-one-bad.jsonl"
    data.write_text("\n".join(rows) + "\n")

    run = make_run(tmp_path, tiny_vlm, f"data.path={data}", f"run.steps={STEPS}", *FASTER,
                   f"rollout.eval_interval={STEPS}", f"data.eval_prompt_data.heldout={HELDOUT}", recipe=RECIPE,
                   name="vision")
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final

    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["state"] == "COMPLETED"
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary
    evals = {r["step"]: r for r in metrics(run) if "eval/heldout-pass@1" in r}
    assert sorted(evals) == [0, STEPS], evals  # before training, and after the last step
    assert evals[0]["eval/heldout-pass@1"] < CHANCE, evals[0]  # the untrained model answers over its vocabulary
    assert evals[STEPS]["eval/heldout-pass@1"] > LOOKED, evals[STEPS]  # it looks: chance is 0.25 without looking
    rows_m = [r for r in metrics(run) if "weights/fingerprint_match" in r]
    assert len(rows_m) >= STEPS - 1 and all(r["weights/fingerprint_match"] == 1.0 for r in rows_m), rows_m
    gaps = sorted(r["train/train_rollout_logprob_abs_diff"] for r in metrics(run)
                  if "train/train_rollout_logprob_abs_diff" in r)
    assert gaps and gaps[-1] < 1e-3, gaps  # the actor saw the engine's images (the failed sample's loss mask is 0:
    # its placeholder log-probs are not an engine's, and the gap leaves them out)

    log = (run.path / "logs" / "rollout.0.log").read_text()
    failed = [line for line in log.splitlines() if "its images cannot be used" in line]
    assert len(failed) >= 1 and all(f"line {BAD_ROW + 1}:" in line and "not an image" in line for line in failed), \
        failed
