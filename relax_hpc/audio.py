"""Audio for omni models (Qwen2.5-Omni's thinker): reading a clip from a data row or a request, and the processor's
work (log-mel features and the expanded token ids), shared by the data (:mod:`relax_hpc.rollout.data`), the reference
engine (:mod:`relax_hpc.engines.audio`), the exchange's writer (:mod:`relax_hpc.train.samples`) and the actor
(:mod:`relax_hpc.train.omni`).

A leaf: numpy and the standard library, :mod:`relax_hpc.media` and :mod:`relax_hpc.multimodal` (the reference forms
and the media confinement); torch and transformers only inside the functions that need them.

**An audio reference** takes the image forms (:func:`relax_hpc.multimodal.media_bytes`): raw bytes, a ``data:``
URL, base64, an http(s) URL where allowed, a file path (a data row's only under its dataset's directory and
``data.media_roots``), ``{"bytes": ...}`` / ``{"path": ...}``. :func:`decode_audio` reads PCM WAV (8/16/24/32-bit,
any rate, mono or not: channels averaged) with the standard library's ``wave``, and the other formats (FLAC, float
WAV, OGG, MP3, AAC, MP4/M4A, Matroska/WebM, AIFF, CAF) with PyAV (``av``: FFmpeg's decoders in its wheel; the
``audio`` extra, in tools/install's lock); without PyAV those are refused naming the fix. The format is told by the
clip's first bytes and named to FFmpeg, which never probes (its playlist demuxers would open other files or URLs).
The clip's length is judged from its header before its samples are read (a container without one: while they are
decoded): longer than the processor takes (its ``chunk_length``, :func:`max_seconds`) or than
``data.max_audio_seconds`` is refused. :func:`resample` brings it to the processor's rate (band-limited, FFT).
:class:`AudioError` says why a clip cannot be used; no message quotes a byte of it.

**Placeholders.** The chat template writes ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip; the processor repeats
``<|AUDIO|>`` once per audio token of its clip: Whisper features at 100 frames a second, two stride-2 steps in the
tower (:func:`audio_tokens`: a 1 s clip, 100 frames, is 25 tokens).
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import wave
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.media import MediaPolicy, may_be_path  # noqa: F401 (may_be_path: the engine's cache uses it from here)
from relax_hpc.media_bounds import MAX_AUDIO_SECONDS  # noqa: F401 (read from here too)
from relax_hpc.multimodal import expand_pads, media_bytes

OMNI_MODEL_TYPES = ("qwen2_5_omni_thinker",)
AUDIO_PAD = "<|AUDIO|>"
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"  # one clip in the chat text, before expansion
AUDIO_START = "<|audio_bos|>"
TEXT_AUDIO_MARKER = "<audio>"  # Relax's marker in a text prompt: the clips go there, in order
MAX_AUDIO_BYTES = 64 << 20  # a larger encoded clip is refused
_SUFFIXES = frozenset({".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".aac", ".mka", ".aif", ".aiff",
                       ".caf"})  # a string ending so is taken for a path (a missing file: "no such file")


class AudioError(ValueError):
    """An audio clip that cannot be used; the message is the reason (the caller adds where it came from)."""


def model_type(hf_dir: str | os.PathLike) -> str | None:
    return json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type")


def is_omni(hf_dir: str | os.PathLike) -> bool:
    """Whether the HF directory holds an omni thinker relax_hpc runs (``config.json``'s model_type)."""
    return model_type(hf_dir) in OMNI_MODEL_TYPES


def audio_bytes(ref: Any, where: MediaPolicy | str | os.PathLike | None = None) -> bytes:
    """The encoded bytes of an audio reference (module docstring); :class:`AudioError` when there are none."""
    return media_bytes(ref, where, kind="audio clip", max_bytes=MAX_AUDIO_BYTES, suffixes=_SUFFIXES, error=AudioError)


def decode_audio(data: bytes, max_seconds: float | None = None, budget: str | None = None) -> tuple[np.ndarray, int]:
    """(mono float32 samples in [-1, 1], sampling rate) of an encoded clip; :class:`AudioError` when it is not a
    clip this reads (PCM WAV with ``wave``; others with PyAV, where installed) or longer than ``max_seconds``
    (judged from the header, before the samples are read; never over :data:`MAX_AUDIO_SECONDS`). ``budget`` names
    where the bound comes from, for the message."""
    cap, name = MAX_AUDIO_SECONDS, "a clip may have"
    if max_seconds is not None and max_seconds < cap:
        cap, name = float(max_seconds), budget or "a clip may have here"
    riff = data[:4] in (b"RIFF", b"RIFX") and data[8:12] == b"WAVE"
    if riff:
        try:
            return _decode_wav(data, cap, name)
        except _NotPcm as e:  # float WAV, a chunk wave does not know: FFmpeg may read it
            why = str(e)
    else:
        why = "FLAC" if data[:4] == b"fLaC" else "not a WAV file"
    return _decode_av(data, cap, name, why)


class _NotPcm(AudioError):
    """A RIFF/WAVE file the standard library's ``wave`` does not read (PyAV is tried next)."""


# PyAV's sample formats (packed, or planar with a "p"): the divisor that brings each to [-1, 1], and the offset
_AV_SCALE = {"u8": (128.0, 128.0), "s16": (32768.0, 0.0), "s32": (2147483648.0, 0.0), "s64": (2.0 ** 63, 0.0),
             "flt": (1.0, 0.0), "dbl": (1.0, 0.0)}


_FORMATS = "WAV, FLAC, OGG (Vorbis, Opus), MP3, AAC (ADTS), MP4/M4A, Matroska/WebM, AIFF, CAF"


def _container(data: bytes) -> str | None:
    """FFmpeg's demuxer for a clip's first bytes (one of :data:`_FORMATS`), or None."""
    head = data[:12]
    if head[:4] in (b"RIFF", b"RIFX") and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"RF64":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"ID3":
        return "mp3"
    if len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:  # an MPEG audio frame's sync
        # layer bits set: MPEG audio (layer I-III); clear, with a 12-bit sync: ADTS (AAC)
        return "mp3" if head[1] & 0x06 else "aac" if head[1] & 0xF0 == 0xF0 else None
    if head[4:8] == b"ftyp":
        return "mov"
    if head[:4] == b"\x1aE\xdf\xa3":
        return "matroska"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if head[:4] == b"caff":
        return "caf"
    return None


def _decode_av(data: bytes, cap: float, name: str, why: str) -> tuple[np.ndarray, int]:
    """A clip that is not PCM WAV, decoded by FFmpeg through PyAV (its first audio stream; channels averaged, as
    WAV's). ``why``: what the clip was taken for (``"FLAC"``, ``"not a WAV file"``, wave's reason), for the
    messages. Its length is judged from the container's header where it says one, else while it is decoded."""
    try:
        import av
    except ImportError:
        raise AudioError(f"{why} ({len(data)} bytes): without PyAV only PCM WAV is read (the standard library's "
                         "wave). Fix: pip install av (relax_hpc's audio extra; tools/install installs it), or "
                         "convert the clips to PCM WAV") from None
    fmt_name = _container(data)
    if fmt_name is None:
        raise AudioError(f"{why} ({len(data)} bytes), nor another audio format this reads: {_FORMATS}")
    try:
        container = av.open(io.BytesIO(data), mode="r", format=fmt_name)
    except Exception as e:  # av.error.InvalidDataError and kin: the message names no byte, only the type
        raise AudioError(f"{why}, nor audio FFmpeg reads (PyAV: {type(e).__name__}; {len(data)} bytes)") from None
    with container:
        if not container.streams.audio:
            raise AudioError(f"{why}: FFmpeg (PyAV) finds no audio stream in it ({len(data)} bytes)")
        st = container.streams.audio[0]
        if st.codec_context is None:  # e.g. a float WAV of 16-bit samples
            raise AudioError(f"{why}: FFmpeg (PyAV) has no decoder for its audio ({len(data)} bytes)")
        rate = int(st.codec_context.sample_rate or 0)
        if rate < 1:
            raise AudioError(f"{why}: an audio stream of rate {rate} ({len(data)} bytes)")
        secs = float(st.duration * st.time_base) if st.duration and st.time_base else \
            container.duration / 1e6 if container.duration else None  # AV_TIME_BASE: microseconds
        if secs is not None and secs > cap + 0.5 / rate:
            raise AudioError(f"{secs:.2f} s (at {rate} Hz, by its header), over the {cap:g} s {name}")
        most, n, parts = int(cap * rate), 0, []
        try:
            for frame in container.decode(st):
                fmt = frame.format
                div, off = _AV_SCALE.get(fmt.name.rstrip("p"), (None, 0.0))
                if div is None:
                    raise AudioError(f"{why}: samples of format {fmt.name!r}, which this does not convert")
                ch = max(1, len(frame.layout.channels))
                a = frame.to_ndarray()  # planar [ch, n]; packed [1, n·ch]
                a = a if fmt.is_planar else a.reshape(-1, ch).T
                x = ((a.astype(np.float64) - off) / div).mean(axis=0)
                n += x.size
                if n > most:  # no length in the header, or one that lied: stop at the bound
                    raise AudioError(f"over {most} samples at {rate} Hz while decoding, over the {cap:g} s {name}")
                parts.append(x)
        except AudioError:
            raise
        except Exception as e:  # a damaged stream
            raise AudioError(f"{why} that FFmpeg cannot decode (PyAV: {type(e).__name__}; {len(data)} bytes)") \
                from None
    if n == 0:
        raise AudioError(f"{why}: an audio stream without samples ({len(data)} bytes)")
    return _finish(np.concatenate(parts), rate)


def _decode_wav(data: bytes, cap: float, name: str) -> tuple[np.ndarray, int]:
    try:
        w = wave.open(io.BytesIO(data), "rb")
    except Exception as e:  # wave.Error ("unknown format: 3": float WAV), EOFError, a bad chunk's RuntimeError
        msg = str(e)
        said = f": {msg}" if msg and len(msg) < 80 and not any(q in msg for q in "'\"\\") else ""
        raise _NotPcm(f"not a WAV file wave reads ({type(e).__name__}{said}; {len(data)} bytes; PCM only)") \
            from None
    with w:
        rate, ch, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
        if rate < 1 or ch < 1:
            raise AudioError(f"a WAV header of rate {rate}, {ch} channels")
        if n / rate > cap:
            raise AudioError(f"{n / rate:.2f} s ({n} frames at {rate} Hz), over the {cap:g} s {name}")
        try:
            raw = w.readframes(n)
        except Exception as e:  # a damaged data chunk
            raise AudioError(f"cannot be decoded ({type(e).__name__}, {len(data)} bytes)") from None
    if len(raw) < n * ch * width:  # a cut file: the whole frames that are there
        n = len(raw) // (ch * width)
    if width == 1:
        x = (np.frombuffer(raw[: n * ch], np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw[: n * ch * 2], "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw[: n * ch * 3], np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = (np.frombuffer(raw[: n * ch * 4], "<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    else:
        raise AudioError(f"a WAV of {8 * width}-bit samples")
    if x.size == 0:
        raise AudioError("a WAV file without samples")
    return _finish(x.reshape(-1, ch).mean(axis=1), rate)


def _finish(x: np.ndarray, rate: int) -> tuple[np.ndarray, int]:
    x = np.asarray(x, np.float32)
    if not np.isfinite(x).all():
        raise AudioError("samples that are not finite")
    return x, int(rate)


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``x`` at ``rate`` Hz resampled to ``target`` Hz, band-limited (the FFT method: the spectrum cut or padded,
    as ``scipy.signal.resample``). The same input gives the same samples on every host."""
    if rate == target:
        return np.asarray(x, np.float32)
    n = len(x)
    m = max(1, int(round(n * target / rate)))
    spec = np.fft.rfft(np.asarray(x, np.float64))
    keep = min(len(spec), m // 2 + 1)
    out = np.zeros(m // 2 + 1, np.complex128)
    out[:keep] = spec[:keep]
    if m % 2 == 0 and keep == m // 2 + 1 and m < n:  # the new Nyquist bin holds both halves of the cut spectrum
        out[-1] = out[-1].real
    y = np.fft.irfft(out, m) * (m / n)
    return y.astype(np.float32)


def wav_bytes(x: np.ndarray, rate: int, width: int = 2) -> bytes:
    """Mono PCM WAV of float samples (clipped to [-1, 1]): 16-bit, or 8-bit (``width`` 1: small data files)."""
    y = np.clip(np.asarray(x, np.float64), -1.0, 1.0)
    if width == 1:
        pcm = (y * 127.0 + 128.0).round().astype(np.uint8)
    elif width == 2:
        pcm = (y * 32767.0).round().astype("<i2")
    else:
        raise ValueError(f"width {width}: 1 or 2 bytes a sample")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(int(rate))
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def wav_base64(x: np.ndarray, rate: int) -> str:
    """The clip as base64 WAV: one of the forms SGLang's ``audio_data`` takes (16-bit PCM; every reader decodes the
    same samples)."""
    return base64.b64encode(wav_bytes(x, rate)).decode("ascii")


# --------------------------------------------------------------------------------------------------
# The processor's work
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def feature_extractor(hf_dir: str):
    """The directory's Whisper feature extractor (``preprocessor_config.json``), once per process."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(hf_dir)


@functools.lru_cache(maxsize=8)
def _tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def sampling_rate(hf_dir: str | os.PathLike) -> int:
    return int(feature_extractor(str(hf_dir)).sampling_rate)


def max_seconds(hf_dir: str | os.PathLike) -> float:
    """The longest clip the processor takes whole (its ``n_samples``: ``chunk_length`` seconds; Whisper cuts the
    rest): the default of ``data.max_audio_seconds``."""
    fe = feature_extractor(str(hf_dir))
    return float(fe.n_samples) / float(fe.sampling_rate)


def load_audio(ref: Any, hf_dir: str | os.PathLike, where: MediaPolicy | str | os.PathLike | None = None,
               max_secs: float | None = None, budget: str | None = None) -> np.ndarray:
    """An audio reference as mono float32 samples at the processor's rate; :class:`AudioError` with the reason.
    ``max_secs``: the most seconds (None: the processor's, :func:`max_seconds`)."""
    cap = max_seconds(hf_dir) if max_secs is None else min(float(max_secs), max_seconds(hf_dir))
    if budget is None and max_secs is None:
        budget = "the model processor takes (its chunk_length; data.max_audio_seconds)"
    x, rate = decode_audio(audio_bytes(ref, where), cap, budget)
    return resample(x, rate, sampling_rate(hf_dir))


def audio_tokens(frames: int) -> int:
    """Audio tokens of a clip of ``frames`` feature frames: the tower's two stride-2 steps (Qwen2.5-Omni's
    processor and ``_get_feat_extract_output_lengths``)."""
    return ((int(frames) - 1) // 2 + 1 - 2) // 2 + 1


def clip_frames(hf_dir: str | os.PathLike, n_samples: int) -> int:
    """Feature frames of a clip of ``n_samples`` samples at the processor's rate (its hops, rounded up), without
    computing them."""
    hop = int(feature_extractor(str(hf_dir)).hop_length)
    return -(-int(n_samples) // hop)


def features(hf_dir: str | os.PathLike, clips: Sequence[np.ndarray], *, full: bool = False) -> list[np.ndarray]:
    """Per clip, its log-mel features [frames, mel] (float32), as Qwen2.5-Omni's processor makes them: Whisper's
    extractor with ``padding="max_length"``, the frames its attention mask marks. The clip is padded with zeros to
    3 hops past its last frame rather than to the whole ``n_samples`` (``full``: the processor's own call): every
    kept frame's window sees the same samples, and the padding's frames never hold the spectrogram's maximum (Whisper's
    floor is relative to it), so the values are the same (tests/test_audio.py) at a tenth of the cost for short
    clips."""
    fe = feature_extractor(str(hf_dir))
    out = []
    for x in clips:
        if len(x) > fe.n_samples:
            raise AudioError(f"{len(x) / fe.sampling_rate:.2f} s, over the {max_seconds(hf_dir):g} s the model's "
                             "processor takes")
        hop = int(fe.hop_length)
        room = {} if full else {"max_length": min(fe.n_samples, -(-len(x) // hop) * hop + 3 * hop)}
        f = fe([np.asarray(x, np.float32)], sampling_rate=fe.sampling_rate, padding="max_length",
               return_attention_mask=True, return_tensors="np", **room)
        n = int(f["attention_mask"][0].sum())
        if audio_tokens(n) < 1:
            raise AudioError(f"{len(x)} samples: too short for one audio token")
        out.append(np.ascontiguousarray(f["input_features"][0][:, :n].T, dtype=np.float32))
    return out


def expand_audio(ids: Sequence[int], counts: Sequence[int], pad_id: int) -> list[int]:
    """``ids`` with each clip's ``<|AUDIO|>`` (one per clip, in order) repeated ``counts[i]`` times
    (:func:`relax_hpc.multimodal.expand_pads`). Already expanded ids come back as they are; anything else raises
    :class:`AudioError`."""
    return expand_pads(ids, counts, pad_id, what="audio", item="clip", pad=AUDIO_PAD, error=AudioError)


def token_id(hf_dir: str | os.PathLike, token: str) -> int:
    return int(_tokenizer(str(hf_dir)).convert_tokens_to_ids(token))


def encode_audio_ids(hf_dir: str | os.PathLike, input_ids: Sequence[int], clips: Sequence[np.ndarray]) -> dict:
    """The processor's inputs for token ids and clips (samples at the processor's rate): ``input_ids`` (a list,
    each ``<|AUDIO|>`` expanded, :func:`expand_audio`) and ``features`` (per clip [frames, mel], :func:`features`)."""
    feats = features(hf_dir, clips)
    ids = expand_audio(list(input_ids), [audio_tokens(f.shape[0]) for f in feats], token_id(hf_dir, AUDIO_PAD))
    return {"input_ids": ids, "features": feats}


def padded(feats: Sequence[np.ndarray]):
    """Per-clip features [frames, mel] as the thinker's forward takes them: ``input_features`` [clips, mel, T] (zero
    padded to the longest) and ``feature_attention_mask`` [clips, T] (torch tensors)."""
    import torch

    T = max(f.shape[0] for f in feats)
    mel = feats[0].shape[1]
    x = torch.zeros(len(feats), mel, T)
    mask = torch.zeros(len(feats), T, dtype=torch.long)
    for i, f in enumerate(feats):
        x[i, :, : f.shape[0]] = torch.from_numpy(np.ascontiguousarray(f.T))
        mask[i, : f.shape[0]] = 1
    return x, mask
