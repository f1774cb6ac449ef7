"""A tiny Qwen2.5-VL through megatron-bridge gives transformers' per-token log-probs of a response given a video (a
list of frames) and a prompt (fp32, CPU, gloo), at TP=2 and TP=1 in one 2-process run; and one batch holds a row
with a video beside a row with an image, right-padded (transformers runs each row alone).

The video: 3 frames of 56×84 (odd: the processor repeats the last to fill its time steps of 2), grid (2, 4, 6), 12
video tokens, shown at multimodal.MODEL_FPS. This file is also the worker of that run (``python
tests/train/test_video_parity.py JOB OUT ARGS``, see ``launch.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOL = 1e-5
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = "<|im_start|>user\n{media}{q}<|im_end|>\n<|im_start|>assistant\n"
ROWS = [("video", "Which way?", "left<|im_end|>"), ("image", "Color?", "It is red.<|im_end|>")]
LAYOUTS = [{"name": "tp2", "tp": 2}, {"name": "tp1", "tp": 1}]


def _frames(n: int, h: int, w: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def _rows(hf: str) -> list[dict]:
    """Each row's processor inputs, its response start, and transformers' log-probs of its response."""
    import torch
    from transformers import AutoModelForImageTextToText

    from relax_hpc.multimodal import _tokenizer, encode_media_ids

    tok = _tokenizer(hf)
    hf_model = AutoModelForImageTextToText.from_pretrained(hf).eval()
    rows = []
    for kind, q, resp in ROWS:
        media = dict(videos=[_frames(3, 56, 84, 0)]) if kind == "video" else dict(images=_frames(1, 56, 56, 1))
        prompt = PROMPT.format(media=VIDEO if kind == "video" else IMAGE, q=q)
        enc = encode_media_ids(hf, tok.encode(prompt + resp, add_special_tokens=False), **media)
        start = encode_media_ids(hf, tok.encode(prompt, add_special_tokens=False), **media)["input_ids"].shape[1]
        with torch.no_grad():
            logits = hf_model(**enc).logits[0].float()
        ids = enc["input_ids"][0]
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0][start - 1:]
        rows.append(dict(enc, start=start, ref=ref))
    return rows


def job_video_parity(args: dict, out: Path) -> dict:
    """Per layout: build the VLM through the bridge, log-probs of both rows in one right-padded batch, max |Δ|
    against transformers; at TP 2 one backward (the video's grads reach the vision tower)."""
    import torch

    from relax_hpc.train import TrainConfig, cpu_compat
    from relax_hpc.train.parallel import destroy_parallel, init_parallel
    from relax_hpc.train.vlm import build_vlm, vlm_log_probs

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    hf = args["model"]
    rows = _rows(hf)
    res = {"n_video_tokens": int(rows[0]["video_grid_thw"].prod()) // 4, "grid": rows[0]["video_grid_thw"].tolist()}
    for layout in args["layouts"]:
        init_parallel(layout["tp"], 1, seed=0)
        built = build_vlm(hf, TrainConfig(tp=layout["tp"], pp=1, seed=0))
        model = built.chunks[0]
        model.eval()
        ids = torch.zeros(len(rows), max(r["input_ids"].shape[1] for r in rows), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, :r["input_ids"].shape[1]] = r["input_ids"][0]
        lps = vlm_log_probs(model, ids, rows[1]["pixel_values"], rows[1]["image_grid_thw"], [r["start"] for r in rows],
                            pixel_values_videos=rows[0]["pixel_values_videos"], video_grid_thw=rows[0]["video_grid_thw"])
        lps = [lp[:len(r["ref"])] for lp, r in zip(lps, rows)]
        r = {"max_diff": [float((lp.detach() - r["ref"]).abs().max()) for lp, r in zip(lps, rows)],
             "n_tokens": [len(lp) for lp in lps]}
        if layout["tp"] > 1:
            lps[0].sum().backward()  # the video row's alone: its grads come through the video's patches
            g = model.visual.patch_embed.proj.weight.grad
            r["visual_grad_norm"] = float(g.norm()) if g is not None else 0.0
        res[layout["name"]] = r
        del model, built
        destroy_parallel()
    return res


@pytest.fixture(scope="module")
def video_run(tmp_path_factory) -> dict:
    from train import launch
    from train.conftest import load_tiny_model_tool

    root = tmp_path_factory.mktemp("video")
    model = str(load_tiny_model_tool().make_tiny_model(root / "qwen2_5_vl", arch="qwen2_5_vl", seed=0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the ranks (see __main__)
        return launch.run_job("video_parity", {"model": model, "layouts": LAYOUTS}, nproc=2, out_dir=root / "run",
                              timeout=240)


@pytest.mark.timeout(300)
def test_video_logprobs_match_transformers_tp1_tp2(video_run):
    assert "error" not in video_run, video_run.get("error")
    assert video_run["grid"] == [[2, 4, 6]] and video_run["n_video_tokens"] == 12
    for layout in LAYOUTS:
        r = video_run[layout["name"]]
        print(f"[video parity {layout['name']}] log-probs max |Δ| vs transformers {r['max_diff']} over "
              f"{r['n_tokens']} response tokens")
        assert max(r["max_diff"]) <= TOL, r
        assert min(r["n_tokens"]) >= 2, r  # each row's response scored, its <|im_end|> too
    assert video_run["tp2"]["visual_grad_norm"] > 0


if __name__ == "__main__":  # one rank of the run above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(video_parity=job_video_parity)
