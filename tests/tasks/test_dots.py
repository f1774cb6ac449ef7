"""The video quickstart's task: videos drawn per seed, the square moving the labelled way edge to edge, ways balanced
per block of 4 (tasks/balanced.py, shared with shapes and tones), the committed data files the CLI's output, the
reward, and the rows read through the data path with the tiny Qwen2.5-VL (8 video pads)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

from relax_hpc.tasks import dots
from relax_hpc.tasks.balanced import balanced_answer
from tests.rollout.conftest import REPO, _tiny_model_maker


def _centre(frame_b64: str) -> tuple[float, float]:
    from PIL import Image

    f = np.asarray(Image.open(io.BytesIO(base64.b64decode(frame_b64))).convert("L"))
    ys, xs = np.nonzero(f > 128)
    return float(xs.mean()), float(ys.mean())


def test_videos_are_the_same_per_seed_move_the_labelled_way_and_are_balanced():
    a = dots.rows(12, seed=3)
    assert a == dots.rows(12, seed=3) and a != dots.rows(12, seed=4)
    for block in range(3):
        assert sorted(r["label"] for r in a[4 * block: 4 * block + 4]) == ["d", "l", "r", "u"]
    orders = {tuple(r["label"] for r in dots.rows(40, seed=0)[4 * k: 4 * k + 4]) for k in range(10)}
    assert len(orders) > 1  # the order is drawn per block
    for r in a:
        assert len(r["video"]) == dots.FRAMES
        (x0, y0), (x1, y1) = _centre(r["video"][0]), _centre(r["video"][-1])
        dx, dy = dots.WAYS[r["label"]]
        assert (x1 - x0, y1 - y0) == (dx * (dots.SIZE - dots.SIDE), dy * (dots.SIZE - dots.SIDE)), r["label"]


def test_balanced_answer_refuses_an_order_that_is_not_a_permutation():
    assert [balanced_answer("abc", i, lambda k: [2, 0, 1]) for i in range(6)] == list("cabcab")
    with pytest.raises(ValueError, match="not a permutation"):
        balanced_answer("abc", 0, lambda k: [0, 0, 1])


def test_committed_data_files_are_the_clis_output(tmp_path):
    for name, n, seed in (("dots.jsonl", 128, 0), ("dots-eval.jsonl", 32, 1)):
        out = tmp_path / name
        assert dots.main([str(out), "--n", str(n), "--seed", str(seed)]) == 0
        assert out.read_text() == (REPO / "recipes" / "data" / name).read_text()


def test_reward():
    run = lambda resp, label: asyncio.run(dots.reward_func(None, SimpleNamespace(response=resp, label=label)))  # noqa: E731
    assert run("l", "l") == 1.0 and run("r", "l") == dots.PARTIAL and run("x", "l") == 0.0 and run("", "l") == 0.0


def test_rows_through_the_data_path(tmp_path):
    from relax_hpc.multimodal import VIDEO_PAD, token_id
    from relax_hpc.rollout.data import DataKeys, PromptDataset

    vlm = _tiny_model_maker()(tmp_path / "vlm", arch="qwen2_5_vl", seed=0)
    assert dots.main([str(tmp_path / "d.jsonl"), "--n", "4", "--frame-dir", str(tmp_path / "frames")]) == 0
    assert json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])["video"][0].startswith("frames/")
    ds = PromptDataset(tmp_path / "d.jsonl", keys=DataKeys(input_key="prompt", label_key="label", video_key="video"),
                       tokenizer=str(vlm))
    s = ds[0]
    assert s.tokens.count(token_id(vlm, VIDEO_PAD)) == 8 and len(s.multimodal_inputs["videos"][0]) == dots.FRAMES
