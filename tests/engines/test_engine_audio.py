"""The reference engine serving an omni thinker (tools/make-tiny-model --arch qwen2_5_omni): a real engine process,
requests with audio in SGLang's ``audio_data``, the expanded prompt and the log-probs checked against a
transformers forward of the same inputs; bad clips answered 400 without their bytes."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from tests.rollout.conftest import ENGINE_ARGS, _tiny_model_maker, served


def tone(freq: float, seconds: float = 0.5, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory):
    return _tiny_model_maker()(tmp_path_factory.mktemp("omni") / "omni", arch="qwen2_5_omni", seed=0)


@pytest.fixture(scope="module")
def omni_engine(tiny_omni, tmp_path_factory):
    from relax_hpc.engines.launcher import start_engine

    yield from served(start_engine("cpu", tiny_omni, log_path=tmp_path_factory.mktemp("omni-engine") / "engine.log",
                                   extra_args=ENGINE_ARGS))


def prompt_ids(model_dir, n_clips: int = 1) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    content = [{"type": "audio"}] * n_clips + [{"type": "text", "text": "high?"}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def post(engine, body) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=120)


def test_audio_request_expands_the_prompt_and_its_logprobs_are_the_models(omni_engine, tiny_omni):
    """Two clips (44.1 kHz and 8 kHz WAV, resampled to 16 kHz): each <|AUDIO|> becomes its clip's tokens (0.5 s:
    12, 0.3 s: 7), the engine's log-probs of its sampled tokens equal a transformers forward with the processor's
    features (1e-4), and differ with other audio."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from relax_hpc.audio import encode_audio_ids, padded, resample, wav_base64

    a, b = tone(300, 0.5, 44100), tone(3000, 0.3, 8000)
    ids = prompt_ids(tiny_omni, 2)
    r = post(omni_engine, {"input_ids": ids, "audio_data": [wav_base64(a, 44100), wav_base64(b, 8000)],
                           "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 3},
                           "return_logprob": True})
    assert r.status_code == 200, r.text
    out = r.json()
    expanded = out["meta_info"]["input_ids"]
    pad = 13  # make-tiny-model's <|AUDIO|>
    runs = [len(x) for x in "".join("a" if t == pad else " " for t in expanded).split()]
    assert runs == [12, 7] and out["meta_info"]["prompt_tokens"] == len(expanded)
    gen = [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
    lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(tiny_omni), dtype=torch.float32).eval()

    def ref(clips):
        # the engine's clips: resampled, then as 16-bit WAV (what wav_base64 sends) read back
        from relax_hpc.audio import decode_audio, wav_bytes

        feats = encode_audio_ids(str(tiny_omni), ids, [decode_audio(wav_bytes(resample(x, sr, 16000), 16000))[0]
                                                       for x, sr in clips])
        assert feats["input_ids"] == expanded
        x, mask = padded(feats["features"])
        seq = torch.tensor([expanded + gen])
        with torch.no_grad():
            logits = model(input_ids=seq, input_features=x, feature_attention_mask=mask).logits[0].float()
        return torch.log_softmax(logits[len(expanded) - 1:-1], -1).gather(1, torch.tensor(gen)[:, None])[:, 0]

    assert float((ref([(a, 44100), (b, 8000)]) - lps).abs().max()) < 1e-4
    assert float((ref([(tone(3000, 0.5, 44100), 44100), (tone(300, 0.3, 8000), 8000)]) - lps).abs().max()) > 1e-4


def test_bad_audio_requests_are_refused_by_name(omni_engine, tiny_omni):
    """A clip that is not WAV, a FLAC (no soundfile here), a clip over the processor's 4 s, audio pads without
    audio, and a clip count that does not match the pads: 400, naming the item and the reason, never a byte."""
    ids = prompt_ids(tiny_omni, 1)
    secret = base64.b64encode(b"SECRET-CANARY" * 40).decode()
    cases = [
        ([secret], "audio_data[0] (str of", "not a WAV file"),
        ([base64.b64encode(b"fLaC" + b"\0" * 64).decode()], "audio_data[0]", "FLAC"),
        ([__import__("relax_hpc.audio", fromlist=["x"]).wav_base64(tone(300, 5.0), 16000)], "audio_data[0]",
         "over the 4 s"),
    ]
    for data, where, why in cases:
        r = post(omni_engine, {"input_ids": ids, "audio_data": data, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and where in r.text and why in r.text, r.text
        assert "SECRET" not in r.text
    r = post(omni_engine, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "audio pad tokens" in r.text, r.text
    from relax_hpc.audio import wav_base64

    r = post(omni_engine, {"input_ids": ids, "audio_data": [wav_base64(tone(300), 16000)] * 2,
                           "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "2 clip(s)" in r.text, r.text
