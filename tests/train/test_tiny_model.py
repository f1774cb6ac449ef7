"""tools/make-tiny-model: offline, deterministic, loadable by transformers, arithmetic-friendly tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest


def _digest(d: Path) -> str:
    return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


def test_tokenizer_single_tokens_and_chat_template(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    assert len(tok) <= 512
    for ch in list("0123456789") + list("+-*/=?") + [" "]:
        ids = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, (ch, ids)
    text = "What is 3+4? 7"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert {tok.bos_token, tok.eos_token, tok.pad_token} == {"<s>", "<|im_end|>", "<pad>"}
    chat = tok.apply_chat_template([{"role": "user", "content": "3+4=?"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\n3+4=?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "1-1"}])).startswith("<|im_start|>user")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_models_load_and_generate(tiny_models, arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models[arch])
    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch])
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.vocab_size == len(tok) == 128 and cfg.model_type == arch
    assert sum(p.numel() for p in model.parameters()) < 200_000
    ids = tok("2+2=", return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 4 or tok.eos_token_id in out[0].tolist()


def test_deterministic_per_seed(tiny_tool, tiny_models, tmp_path):
    same = tiny_tool.make_tiny_model(tmp_path / "a", arch="qwen3", seed=0)
    other = tiny_tool.make_tiny_model(tmp_path / "b", arch="qwen3", seed=1)
    assert _digest(same) == _digest(Path(tiny_models["qwen3"]))
    assert _digest(other) != _digest(same)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (same / f).read_bytes() == (Path(tiny_models["qwen3"]) / f).read_bytes()


def test_command_line(tiny_tool, tmp_path, capsys):
    """The CLI (argument names as documented) through main(); a subprocess would re-import transformers."""
    import json

    out = tmp_path / "m"
    assert tiny_tool.main(["--arch", "llama", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                           "--seed", "3", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (32, 1, 2, 1)
    with pytest.raises(SystemExit):
        tiny_tool.main(["--hidden", "30", "--heads", "4", str(tmp_path / "bad")])
    assert "must divide" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


VLM_PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}


@pytest.fixture(scope="module")
def tiny_vlms(tiny_tool, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {arch: tiny_tool.make_tiny_model(root / arch, arch=arch, seed=0) for arch in VLM_PATCH}


@pytest.mark.parametrize("arch", list(VLM_PATCH))
def test_vlm_deterministic_per_seed_and_text_ids_kept(tiny_tool, tiny_vlms, tiny_models, tmp_path, arch):
    from transformers import AutoTokenizer

    same = tiny_tool.make_tiny_model(tmp_path / "a", arch=arch, seed=0)
    other = tiny_tool.make_tiny_model(tmp_path / "b", arch=arch, seed=1)
    assert sorted(p.name for p in same.iterdir()) == sorted(p.name for p in tiny_vlms[arch].iterdir())
    for f in same.iterdir():
        assert f.read_bytes() == (tiny_vlms[arch] / f.name).read_bytes(), f.name
    assert _digest(other) != _digest(same)
    vtok, ttok = AutoTokenizer.from_pretrained(same), AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    text = "What is 3+4? 7"  # every character keeps its id: the vision tokens took reserved ones
    assert vtok(text)["input_ids"] == ttok(text)["input_ids"] and len(vtok) == len(ttok) == 128


@pytest.mark.parametrize("arch", list(VLM_PATCH))
def test_vlm_loads_and_runs_on_an_image(tiny_vlms, arch):
    import json

    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    d = tiny_vlms[arch]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForImageTextToText.from_pretrained(d).eval()
    cfg = model.config
    assert cfg.model_type == arch and type(model).__name__.endswith("VLForConditionalGeneration")
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        assert getattr(cfg, key) == tok.convert_tokens_to_ids(token) != tok.unk_token_id, key
        assert tok(token, add_special_tokens=False)["input_ids"] == [getattr(cfg, key)]
    text_cfg = cfg.get_text_config()
    assert (text_cfg.hidden_size, text_cfg.num_hidden_layers, cfg.vision_config.out_hidden_size) == (64, 2, 64)
    assert sum(text_cfg.rope_scaling["mrope_section"]) * 2 == 64 // 4  # the sections cover head_dim / 2
    assert sum(p.numel() for p in model.parameters()) < 300_000
    chat = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2+2"}]}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>2+2<|im_end|>\n<|im_start|>assistant\n"
    ip = AutoImageProcessor.from_pretrained(d, use_fast=False)
    side = 4 * VLM_PATCH[arch]
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))
    feats = ip(images=[img], return_tensors="pt")
    assert feats["image_grid_thw"].tolist() == [[1, 4, 4]]  # 16 patches, merged 2×2: 4 image tokens
    ids = tok(chat.replace("<|image_pad|>", "<|image_pad|>" * 4), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, **feats).logits
    assert logits.shape == (1, ids.shape[1], 128) and torch.isfinite(logits).all()
    assert json.loads((d / "preprocessor_config.json").read_text())["processor_class"].endswith("VLProcessor")


@pytest.mark.parametrize("arch", list(VLM_PATCH))
def test_vlm_auto_processor(tiny_vlms, arch):
    """transformers 4.57's Qwen-VL processors always build their video processor, which needs torchvision:
    with torchvision the directory loads through AutoProcessor and encodes as relax_hpc.train.vlm.encode does;
    without it the only failure is that import."""
    import importlib.util

    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    d = tiny_vlms[arch]
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(d)
        return
    from relax_hpc.train.vlm import encode

    proc = AutoProcessor.from_pretrained(d, use_fast=False)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (4 * VLM_PATCH[arch], 6 * VLM_PATCH[arch], 3),
                                                            dtype=np.uint8))
    text = "<|vision_start|><|image_pad|><|vision_end|>hi"
    got, want = proc(images=[img], text=[text], return_tensors="pt"), encode(d, text, [img])
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["pixel_values"], want["pixel_values"])


def test_vlm_command_line(tiny_tool, tiny_vlms, tmp_path):
    assert tiny_tool.main(["--arch", "qwen3_vl", "--seed", "0", str(tmp_path / "m")]) == 0
    assert _digest(tmp_path / "m") == _digest(tiny_vlms["qwen3_vl"])


@pytest.fixture(scope="module")
def tiny_moe(tiny_tool, tmp_path_factory) -> Path:
    return tiny_tool.make_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", seed=0)


def test_moe_deterministic_per_seed_same_tokenizer(tiny_tool, tiny_moe, tiny_models, tmp_path):
    same = tiny_tool.make_tiny_model(tmp_path / "a", arch="qwen3_moe", seed=0)
    other = tiny_tool.make_tiny_model(tmp_path / "b", arch="qwen3_moe", seed=1)
    assert sorted(p.name for p in same.iterdir()) == sorted(p.name for p in tiny_moe.iterdir())
    for f in same.iterdir():
        assert f.read_bytes() == (tiny_moe / f.name).read_bytes(), f.name
    assert _digest(other) != _digest(same)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the text models' character tokenizer
        assert (same / f).read_bytes() == (Path(tiny_models["qwen3"]) / f).read_bytes()


def test_moe_loads_routes_and_generates(tiny_moe):
    """Qwen3-30B-A3B's MoE layout at a tiny size: every layer sparse, 4 experts of width 32, top-2 renormalised."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe).eval()
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and cfg.model_type == "qwen3_moe"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == [] and cfg.norm_topk_prob
    assert not cfg.output_router_logits and cfg.router_aux_loss_coef == 0.001 and not cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok) == 128 and sum(p.numel() for p in model.parameters()) < 200_000
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)
    ids = tok("12+34=46", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    assert out.logits.shape == (1, ids.shape[1], 128) and torch.isfinite(out.logits).all()
    routed = torch.cat([r.topk(2, dim=-1).indices.flatten() for r in out.router_logits])
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (ids.shape[1], 4)
    assert len(set(routed.tolist())) > 2  # the tokens spread over the experts (a random router, no collapse)
    torch.manual_seed(0)
    gen = model.generate(ids, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] == ids.shape[1] + 4 or tok.eos_token_id in gen[0].tolist()


def test_moe_command_line(tiny_tool, tiny_moe, tmp_path, capsys):
    import json

    assert tiny_tool.main(["--arch", "qwen3_moe", "--seed", "0", str(tmp_path / "m")]) == 0
    assert _digest(tmp_path / "m") == _digest(tiny_moe)
    assert tiny_tool.main(["--arch", "qwen3_moe", "--experts", "8", "--experts-per-token", "3",
                           "--moe-intermediate", "16", "--layers", "1", str(tmp_path / "e8")]) == 0
    cfg = json.loads((tmp_path / "e8" / "config.json").read_text())
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (8, 3, 16)
    with pytest.raises(SystemExit):  # expert settings on a dense model
        tiny_tool.main(["--arch", "qwen3", "--experts", "8", str(tmp_path / "bad")])
    assert "--arch qwen3_moe" in capsys.readouterr().err and not (tmp_path / "bad").exists()
