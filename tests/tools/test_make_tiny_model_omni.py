"""tools/make-tiny-model --arch qwen2_5_omni: a Qwen2.5-Omni thinker made offline, the same bytes per seed, loaded
by transformers' own classes (the thinker, its Whisper feature extractor and Qwen2.5-VL image processor from one
preprocessor_config.json, the tokenizer with the audio tokens after the vision ones and a chat template that writes
an audio part), and a forward on a clip that the clip changes."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from tests.weights.conftest import make_tiny_model


def _digest(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_omni_thinker_is_deterministic_and_loads_with_transformers(tmp_path):
    from transformers import (AutoImageProcessor, AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration,
                              WhisperFeatureExtractor)

    a = make_tiny_model(tmp_path / "a", arch="qwen2_5_omni", seed=0)
    b = make_tiny_model(tmp_path / "b", arch="qwen2_5_omni", seed=0)
    c = make_tiny_model(tmp_path / "c", arch="qwen2_5_omni", seed=1)
    assert _digest(a) == _digest(b) and _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    tok = AutoTokenizer.from_pretrained(a)
    assert [tok.convert_tokens_to_ids(t) for t in ("<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>")] == [11, 12, 13]
    assert tok.convert_tokens_to_ids("<|image_pad|>") == 9 and len(tok) == 128
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "x"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>x" in text
    fe, ip = WhisperFeatureExtractor.from_pretrained(a), AutoImageProcessor.from_pretrained(a, use_fast=False)
    assert (fe.sampling_rate, fe.feature_size, fe.n_samples, type(ip).__name__) == (16000, 128, 64000,
                                                                                   "Qwen2VLImageProcessor")
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(a).eval()
    assert model.config.audio_token_index == 13 and model.config.text_config.hidden_size == 64

    def logits(freq):
        x = (0.5 * np.sin(2 * np.pi * freq * np.arange(8000) / 16000)).astype(np.float32)
        f = fe([x], sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
        ids = tok.encode(text.replace("<|AUDIO|>", "<|AUDIO|>" * 12), add_special_tokens=False)
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), input_features=f["input_features"],
                         feature_attention_mask=f["attention_mask"]).logits[0, -1]

    assert float((logits(300) - logits(3000)).abs().max()) > 1e-3  # the tower's output reaches the answer
