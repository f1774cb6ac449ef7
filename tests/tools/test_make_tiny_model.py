"""tools/make-tiny-model's tokenizer takes the standard transformers call: ``model.generate(**tok(text,
return_tensors="pt"))``, on the model it makes and on what relax-export writes from it (the weights beside the
tokenizer files it copies from ``model.path``). A Llama or Qwen3 has no ``token_type_ids`` input: a tokenizer that
declared one made that call fail ("The following `model_kwargs` are not used by the model: ['token_type_ids']")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.weights.conftest import make_tiny_model  # the tool loaded as a module (absolute: as test_vlm_sync does)

REPO = Path(__file__).resolve().parents[2]


def standard_call(model_dir: Path) -> list[int]:
    """What a user types to try a model: the tokenizer's output straight into generate (greedy, one token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    enc = tok("3+4=", return_tensors="pt")
    assert set(enc) == {"input_ids", "attention_mask"}
    out = model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, enc["input_ids"].shape[1] + 1)
    return out[0].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_model_and_its_export_answer_the_standard_transformers_call(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from relax_hpc.train.export_cli import copy_tokenizer_files

    made = make_tiny_model(tmp_path / "model", arch=arch, hidden=64, layers=2, heads=4, kv_heads=2, seed=0)
    cfg = json.loads((made / "tokenizer_config.json").read_text())
    assert cfg["model_input_names"] == ["input_ids", "attention_mask"]  # said in the file: any loader sees it
    answer = standard_call(made)
    # an export: the weights (relax-export writes them from the checkpoint; here the same ones) and the tokenizer
    # files relax-export copies from model.path
    export = tmp_path / "export"
    AutoModelForCausalLM.from_pretrained(made).save_pretrained(export, safe_serialization=True)
    copied = copy_tokenizer_files(made, export)
    assert "tokenizer_config.json" in copied
    assert standard_call(export) == answer
