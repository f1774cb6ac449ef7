"""relax_hpc.audio: WAV read with the standard library (8/16/24/32-bit, stereo averaged), FLAC and float WAV with PyAV
(the files made here by PyAV itself), lengths judged from the header before the samples are read (or while decoding
where the header has none), what it cannot read named without its bytes, band-limited resampling, the feature
extractor's frames and the audio pads' expansion."""

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


# --------------------------------------------------------------------------------------------------
# FLAC and the other formats: PyAV (FFmpeg's decoders), the files encoded here by PyAV itself
# --------------------------------------------------------------------------------------------------


def _pcm(seconds: float, rate: int, channels: int, seed: int = 0) -> np.ndarray:
    """int16 samples [n, channels]: a tone and some noise."""
    n = int(seconds * rate)
    t = np.arange(n) / rate
    x = 0.4 * np.sin(2 * np.pi * 440 * t)[:, None] + 0.05 * np.random.default_rng(seed).standard_normal((n, channels))
    return (np.clip(x, -1, 1) * 32767).round().astype(np.int16)


def _encode(pcm: np.ndarray, rate: int, fmt: str = "flac", codec: str = "flac") -> bytes:
    """``pcm`` [n, channels] int16 encoded by PyAV (FFmpeg's encoder) in a ``fmt`` container."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    layout = "mono" if pcm.shape[1] == 1 else "stereo"
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm.reshape(1, -1)), format="s16", layout=layout)
        frame.sample_rate = rate
        for frame in ([frame] if s.format.name == "s16" else av.AudioResampler(s.format.name, layout, rate)
                      .resample(frame)):
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def _wav16(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("channels", [1, 2])
def test_flac_reads_the_samples_its_wav_twin_reads(channels):
    """FLAC is lossless: a FLAC and a WAV of the same int16 samples decode to the same floats (stereo averaged),
    at the clip's own rate. Before PyAV, every FLAC was refused."""
    pcm = _pcm(0.5, 22050, channels)
    data = _encode(pcm, 22050)
    assert data[:4] == b"fLaC"
    y, rate = decode_audio(data)
    want, want_rate = decode_audio(_wav16(pcm, 22050))
    assert rate == want_rate == 22050 and y.dtype == np.float32 and y.shape == (len(pcm),)
    assert float(np.abs(y - want).max()) <= (0 if channels == 1 else 1e-7)


def test_float_wav_and_mp3_read_through_pyav():
    """What wave cannot read (an IEEE-float WAV) and a lossy format (MP3, LAME's encoder) come through PyAV: the
    float WAV exactly, the MP3 as the same tone (its peak at 440 Hz), both at their rate."""
    pcm = _pcm(0.5, 16000, 1)
    x = pcm[:, 0].astype(np.float32) / 32768
    flt = _encode(pcm, 16000, "wav", "pcm_f32le")
    assert flt[20:22] == b"\x03\x00"  # WAVE_FORMAT_IEEE_FLOAT
    y, rate = decode_audio(flt)
    assert rate == 16000 and np.array_equal(y, x)
    mp3 = _encode(_pcm(1.0, 16000, 1), 16000, "mp3", "libmp3lame")
    y, rate = decode_audio(mp3)
    assert mp3[:3] == b"ID3" and rate == 16000 and abs(len(y) - 16000) <= 2304  # the encoder's delay and padding
    assert abs(_peak_hz(y[2000:10000], 16000) - 440) <= 2.0


def test_flac_length_is_judged_from_its_header_or_while_decoding():
    """A 2 s FLAC against a 1 s bound: refused from its STREAMINFO before a sample is decoded; with the header's
    total-samples field zeroed (unknown length), refused while decoding once the bound is passed."""
    data = _encode(_pcm(2.0, 16000, 1), 16000)
    with pytest.raises(AudioError, match=r"2\.00 s \(at 16000 Hz, by its header\), over the 1 s a clip may have"):
        decode_audio(data, 1.0)
    unknown = bytearray(data)
    unknown[21] &= 0xF0  # STREAMINFO's 36-bit total samples: the low 4 bits of byte 21 and bytes 22-25
    unknown[22:26] = bytes(4)
    with pytest.raises(AudioError, match=r"over 16000 samples at 16000 Hz while decoding, over the 1 s"):
        decode_audio(bytes(unknown), 1.0)
    assert decode_audio(bytes(unknown))[0].shape == (32000,)


def test_formats_ffmpeg_is_not_asked_to_guess_are_refused_without_their_bytes():
    """FFmpeg never probes: a playlist (HLS, which would open the files or URLs it lists) or any other unknown
    bytes are refused by their first bytes, naming the formats read; a damaged FLAC names FLAC; no byte quoted."""
    playlist = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/CANARY-SECRET\n#EXT-X-ENDLIST\n"
    for data, why in [(playlist, "nor another audio format this reads: WAV, FLAC"),
                      (b"fLaC" + b"CANARY-SECRET" * 8, "FLAC"),
                      (b"OggS" + b"CANARY-SECRET" * 8, "not a WAV file")]:
        with pytest.raises(AudioError) as e:
            decode_audio(data)
        assert why in str(e.value) and "CANARY" not in str(e.value), str(e.value)


def test_without_pyav_other_formats_are_refused_naming_the_fix(monkeypatch):
    """Where PyAV is not installed, PCM WAV still reads (the standard library) and FLAC is refused with the fix."""
    data = _encode(_pcm(0.1, 8000, 1), 8000)
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(AudioError, match=r"FLAC \(\d+ bytes\): without PyAV only PCM WAV is read.*pip install av"):
        decode_audio(data)
    assert decode_audio(_wav16(_pcm(0.1, 8000, 1), 8000))[1] == 8000


def test_a_flac_file_in_a_dataset_loads_as_its_wav_twin(tmp_path):
    """load_audio (the data's, the engine's and the exchange's door) on a FLAC path under the dataset's directory:
    the same samples at the processor's rate as the same clip in WAV."""
    from tests.rollout.conftest import _tiny_model_maker

    from relax_hpc.audio import load_audio

    model = _tiny_model_maker()(tmp_path / "omni", arch="qwen2_5_omni", layers=1)
    pcm = _pcm(0.5, 8000, 2)
    (tmp_path / "a.flac").write_bytes(_encode(pcm, 8000))
    (tmp_path / "a.wav").write_bytes(_wav16(pcm, 8000))
    flac, wav = load_audio("a.flac", model, tmp_path), load_audio("a.wav", model, tmp_path)
    assert flac.shape == wav.shape == (8000,) and float(np.abs(flac - wav).max()) <= 1e-6
