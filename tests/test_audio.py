"""relax_hpc.audio: WAV read with the standard library (8/16/24/32-bit, stereo averaged), lengths judged from the
header before the samples are read, what it cannot read named without its bytes, band-limited resampling, the
feature extractor's frames and the audio pads' expansion."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from relax_hpc.audio import (AudioError, audio_tokens, decode_audio, expand_audio, resample, wav_base64, wav_bytes)


def _wav(x: np.ndarray, rate: int, width: int, channels: int = 1) -> bytes:
    scale = {1: 127, 2: 32767, 3: 8388607, 4: 2147483647}[width]
    v = np.repeat((x * scale).round().astype(np.int64)[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        raw = (v + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = b"".join(struct.pack("<i", int(s))[:3] for s in v)
    else:
        raw = v.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def _peak_hz(x: np.ndarray, rate: int) -> float:
    return float(np.argmax(np.abs(np.fft.rfft(x))) * rate / len(x))


@pytest.mark.parametrize("width,channels", [(1, 1), (2, 1), (3, 2), (4, 1)])
def test_pcm_wav_of_every_width_reads_back(width, channels):
    t = np.arange(4000) / 8000
    x = 0.5 * np.sin(2 * np.pi * 440 * t)
    y, rate = decode_audio(_wav(x, 8000, width, channels))
    assert rate == 8000 and y.dtype == np.float32 and y.shape == x.shape
    assert float(np.abs(y - x).max()) < (0.01 if width == 1 else 1e-4)


def test_length_is_judged_from_the_header_before_reading():
    """A header claiming an hour in a file of a few bytes: refused as too long, not read (a cut file otherwise reads
    what is there)."""
    data = bytearray(_wav(np.zeros(100), 16000, 2))
    struct.pack_into("<I", data, 40, 16000 * 3600 * 2)  # the data chunk's size: 3600 s of samples
    with pytest.raises(AudioError, match=r"3600\.00 s .* over the 4 s a clip may have here"):
        decode_audio(bytes(data), 4.0)
    with pytest.raises(AudioError, match=r"over the 600 s a clip may have"):  # relax_hpc's own bound
        decode_audio(bytes(data))


def test_what_it_cannot_read_is_named_without_its_bytes():
    canary = b"RIFF\x00\x00\x00\x00WAVE" + b"CANARY-SECRET" * 10
    float_wav = bytearray(_wav(np.zeros(10), 16000, 2))
    struct.pack_into("<H", float_wav, 20, 3)  # WAVE_FORMAT_IEEE_FLOAT: wave reads PCM only
    for data, why in [(canary, "not a WAV file wave reads"), (b"fLaC" + b"\0" * 40, "FLAC"),
                      (b"CANARY-SECRET" * 10, "not a WAV file"), (bytes(float_wav), "unknown format: 3")]:
        with pytest.raises(AudioError) as e:
            decode_audio(data)
        assert why in str(e.value) and "CANARY" not in str(e.value), str(e.value)


def test_resample_keeps_the_pitch_and_the_length():
    t = np.arange(8000) / 8000
    x = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    for target in (16000, 44100, 4000):
        y = resample(x, 8000, target)
        assert len(y) == target
        assert abs(_peak_hz(y, target) - 1000) <= 1.0
    assert abs(float(np.abs(resample(x, 8000, 16000)).max()) - 0.5) < 0.01
    # a tone over the new Nyquist is cut, not folded back as an alias
    hi = (0.5 * np.sin(2 * np.pi * 3000 * t)).astype(np.float32)
    assert float(np.abs(resample(hi, 8000, 4000)).max()) < 0.01
    assert resample(x, 8000, 8000) is not None and np.array_equal(resample(x, 8000, 8000), x)


def test_wav_base64_round_trip_and_expansion():
    import base64

    x = (0.3 * np.sin(np.arange(1600) / 5)).astype(np.float32)
    y, rate = decode_audio(base64.b64decode(wav_base64(x, 16000)))
    assert rate == 16000 and float(np.abs(y - x).max()) < 1e-4
    assert decode_audio(wav_bytes(x, 16000, width=1))[0].shape == x.shape
    assert [audio_tokens(n) for n in (40, 50, 100, 30)] == [10, 12, 25, 7]
    assert expand_audio([1, 13, 2, 13, 3], [2, 3], 13) == [1, 13, 13, 2, 13, 13, 13, 3]
    assert expand_audio([1, 13, 13, 2], [2], 13) == [1, 13, 13, 2]  # already expanded
    with pytest.raises(AudioError, match="1 clip"):
        expand_audio([1, 13, 2, 13], [2], 13)


def test_features_are_the_processors(tmp_path):
    """The short padding gives exactly the frames of the processor's own call (padding to the whole n_samples),
    for clips on and off a hop boundary; the frame count is the clip's hops, rounded up."""
    from tests.rollout.conftest import _tiny_model_maker

    from relax_hpc.audio import features

    model = _tiny_model_maker()(tmp_path / "omni", arch="qwen2_5_omni", layers=1)
    rng = np.random.default_rng(0)
    for n in (6400, 6555, 16000, 64000):
        x = (0.3 * np.sin(np.arange(n) / 7) + 0.05 * rng.standard_normal(n)).astype(np.float32)
        short, whole = features(model, [x])[0], features(model, [x], full=True)[0]
        assert short.shape == whole.shape == (-(-n // 160), 128)
        assert np.array_equal(short, whole), float(np.abs(short - whole).max())
