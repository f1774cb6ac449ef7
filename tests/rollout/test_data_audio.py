"""Audio through the data (data.multimodal_keys.audio, an omni thinker's model.path): paths, base64, data: URLs,
one clip or a list, Relax's <audio> marker or chat content parts; each clip read when drawn, resampled to the
processor's 16 kHz and its <|AUDIO|> expanded to its tokens; each bad clip fails only its sample, naming the line
and the reason and never a byte of the file; the checks before submit."""

from __future__ import annotations

import base64
import json
import logging

import numpy as np
import pytest

from relax_hpc.audio import decode_audio, wav_bytes
from relax_hpc.rollout.config import DataConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset
from relax_hpc.rollout.checks import check_data
from relax_hpc.rollout.sample import SampleStatus
from tests.rollout.conftest import _tiny_model_maker

AUDIO_PAD = 13  # make-tiny-model's <|AUDIO|>
KEYS = DataKeys(input_key="prompt", label_key=None, audio_key="audios")
CANARY = "CANARY-5e1f-contents-of-a-secret"


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory):
    return _tiny_model_maker()(tmp_path_factory.mktemp("omni") / "omni", arch="qwen2_5_omni", seed=0)


def tone(seconds: float, rate: int, freq: float = 440.0) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return wav_bytes((0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate)


def jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def runs(tokens) -> list[int]:
    return [len(r) for r in "".join("a" if t == AUDIO_PAD else " " for t in tokens).split()]


def test_paths_base64_data_urls_markers_and_content_parts(tmp_path, tiny_omni):
    (tmp_path / "a.wav").write_bytes(tone(0.4, 8000))
    b64 = base64.b64encode(tone(1.0, 44100)).decode()
    jsonl(tmp_path / "d.jsonl", [
        {"prompt": "<audio>pitch?", "audios": "a.wav"},  # a path, relative to the data file
        {"prompt": "<audio>and<audio>?", "audios": [b64, "data:audio/wav;base64," + b64]},
        {"prompt": "no audio"},
    ])
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=str(tiny_omni))
    one, two, none = ds[0], ds[1], ds[2]
    assert one.status is not SampleStatus.FAILED and runs(one.tokens) == [10]  # 0.4 s: 40 frames, 10 tokens
    assert runs(two.tokens) == [25, 25]
    assert none.tokens == ds.samples[2].tokens and runs(none.tokens) == []
    x, rate = decode_audio(base64.b64decode(one.multimodal_inputs["audios"][0]))
    assert rate == 16000 and len(x) == 6400  # resampled from 8 kHz
    assert abs(np.argmax(np.abs(np.fft.rfft(x))) * rate / len(x) - 440) <= 2.5
    chat = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=str(tiny_omni), apply_chat_template=True)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>pitch?" in chat.samples[0].prompt
    assert runs(chat[0].tokens) == [10]


def test_each_bad_clip_fails_only_its_sample_with_its_line(tmp_path, tiny_omni, caplog):
    ds_dir = tmp_path / "ds"
    ds_dir.mkdir()
    (tmp_path / "secret.wav").write_bytes(tone(0.4, 8000))
    (ds_dir / "ok.wav").write_bytes(tone(0.4, 8000))
    (ds_dir / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVE" + CANARY.encode() * 4)
    (ds_dir / "long.wav").write_bytes(tone(5.0, 8000))
    jsonl(ds_dir / "d.jsonl", [
        {"prompt": "<audio>?", "audios": "ok.wav"},  # line 1
        {"prompt": "<audio>?", "audios": "corrupt.wav"},  # line 2
        {"prompt": "<audio>?", "audios": "long.wav"},  # line 3: over the processor's 4 s
        {"prompt": "<audio>?", "audios": "../secret.wav"},  # line 4: outside the dataset
        {"prompt": "<audio>?", "audios": "gone.wav"},  # line 5
        {"prompt": "<audio><audio>?", "audios": "ok.wav"},  # line 6: two placeholders, one clip
        {"prompt": "<audio>?", "audios": 7},  # line 7: not a clip reference
        {"prompt": "<audio>?", "audios": base64.b64encode(b"fLaC" + b"\0" * 50).decode()},  # line 8
    ])
    ds = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=str(tiny_omni))
    with caplog.at_level(logging.ERROR):
        got = [ds[i] for i in range(len(ds))]
    assert got[0].status is not SampleStatus.FAILED and runs(got[0].tokens) == [10]
    want = {2: "not a WAV file wave reads", 3: "5.00 s (40000 frames at 8000 Hz), over the 4 s",
            4: "is outside the dataset's directory", 5: "no such file 'gone.wav'",
            6: "1 clip(s) but 2 audio placeholder(s)", 7: "must be an audio clip", 8: "FLAC"}
    for line, why in want.items():
        s = got[line - 1]
        assert s.status is SampleStatus.FAILED and s.loss_mask == [0] and s.multimodal_inputs is None
        err = s.metadata["image_error"]
        assert f"line {line}: key 'audios' (data.multimodal_keys.audio)" in err and why in err, err
    assert CANARY not in caplog.text and all(CANARY not in s.metadata.get("image_error", "") for s in got)
    short = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=str(tiny_omni), max_audio_seconds=0.2)
    assert "over the 0.2 s a clip may have (data.max_audio_seconds" in short[0].metadata["image_error"]


def test_the_check_before_submit():
    ok = check_data(DataConfig(path="x.jsonl", multimodal_keys={"audio": "audios"}, max_audio_seconds=2.0,
                                 media_roots=["/data/clips"], allow_media_urls=True),  # the audio's files too
                      __import__("relax_hpc.rollout.config", fromlist=["RolloutConfig"]).RolloutConfig())
    assert ok == [], ok
    bad = check_data(DataConfig(path="x.jsonl", multimodal_keys={"audio": "a", "image": "i", "video": "v"},
                                  max_audio_seconds=0), __import__("relax_hpc.rollout.config",
                                                                   fromlist=["RolloutConfig"]).RolloutConfig())
    text = "\n".join(map(str, bad))
    assert "videos beside images or audio in one recipe are not wired yet" in text
    assert "images and audio in one prompt are not wired yet" in text
    assert "data.max_audio_seconds" in text and "more than 0" in text
    lone = check_data(DataConfig(path="x.jsonl", max_audio_seconds=3.0),
                        __import__("relax_hpc.rollout.config", fromlist=["RolloutConfig"]).RolloutConfig())
    assert any("bounds audio clips" in str(p) for p in lone), lone
