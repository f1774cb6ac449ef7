"""The video quickstart learns to watch: a shortened run of recipes/quickstart-video.yaml on the local executor.

A tiny Qwen2.5-VL (tools/make-tiny-model --arch qwen2_5_vl) is trained with GRPO to tell which way a square moves
across 4 frames (relax_hpc/tasks/dots.py): the frames travel from the data through the engine's ``video_data`` and
the exchange (the image processor's ``pixel_values_videos`` and ``video_grid_thw``, written once) into the actor's
forward. Checked: the reward rises; the watching itself, on the recipe's held-out set (32 videos of another seed,
each way 8 times): an answer that does not watch, whatever its letters, is right on 1/4 of them, so a pass@1 far
above that is the answer depending on the video; the actor's log-probs are the engine's (it saw the same frames);
one row whose frame is corrupt fails its own sample only, with its line and reason, while the run completes. The
run and its checks are the vision test's (looking.py); the model is the session's ``tiny_vlm`` (tests/conftest.py).
"""

from __future__ import annotations

import base64

import pytest

from . import looking
from .conftest import REPO

RECIPE = REPO / "recipes" / "quickstart-video.yaml"
DATA = REPO / "recipes" / "data" / "dots.jsonl"
HELDOUT = REPO / "recipes" / "data" / "dots-eval.jsonl"
STEPS = 30  # the recipe's 60 shortened (looking.FASTER); measured held-out pass@1 0.42 at the end (docs/multimodal.md)


def _frame_2_not_an_image(row: dict) -> None:
    row["video"][2] = base64.b64encode(b"\x89PNG\r\n\x1a\n but then no frame at all").decode()


@pytest.mark.slow
def test_video_quickstart_learns_and_a_corrupt_frame_fails_only_its_sample(tmp_path, tiny_vlm, local_executor):
    data = looking.one_bad_row(DATA, tmp_path, _frame_2_not_an_image)
    run = looking.shortened_run(tmp_path, tiny_vlm, RECIPE, data, HELDOUT, STEPS, name="video")
    looking.assert_learned_to_look(run, STEPS)
    looking.assert_only_its_sample_failed(run, "its videos cannot be used", "frame 2: not an image")
