"""A tiny Qwen2.5-VL and a tiny Qwen3-VL through megatron-bridge give transformers' per-token log-probs of a
response given an image and a prompt (fp32, CPU, gloo), at TP=2 (with and without sequence parallelism) and TP=1
in one 2-process run; the bridge exports the HF weights back unchanged.

Two rows of different lengths in one batch (a 2×3-merged-patch image: 6 image tokens — for Qwen2.5-VL its two
vision-tower windows exercise the windowed attention — and a 2×2 one: 4 tokens), right-padded; transformers runs
each row alone.
This file is also the worker of that run (``python tests/train/test_vlm_parity.py JOB OUT ARGS``, see
``launch.py``): its ``vlm_parity`` job is added to ``worker.py``'s jobs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOL = 1e-5
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{q}<|im_end|>\n<|im_start|>assistant\n"
ARCHS = ("qwen2_5_vl", "qwen3_vl")
LAYOUTS = [{"name": "tp2", "tp": 2}, {"name": "tp2_sp", "tp": 2, "sp": True}, {"name": "tp1", "tp": 1}]
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # pixels per patch side
ROWS = [  # (image height, width in patches), image seed, question, response
    ((4, 6), 0, "What's 3+4?", "It is 7.<|im_end|>"), ((4, 4), 1, "Color?", "red<|im_end|>")]


def _image(hw, seed):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*hw, 3), dtype=np.uint8))


def _rows(arch: str, hf: str) -> list[dict]:
    """Each row's processor inputs, its response start, and transformers' log-probs of its response."""
    import torch
    from transformers import AutoModelForImageTextToText

    from relax_hpc.train.vlm import encode

    hf_model = AutoModelForImageTextToText.from_pretrained(hf).eval()
    rows = []
    for (h, w), seed, q, resp in ROWS:
        img = _image((h * PATCH[arch], w * PATCH[arch]), seed)
        enc = encode(hf, PROMPT.format(q=q) + resp, [img])
        start = encode(hf, PROMPT.format(q=q), [img])["input_ids"].shape[1]
        with torch.no_grad():
            logits = hf_model(**enc).logits[0].float()
        ids = enc["input_ids"][0]
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0][start - 1:]
        rows.append(dict(enc, start=start, ref=ref))
    return rows


def _batch(rows: list[dict]):
    """The rows right-padded (pad id 0) into one [B, S] batch (S odd: vlm_log_probs pads it for sequence
    parallelism), their images' patches and grids in row order."""
    import torch

    ids = torch.zeros(len(rows), max(r["input_ids"].shape[1] for r in rows), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :r["input_ids"].shape[1]] = r["input_ids"][0]
    return ids, torch.cat([r["pixel_values"] for r in rows]), torch.cat([r["image_grid_thw"] for r in rows])


def job_vlm_parity(args: dict, out: Path) -> dict:
    """Per layout and model: build the VLM through the bridge, log-probs of both rows in one right-padded batch,
    max |Δ| against transformers; at TP>1 also one backward (grads reach the vision tower)."""
    import torch
    import torch.distributed as dist

    from safetensors.torch import load_file

    from relax_hpc.train import TrainConfig, cpu_compat
    from relax_hpc.train.export import named_hf_weights
    from relax_hpc.train.parallel import destroy_parallel, init_parallel
    from relax_hpc.train.vlm import build_vlm, vlm_log_probs

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    rows = {arch: _rows(arch, hf) for arch, hf in args["models"].items()}
    res = {arch: {"n_image_tokens": [int(r["image_grid_thw"].prod()) // 4 for r in rs]} for arch, rs in rows.items()}
    for layout in args["layouts"]:
        tp, sp = layout["tp"], layout.get("sp", False)
        init_parallel(tp, 1, seed=0)
        for arch, hf in args["models"].items():
            built = build_vlm(hf, TrainConfig(tp=tp, pp=1, seed=0, sequence_parallel=sp))
            model = built.chunks[0]
            model.eval()
            # the bridge's export (weight sync, HF checkpoints): every HF tensor back, TP shards gathered
            ref_w, got_w = load_file(f"{hf}/model.safetensors"), dict(named_hf_weights(built.bridge, built.chunks))
            export = {"missing": sorted(set(ref_w) ^ set(got_w)), "n": len(got_w),
                      "max_diff": max(float((got_w[k] - ref_w[k]).abs().max()) for k in set(ref_w) & set(got_w))}
            ids, pixels, thw = _batch(rows[arch])
            lps = vlm_log_probs(model, ids, pixels, thw, [r["start"] for r in rows[arch]])
            lps = [lp[:len(r["ref"])] for lp, r in zip(lps, rows[arch])]
            r = {"max_diff": max(float((lp.detach() - r["ref"]).abs().max()) for lp, r in zip(lps, rows[arch])),
                 "mean_logprob": float(torch.cat(lps).mean()), "n_tokens": sum(len(lp) for lp in lps),
                 "export": export}
            if tp > 1 and not sp:
                torch.cat(lps).sum().backward()
                tower = model.visual if arch == "qwen2_5_vl" else model.vision_model
                g = tower.patch_embed.proj.weight.grad
                norms = [None] * dist.get_world_size()
                dist.all_gather_object(norms, float(g.norm()) if g is not None else 0.0)
                r["visual_grad_norms"] = norms
            res[arch][layout["name"]] = r
            del model, built
        destroy_parallel()
    return res


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory) -> dict:
    from train import launch
    from train.conftest import load_tiny_model_tool

    root = tmp_path_factory.mktemp("vlm")
    tool = load_tiny_model_tool()
    models = {arch: str(tool.make_tiny_model(root / arch, arch=arch, seed=0)) for arch in ARCHS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the ranks (see __main__)
        return launch.run_job("vlm_parity", {"models": models, "layouts": LAYOUTS}, nproc=2,
                              out_dir=root / "run", timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_vlm_logprobs_match_transformers_tp1_tp2(vlm_run, arch):
    """TP=1, TP=2, and TP=2 with sequence parallelism (the bridge's VLMs scatter the merged embeddings)."""
    assert "error" not in vlm_run, vlm_run.get("error")
    res = vlm_run[arch]
    assert res["n_image_tokens"] == [6, 4]
    for layout in LAYOUTS:
        r = res[layout["name"]]
        print(f"[vlm parity {arch} {layout['name']}] log-probs max |Δ| vs transformers {r['max_diff']:.2e} over "
              f"{r['n_tokens']} response tokens (mean log p {r['mean_logprob']:.4f})")
        assert r["max_diff"] <= TOL, r
        assert r["n_tokens"] == len("It is 7.") + 1 + len("red") + 1
    assert abs(res["tp1"]["mean_logprob"] - res["tp2"]["mean_logprob"]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_vlm_export_gives_the_hf_weights_back(vlm_run, arch):
    """megatron-bridge's export (what weight sync and HF checkpoints use) returns every tensor of the HF file,
    vision tower included, unchanged, at TP=1 and TP=2."""
    for layout in LAYOUTS:
        e = vlm_run[arch][layout["name"]]["export"]
        assert not e["missing"] and e["n"] > 50 and e["max_diff"] == 0.0, (layout, e)


@pytest.mark.parametrize("arch", ARCHS)
def test_vlm_backward_reaches_vision_tower(vlm_run, arch):
    """The vision tower is replicated over TP: each rank gets the same, nonzero grad from the same batch."""
    norms = vlm_run[arch]["tp2"]["visual_grad_norms"]
    assert norms[0] > 0 and abs(norms[0] - norms[1]) <= 1e-6 * norms[0], norms


def test_build_vlm_refuses_what_it_does_not_build(tmp_path):
    """Checked before megatron is imported: a text model's directory, and PP > 1 (not wired for VLMs yet)."""
    from train.conftest import load_tiny_model_tool

    from relax_hpc.errors import PermanentError
    from relax_hpc.train import TrainConfig
    from relax_hpc.train.vlm import build_vlm, is_vlm

    tool = load_tiny_model_tool()
    text = tool.make_tiny_model(tmp_path / "text", arch="qwen3", layers=1)
    vl = tool.make_tiny_model(tmp_path / "vl", arch="qwen2_5_vl", layers=2)
    assert is_vlm(vl) and not is_vlm(text)
    with pytest.raises(PermanentError, match="model_type must be one of"):
        build_vlm(text, TrainConfig(tp=1, pp=1))
    with pytest.raises(PermanentError, match="train.pp = 2"):
        build_vlm(vl, TrainConfig(tp=1, pp=2))


if __name__ == "__main__":  # one rank of the run above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(vlm_parity=job_vlm_parity)
