"""A tiny Qwen2.5-Omni thinker in the Megatron actor (relax_hpc.train.omni: the bridge's Qwen2 language model with
transformers' audio tower inside) gives transformers' per-token log-probs of a response given a prompt with audio
(fp32, CPU, gloo), at TP=2 (with and without sequence parallelism) and TP=1, in one 2-process run; the export gives
the thinker's language-model tensors back by their names; the audio tower is frozen.

Two rows of different lengths in one right-padded batch: a 0.5 s clip (12 audio tokens) and two clips of 0.3 s and
0.7 s (7 + 17); transformers runs each row alone with the processor's padded features. This file is also the
worker of that run (``python tests/train/test_omni_parity.py JOB OUT ARGS``, see ``launch.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOL = 1e-5
CLIP = "<|audio_bos|><|AUDIO|><|audio_eos|>"
PROMPT = "<|im_start|>user\n{clips}{q}<|im_end|>\n<|im_start|>assistant\n"
LAYOUTS = [{"name": "tp2", "tp": 2}, {"name": "tp2_sp", "tp": 2, "sp": True}, {"name": "tp1", "tp": 1}]
ROWS = [  # (clip seconds, ...), question, response
    ((0.5,), "high or low?", "high<|im_end|>"), ((0.3, 0.7), "beeps?", "2<|im_end|>")]


def _clip(seconds: float, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.4 * np.sin(2 * np.pi * rng.uniform(200, 2000) * t) + 0.05 * rng.standard_normal(t.size)).astype("f4")


def _rows(hf: str) -> list[dict]:
    """Each row's ids, features, response start, and transformers' log-probs of its response."""
    import numpy as np
    import torch
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from relax_hpc.audio import _tokenizer, encode_audio_ids, padded

    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(hf).eval()
    tok = _tokenizer(hf)
    rows = []
    for k, (secs, q, resp) in enumerate(ROWS):
        clips = [_clip(s, 10 * k + j) for j, s in enumerate(secs)]
        prompt = PROMPT.format(clips=CLIP * len(clips), q=q)
        enc = encode_audio_ids(hf, tok.encode(prompt + resp, add_special_tokens=False), clips)
        start = len(encode_audio_ids(hf, tok.encode(prompt, add_special_tokens=False), clips)["input_ids"])
        ids = torch.tensor([enc["input_ids"]])
        x, mask = padded(enc["features"])
        with torch.no_grad():
            logits = model(input_ids=ids, input_features=x, feature_attention_mask=mask).logits[0].float()
            ox, _ = padded(encode_audio_ids(hf, enc["input_ids"], [_clip(s, 99 + j) for j, s in enumerate(secs)])
                           ["features"])  # other tones, the same lengths
            other = model(input_ids=ids, input_features=ox, feature_attention_mask=mask).logits[0].float()
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0][start - 1:]
        alt = torch.log_softmax(other[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0][start - 1:]
        rows.append(dict(ids=ids[0], feats=enc["features"], start=start, ref=ref, alt=alt,
                         n_audio=int((ids == tok.convert_tokens_to_ids("<|AUDIO|>")).sum())))
        assert all(isinstance(f, np.ndarray) for f in enc["features"])
    return rows


def job_omni_parity(args: dict, out: Path) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from relax_hpc.train import TrainConfig, cpu_compat
    from relax_hpc.train.export import named_hf_weights
    from relax_hpc.train.omni import build_omni, omni_log_probs
    from relax_hpc.train.parallel import destroy_parallel, init_parallel

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    hf = args["model"]
    rows = _rows(hf)
    S = max(len(r["ids"]) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r["ids"])] = r["ids"]
    feats = [f for r in rows for f in r["feats"]]
    x = torch.from_numpy(np.concatenate(feats))
    lens = [f.shape[0] for f in feats]
    res = {"n_audio": [r["n_audio"] for r in rows],
           "alt_diff": min(float((r["alt"] - r["ref"]).abs().max()) for r in rows)}
    for layout in args["layouts"]:
        tp, sp = layout["tp"], layout.get("sp", False)
        init_parallel(tp, 1, seed=0)
        built = build_omni(hf, TrainConfig(tp=tp, pp=1, seed=0, sequence_parallel=sp))
        model = built.chunks[0]
        model.eval()
        ref_w, got_w = load_file(f"{hf}/model.safetensors"), dict(named_hf_weights(built.bridge, built.chunks))
        text = {k for k in ref_w if not k.startswith(("audio_tower.", "visual."))}
        export = {"missing": sorted(text ^ set(got_w)), "n": len(got_w),
                  "max_diff": max(float((got_w[k] - ref_w[k]).abs().max()) for k in text & set(got_w))}
        lps = omni_log_probs(model, ids, x, lens, [r["start"] for r in rows])
        lps = [lp[:len(r["ref"])] for lp, r in zip(lps, rows)]
        r = {"max_diff": max(float((lp.detach() - r["ref"]).abs().max()) for lp, r in zip(lps, rows)),
             "mean_logprob": float(torch.cat(lps).mean()), "n_tokens": sum(len(lp) for lp in lps),
             "export": export,
             "tower_trainable": sum(p.requires_grad for p in model.audio_tower.parameters()),
             "tower_params": sum(1 for _ in model.audio_tower.parameters())}
        if not sp:
            torch.cat(lps).sum().backward()
            g = model.embedding.word_embeddings.weight.grad
            norms = [None] * dist.get_world_size()
            dist.all_gather_object(norms, float(g.norm()) if g is not None else 0.0)
            r["embedding_grad_norms"] = norms
        res[layout["name"]] = r
        del model, built
        destroy_parallel()
    return res


@pytest.fixture(scope="module")
def omni_run(tmp_path_factory) -> dict:
    from train import launch
    from train.conftest import load_tiny_model_tool

    root = tmp_path_factory.mktemp("omni")
    model = str(load_tiny_model_tool().make_tiny_model(root / "omni", arch="qwen2_5_omni", seed=0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the ranks (see __main__)
        return launch.run_job("omni_parity", {"model": model, "layouts": LAYOUTS}, nproc=2,
                              out_dir=root / "run", timeout=240)


@pytest.mark.timeout(300)
def test_omni_logprobs_match_transformers_tp1_tp2(omni_run):
    """The Megatron actor's log-probs of both rows (audio tokens placed, positions 0…S−1) equal the thinker's
    (whose M-RoPE positions come from its own get_rope_index), at TP=1, TP=2 and TP=2 with sequence parallelism;
    other audio moves them (the audio is heard)."""
    assert "error" not in omni_run, omni_run.get("error")
    assert omni_run["n_audio"] == [12, 7 + 17]
    assert omni_run["alt_diff"] > 20 * TOL  # other clips give other log-probs: parity is not trivial
    for layout in LAYOUTS:
        r = omni_run[layout["name"]]
        print(f"[omni parity {layout['name']}] log-probs max |Δ| vs transformers {r['max_diff']:.2e} over "
              f"{r['n_tokens']} response tokens (mean log p {r['mean_logprob']:.4f})")
        assert r["max_diff"] <= TOL, r
        assert r["n_tokens"] == len("high") + 1 + len("2") + 1
    assert abs(omni_run["tp1"]["mean_logprob"] - omni_run["tp2"]["mean_logprob"]) <= TOL


def test_omni_export_and_frozen_tower(omni_run):
    """The export (weight sync) gives every language-model tensor of the thinker back by its name, unchanged; the
    audio tower is in the model, frozen; a backward reaches the embedding: the TP=2 shards' grads make up the TP=1
    grad."""
    for layout in LAYOUTS:
        r = omni_run[layout["name"]]
        e = r["export"]
        assert not e["missing"] and e["n"] > 10 and e["max_diff"] == 0.0, (layout, e)
        assert r["tower_params"] > 10 and r["tower_trainable"] == 0, r
    tp2 = omni_run["tp2"]["embedding_grad_norms"]  # each rank its vocab shard's
    tp1 = omni_run["tp1"]["embedding_grad_norms"]  # each rank (DP) the whole table's
    whole = (tp2[0] ** 2 + tp2[1] ** 2) ** 0.5
    assert min(tp2) > 0 and tp1[0] == tp1[1] and abs(whole - tp1[0]) <= 1e-5 * tp1[0], (tp2, tp1)


def test_build_omni_refuses_what_it_does_not_build(tmp_path):
    """Checked before megatron is imported: a text model, PP > 1, packed micro-batches, an unfrozen tower."""
    from train.conftest import load_tiny_model_tool

    from relax_hpc.errors import PermanentError
    from relax_hpc.train import TrainConfig
    from relax_hpc.train.omni import build_omni, is_omni

    tool = load_tiny_model_tool()
    text = tool.make_tiny_model(tmp_path / "text", arch="qwen3", layers=1)
    omni = tool.make_tiny_model(tmp_path / "omni", arch="qwen2_5_omni", layers=1)
    assert is_omni(omni) and not is_omni(text)
    with pytest.raises(PermanentError, match="is not an omni thinker"):
        build_omni(text, TrainConfig(tp=1, pp=1))
    with pytest.raises(PermanentError, match="train.pp = 2"):
        build_omni(omni, TrainConfig(tp=1, pp=2))
    with pytest.raises(PermanentError, match="train.max_tokens_per_micro_batch"):
        build_omni(omni, TrainConfig(tp=1, pp=1, max_tokens_per_micro_batch=64))
    with pytest.raises(PermanentError, match="model.freeze_audio = false"):
        build_omni(omni, TrainConfig(tp=1, pp=1), freeze_audio=False)


if __name__ == "__main__":  # one rank of the run above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(omni_parity=job_omni_parity)
