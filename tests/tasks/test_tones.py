"""The audio quickstart's task: clips drawn per seed, their pitch in their band, pitches balanced per block of 3,
the committed data files the CLI's output, the reward, and the rows read through the data path with the tiny omni
model (10 audio pads, 16 kHz clips)."""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import numpy as np

from relax_hpc.audio import decode_audio
from relax_hpc.tasks import tones
from tests.rollout.conftest import REPO


def _peak(x: np.ndarray, rate: int) -> float:
    return float(np.argmax(np.abs(np.fft.rfft(x))) * rate / len(x))


def test_clips_are_the_same_per_seed_in_their_band_and_balanced():
    a, b = tones.rows(9, seed=3), tones.rows(9, seed=3)
    assert a == b and a != tones.rows(9, seed=4)
    for block in range(3):
        assert sorted(r["label"] for r in a[3 * block: 3 * block + 3]) == ["h", "l", "m"]
    orders = {tuple(r["label"] for r in tones.rows(30, seed=0)[3 * k: 3 * k + 3]) for k in range(10)}
    assert len(orders) > 1  # the order is drawn per block, not fixed
    for r in a:
        x, rate = decode_audio(base64.b64decode(r["audios"][0]))
        assert rate == tones.RATE and len(x) == int(tones.RATE * tones.SECONDS)
        lo, hi = tones.PITCHES[r["label"]]
        assert lo - 5 <= _peak(x, rate) <= hi + 5, (r["label"], _peak(x, rate))


def test_committed_data_files_are_the_clis_output(tmp_path):
    for name, n, seed in (("tones.jsonl", 96, 0), ("tones-eval.jsonl", 30, 1)):
        out = tmp_path / name
        assert tones.main([str(out), "--n", str(n), "--seed", str(seed)]) == 0
        assert out.read_text() == (REPO / "recipes" / "data" / name).read_text(), name


def test_reward_and_relax_signature():
    assert tones.score("l", "l") == 1.0 and tones.score("m", "l") == tones.PARTIAL and tones.score("x", "l") == 0.0
    assert tones.score("", "h") == 0.0 and tones.score("hh", "h") == 1.0
    sample = SimpleNamespace(response="m", label="m")
    assert asyncio.run(tones.reward_func(None, sample)) == 1.0


def test_rows_read_through_the_data_path(tmp_path):
    from relax_hpc.rollout.data import DataKeys, PromptDataset
    from tests.rollout.conftest import _tiny_model_maker

    model = _tiny_model_maker()(tmp_path / "omni", arch="qwen2_5_omni", layers=1)
    assert tones.main([str(tmp_path / "d" / "t.jsonl"), "--n", "3", "--audio-dir", str(tmp_path / "d" / "wav")]) == 0
    assert json.loads((tmp_path / "d" / "t.jsonl").read_text().splitlines()[0])["audios"] == ["wav/tone-0-00000.wav"]
    ds = PromptDataset(tmp_path / "d" / "t.jsonl", keys=DataKeys(input_key="prompt", label_key="label",
                                                                  audio_key="audios"), tokenizer=str(model))
    for i in range(3):
        s = ds[i]
        assert s.tokens.count(13) == 10 and len(s.multimodal_inputs["audios"]) == 1
        assert decode_audio(base64.b64decode(s.multimodal_inputs["audios"][0]))[1] == 16000
