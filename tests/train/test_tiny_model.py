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
