"""Images for vision-language models (Qwen2.5-VL, Qwen3-VL): reading one from a data row or a request, and the
processor's work (pixels and the expanded token ids), shared by the data (:mod:`relax_hpc.rollout.data`), the
reference engine (:mod:`relax_hpc.engines.model_runner`) and the trainer (:mod:`relax_hpc.train.vlm`).

A leaf: it imports no Megatron and no other relax_hpc package but :mod:`relax_hpc.media`; PIL, torch and
transformers only inside the functions that need them (the recipe check reads images with PIL alone).

**An image reference** (a data row's image column, or one item of SGLang's ``image_data``) is raw bytes, a
``data:`` URL, a base64 string, an http(s) URL (where allowed), a file path, or a dict ``{"bytes": ...}`` /
``{"path": ...}`` (a Hugging Face ``datasets`` Image column in Parquet). Which files and URLs may be read is a
:class:`~relax_hpc.media.MediaPolicy`: a data row's are confined to its dataset's directory and
``data.media_roots`` (:mod:`relax_hpc.media`). :func:`load_image` reads it with PIL (the common formats only,
:data:`IMAGE_FORMATS`) and converts it to RGB; :class:`ImageError` says why it cannot: outside the allowed
directories, no such file, not an image, over :data:`MAX_IMAGE_BYTES` bytes, or over a pixel budget (at most
:data:`MAX_IMAGE_PIXELS`), checked from the header before anything is decoded (:func:`open_header`). No message
quotes a byte of what was read.

**Placeholders.** The chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` per image; the
processor (:func:`encode`) repeats ``<|image_pad|>`` once per merged patch of its image (``grid_t·grid_h·grid_w /
merge²``). ``AutoProcessor`` is not used: for Qwen-VL it needs torchvision, which the venv has not.

**Videos** (Qwen2.5-VL): a video is a list of frames (each an image reference) or one animated GIF/APNG/WebP
(:func:`video_frame_refs`; other video files are refused: no decoder among the dependencies). The frames the model
sees are sampled to :data:`MODEL_FPS` and capped (:func:`sample_frames`), checked as images are and decoded
(:func:`load_video`); the image processor's video path makes ``pixel_values_videos`` and ``video_grid_thw``
(:func:`video_values`), and each ``<|video_pad|>`` becomes ``t·h·w / merge²`` tokens (:func:`expand_pads`, the one
expansion rule of images, videos and audio clips).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_hpc.media import MediaError, MediaPolicy, as_policy, fetch_url, may_be_path, read_file, resolve, url_scheme
from relax_hpc.media_bounds import MAX_IMAGE_PIXELS, MAX_VIDEO_FRAMES  # noqa: F401 (read from here too)

VLM_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in the chat text, before expansion
VISION_START = "<|vision_start|>"
VISION_TOKENS = (VISION_START, IMAGE_PAD, "<|video_pad|>")  # ids the model takes for (part of) an image
TEXT_IMAGE_MARKER = "<image>"  # Relax's (slime's) marker in a text prompt: the images go there, in order
MAX_IMAGE_BYTES = 64 << 20  # a larger encoded image is refused (a data file is not a place for such)


class ImageError(ValueError):
    """An image that cannot be used; the message is the reason (the caller adds where it came from)."""


def is_vlm(hf_dir: str | os.PathLike) -> bool:
    """Whether the HF directory holds a vision-language model relax_hpc runs (``config.json``'s model_type)."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    return cfg.get("model_type") in VLM_MODEL_TYPES


def image_bytes(ref: Any, where: MediaPolicy | str | os.PathLike | None = None) -> bytes:
    """The encoded bytes of an image reference (module docstring); :class:`ImageError` when there are none.
    ``where``: a :class:`~relax_hpc.media.MediaPolicy` (a data row's: the files it may name), a directory (confined
    to it), or None (a trusted caller: paths anywhere)."""
    return media_bytes(ref, where)


def media_bytes(ref: Any, where: MediaPolicy | str | os.PathLike | None = None, *, kind: str = "image",
                max_bytes: int | None = None, suffixes: frozenset | set | None = None,
                error: type[ValueError] = ImageError) -> bytes:
    """:func:`image_bytes` for any medium (``kind``: "image", "audio clip"): the same reference forms and
    confinement, at most ``max_bytes``; a string with one of ``suffixes`` (or a slash) that is no file is "no such
    file"; ``error``: the exception class raised (its message the reason). ``max_bytes`` None: :data:`MAX_IMAGE_BYTES`
    (read when called)."""
    if max_bytes is None:
        max_bytes = MAX_IMAGE_BYTES
    policy = as_policy(where)
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            ref = ref["bytes"]
        elif ref.get("path") is not None:
            ref = ref["path"]
        else:
            raise error(f"a mapping without 'bytes' or 'path' (keys {sorted(map(str, ref))[:8]})")
    article = "an" if kind[0] in "aeiou" else "a"
    if isinstance(ref, (bytes, bytearray, memoryview)):
        data = bytes(ref)
    elif isinstance(ref, str):
        try:
            data = _str_bytes(ref, policy, kind, max_bytes, _IMAGE_SUFFIXES if suffixes is None else suffixes)
        except ImageError as e:
            raise error(str(e)) from None
    else:
        raise error(f"{article} {kind} must be a path, bytes or a base64 string, got {type(ref).__name__}")
    if len(data) > max_bytes:
        raise error(f"{len(data)} bytes, over the {max_bytes} bytes {article} {kind} may have")
    if not data:
        raise error("empty (0 bytes)")
    return data


def _str_bytes(ref: str, policy: MediaPolicy, kind: str, max_bytes: int, suffixes) -> bytes:
    article = "an" if kind[0] in "aeiou" else "a"
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if ";base64" not in head:
            raise ImageError("a data: URL that is not base64")
        return _b64(payload, "the data: URL's payload", kind, max_bytes)
    scheme = url_scheme(ref)
    if scheme is not None:
        if scheme not in ("http", "https"):
            raise ImageError(f"a {scheme}:// URL: only http(s) URLs are fetched (with data.allow_media_urls), "
                             "and data: URLs, base64 and paths are read")
        if not policy.allow_urls:
            raise ImageError("an http(s) URL, and URLs are not fetched. Fix: set data.allow_media_urls: true to let "
                             "the dataset's rows name them, or give a path, bytes or base64")
        try:
            return fetch_url(ref, max_bytes)
        except MediaError as e:
            raise ImageError(str(e)) from None
    if not may_be_path(ref):
        return _b64(ref, "the string (neither a file nor base64)", kind, max_bytes)
    try:
        path = resolve(ref, policy)
    except MediaError as outside:  # a confined row's path that leads out; unless it is base64 (JPEG's is "/9j/...")
        try:
            return _b64(ref, "the string", kind, max_bytes)
        except ImageError:
            raise ImageError(str(outside)) from None
    try:
        is_file = path.is_file()
    except OSError:  # e.g. ENAMETOOLONG: a base64 string longer than a file name may be
        is_file = False
    if is_file:
        try:
            return read_file(path, max_bytes)
        except MediaError as e:
            raise ImageError(str(e).replace("a media file", f"{article} {kind}")) from None
    try:  # not a file: base64, or a path that is not there
        return _b64(ref, "the string", kind, max_bytes)
    except ImageError:
        if "/" in ref or "\\" in ref or Path(ref).suffix.lower() in suffixes:
            base = policy.base_dir if policy.confined else None
            where = " (relative paths are read from the data file's directory)" if base is not None else ""
            shown = repr(ref) if len(ref) <= 120 else f"(a string of {len(ref)} characters)"  # never a body's bulk
            raise ImageError(f"no such file {shown}{where}") from None
        raise ImageError("neither a file that exists nor valid base64") from None


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff"}
# the formats PIL may open: the common image ones. Not EPS (Ghostscript runs on it), not the dozens of rare
# plugins a hostile file could pick by its first bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")  # JPEG includes MPO (a camera's JPEG)


def _b64(s: str, what: str, kind: str = "image", max_bytes: int | None = None) -> bytes:
    if max_bytes is None:
        max_bytes = MAX_IMAGE_BYTES
    if len(s) > max_bytes * 4 // 3 + 4:
        article = "an" if kind[0] in "aeiou" else "a"
        raise ImageError(f"{what}: {len(s)} base64 characters, over the {max_bytes} bytes {article} {kind} may have")
    try:
        return base64.b64decode("".join(s.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what} is not valid base64 ({e})") from None


def open_header(data: bytes, max_pixels: int | None = None, budget: str | None = None):
    """The PIL image of encoded bytes with only its header read (nothing decoded yet), its size checked against
    ``max_pixels`` (and :data:`MAX_IMAGE_PIXELS` always); ``budget`` names where that bound comes from (a recipe
    key) for the message. :class:`ImageError` when it is not an image of :data:`IMAGE_FORMATS`, or too large. The
    message never quotes the bytes: they may be a file the row had no business naming."""
    from PIL import Image, UnidentifiedImageError

    cap, name = MAX_IMAGE_PIXELS, "an image may have"
    if max_pixels is not None and max_pixels < cap:
        cap, name = max_pixels, budget or "an image may have here"
    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:  # PIL's own bound (2 × Image.MAX_IMAGE_PIXELS), above ours
        raise ImageError(f"over the {cap} pixels {name} (its header says more than PIL opens)") from None
    except UnidentifiedImageError:
        raise ImageError(f"not an image PIL can read ({len(data)} bytes; formats {', '.join(IMAGE_FORMATS)})") \
            from None
    except Exception as e:  # a damaged header; PIL's message may quote header bytes: its kind only
        raise ImageError(f"not a readable image ({type(e).__name__}, {len(data)} bytes)") from None
    w, h = img.size
    if w * h > cap:
        raise ImageError(f"{w}×{h} = {w * h} pixels, over the {cap} pixels {name}")
    if w < 1 or h < 1:
        raise ImageError(f"{w}×{h}: an empty image")
    return img


def decode(img):
    """An image from :func:`open_header`, decoded and converted to RGB; :class:`ImageError` when it cannot be."""
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # truncated file, bad stream
        msg = str(e)
        said = f": {msg}" if msg and len(msg) < 120 and not any(q in msg for q in "'\"\\") else ""
        raise ImageError(f"cannot be decoded ({type(e).__name__}{said})") from None


def open_image(data: bytes, max_pixels: int | None = None, budget: str | None = None):
    """PIL image (RGB, decoded) of encoded image bytes; :class:`ImageError` when it is not an image or too large
    (checked from the header, before decoding: :func:`open_header`)."""
    return decode(open_header(data, max_pixels, budget))


def load_image(ref: Any, where: MediaPolicy | str | os.PathLike | None = None, max_pixels: int | None = None,
               budget: str | None = None):
    """An image reference (module docstring) as a decoded RGB PIL image; :class:`ImageError` with the reason.
    ``where`` as :func:`image_bytes`; ``max_pixels``/``budget`` as :func:`open_header`."""
    return open_image(image_bytes(ref, where), max_pixels, budget)


def png_base64(img) -> str:
    """The image as a base64 PNG string: one of the forms SGLang's ``image_data`` takes (lossless)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


# --------------------------------------------------------------------------------------------------
# Videos
# --------------------------------------------------------------------------------------------------

VIDEO_PAD = "<|video_pad|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"  # one video in the chat text, before expansion
TEXT_VIDEO_MARKER = "<video>"  # Relax's marker in a text prompt: the videos go there, in order
MODEL_FPS = 2.0  # the rate the model is told a video's kept frames were taken at: Qwen's processor's and SGLang's
# default for frames (neither request form carries a rate), so the engine's M-RoPE positions and the actor's agree
_VIDEO_SUFFIXES = frozenset({".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".flv", ".wmv"})
_ANIMATED = ("GIF", "PNG", "WEBP")  # PIL reads these as frame sequences: the video files relax_hpc decodes


def video_frame_refs(ref: Any, where: MediaPolicy | str | os.PathLike | None = None) -> tuple[list, float | None]:
    """A video reference as (its frames, their rate or None): a list of frames (each an image reference: path,
    bytes, base64, ``data:`` URL), as it is (the rate is ``data.video_fps``'s); or one file (path, bytes, base64,
    ``{"bytes"|"path": ...}``) that PIL reads as frames (an animated GIF, APNG or WebP; its rate from the frames'
    durations). Any other video file (MP4, WebM, ...) is refused naming the fix: no video decoder is among
    relax_hpc's dependencies (PyAV or decord would be one more native library)."""
    if isinstance(ref, (list, tuple)):
        return list(ref), None
    if isinstance(ref, str) and Path(ref).suffix.lower() in _VIDEO_SUFFIXES:
        raise ImageError(f"a video file ({Path(ref).suffix.lower()}): only frame lists and animated GIF/PNG/WebP "
                         "are read (no video decoder is among the dependencies). Fix: extract its frames (e.g. "
                         "ffmpeg -i in.mp4 -vf fps=2 f%03d.png) and give the row the list of them")
    data = media_bytes(ref, where, kind="video", suffixes=_VIDEO_SUFFIXES | {".gif", ".png", ".webp"})
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data), formats=_ANIMATED)
    except Exception:  # not an animated image: which kind, never its bytes
        kind = "an MP4/QuickTime" if data[4:8] == b"ftyp" else "a Matroska/WebM" if data[:4] == b"\x1aE\xdf\xa3" \
            else "an unknown"
        raise ImageError(f"{kind} file ({len(data)} bytes): only frame lists and animated GIF/PNG/WebP are read "
                         "(no video decoder is among the dependencies). Fix: give the row the list of its frames "
                         "(e.g. ffmpeg -i in.mp4 -vf fps=2 f%03d.png)") from None
    n = int(getattr(img, "n_frames", 1))
    if n > MAX_VIDEO_FRAMES * 8:
        raise ImageError(f"{n} frames, over the {MAX_VIDEO_FRAMES * 8} a video file may have")
    frames, ms = [], 0.0
    for i in range(n):
        img.seek(i)
        ms += float(img.info.get("duration") or 0)
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="PNG")
        frames.append(buf.getvalue())
    return frames, (n * 1000.0 / ms if ms > 0 else None)


def video_refs(v: Any) -> list | str:
    """A row's video column as a list of videos (none for null), or the reason it is not one (the data's ``\\0bad:``
    form, for the sample to fail with). One video is a list of frame references, or one file (a path, bytes, base64,
    ``{"bytes"|"path": ...}``); a list of such lists (or of files) is several."""
    if v is None:
        return []
    one = isinstance(v, (str, bytes, bytearray)) or (isinstance(v, dict) and ("bytes" in v or "path" in v))
    frame = (str, bytes, bytearray, dict)
    if one:
        return [v]
    if isinstance(v, list) and v and all(isinstance(x, frame) for x in v):
        return [list(v)]  # one video's frames
    if isinstance(v, list) and all(isinstance(x, list) and all(isinstance(f, frame) for f in x) for x in v):
        return [list(x) for x in v]
    return f"\0bad:must be a video (a list of frames: paths, bytes or base64; or a file) or a list of them, got " \
           f"{type(v).__name__}"


def video_parts(message: dict) -> dict:
    """A chat message whose string content holds Relax's ``<video>`` markers, as Qwen's content list
    (``{"type": "video"}`` where each marker was, ``{"type": "text", ...}`` between); other messages as they are."""
    content = message.get("content")
    if not isinstance(content, str) or TEXT_VIDEO_MARKER not in content:
        return dict(message)
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(content.split(TEXT_VIDEO_MARKER)):
        if i:
            parts.append({"type": "video"})
        if text:
            parts.append({"type": "text", "text": text})
    return {**message, "content": parts}


def read_videos(refs: Any, tokens: Sequence[int], hf_dir: str | os.PathLike, where: MediaPolicy, fps: float = MODEL_FPS,
                max_frames: int | None = None, *, max_pixels: int | None = None,
                max_prompt_pixels: int | None = None) -> tuple[list[int], list[list[str]]]:
    """A data row's videos (:func:`video_refs`'s list) read for a sample: (``tokens`` with each ``<|video_pad|>``
    expanded to its video's tokens, the videos as lists of base64 PNG frames: SGLang's ``video_data``). The frames
    are those :func:`load_video` keeps; :class:`ImageError` naming the video, the frame and the reason, or the
    placeholders that do not match. The kept frames of a video are bounded, from their headers, by the pixel
    budgets (``max_pixels`` a frame, ``max_prompt_pixels`` a video: :func:`pixel_budgets`' defaults, as images),
    so a row cannot make the rollout decode more than that."""
    if isinstance(refs, str):
        raise ImageError(refs.removeprefix("\0bad:"))
    per_frame, per_video = pixel_budgets(hf_dir, max_pixels, max_prompt_pixels)
    videos = []
    for n, ref in enumerate(refs):
        try:
            videos.append(load_video(ref, where, fps=fps, max_frames=max_frames, max_pixels=per_frame,
                                     budget="a video frame may have (data.max_image_pixels)", max_total=per_video,
                                     total_budget="a video's kept frames may have (data.max_prompt_pixels). Fix: "
                                                  "fewer frames (data.video_max_frames) or smaller ones, or raise "
                                                  "data.max_prompt_pixels"))
        except ImageError as e:
            raise ImageError(f"video {n}: {e}") from None
    counts = []
    ip = image_processor(str(hf_dir))
    for frames in videos:
        t, h, w = video_grid(hf_dir, len(frames), frames[0].height, frames[0].width)
        counts.append(t * h * w // (ip.merge_size ** 2))
    ids = expand_pads(list(tokens), counts, token_id(hf_dir, VIDEO_PAD), what="video", pad=VIDEO_PAD)
    return ids, [[png_base64(f) for f in frames] for frames in videos]


def sample_frames(n: int, fps: float, max_frames: int | None = None) -> list[int]:
    """Which of a video's ``n`` frames (taken at ``fps`` a second) the model sees: every one at :data:`MODEL_FPS`
    (frames ``round(k · fps / MODEL_FPS)``; all when ``fps`` is not above it), then at most ``max_frames`` of those
    (evenly spaced, first and last kept), never over :data:`MAX_VIDEO_FRAMES`."""
    if n < 1:
        return []
    step = max(1.0, float(fps) / MODEL_FPS)
    idx = sorted({min(n - 1, int(round(k * step))) for k in range(int((n - 1) / step) + 1)})
    cap = min(max_frames or MAX_VIDEO_FRAMES, MAX_VIDEO_FRAMES)
    if len(idx) > cap:
        pick = [idx[0]] if cap == 1 else [idx[int(round(j * (len(idx) - 1) / (cap - 1)))] for j in range(cap)]
        idx = sorted(set(pick))
    return idx


def load_video(ref: Any, where: MediaPolicy | str | os.PathLike | None = None, *, fps: float = MODEL_FPS,
               max_frames: int | None = None, max_pixels: int | None = None, budget: str | None = None,
               max_total: int | None = None, total_budget: str | None = None) -> list:
    """A video reference (:func:`video_frame_refs`) as the decoded RGB PIL frames the model sees
    (:func:`sample_frames`: at :data:`MODEL_FPS`, at most ``max_frames``), every frame of one size; each frame
    checked from its header as an image is (``max_pixels``/``budget``: :func:`open_header`), and the kept frames
    together against ``max_total`` pixels (``total_budget`` names it), before any is decoded. :class:`ImageError`
    naming the frame and the reason."""
    refs, own = video_frame_refs(ref, where)
    if not refs:
        raise ImageError("a video without frames")
    keep = sample_frames(len(refs), own or fps, max_frames)
    heads = []
    for k in keep:
        try:
            heads.append((k, open_header(image_bytes(refs[k], where), max_pixels, budget)))
        except ImageError as e:
            raise ImageError(f"frame {k}: {e}") from None
    total = sum(h.width * h.height for _, h in heads)
    if max_total is not None and total > max_total:
        raise ImageError(f"{len(heads)} frames of {heads[0][1].width}×{heads[0][1].height} = {total} pixels, over "
                         f"the {max_total} pixels {total_budget or 'a video may have here'}")
    sizes = {h.size for _, h in heads}
    if len(sizes) > 1:
        raise ImageError(f"frames of {len(sizes)} sizes {sorted(sizes)[:4]}: a video's frames must be one size")
    out = []
    for k, h in heads:
        try:
            out.append(decode(h))
        except ImageError as e:
            raise ImageError(f"frame {k}: {e}") from None
    return out


# --------------------------------------------------------------------------------------------------
# The processor's work
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def image_processor(hf_dir: str):
    """The directory's image processor (the slow one: the same pixels on every host), once per process."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(hf_dir, use_fast=False)


@functools.lru_cache(maxsize=8)
def _tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def token_pixels(hf_dir: str | os.PathLike) -> int:
    """Pixels per image token: (patch_size · merge_size)², 28² for Qwen2.5-VL, 32² for Qwen3-VL."""
    ip = image_processor(str(hf_dir))
    return (ip.patch_size * ip.merge_size) ** 2


PROMPT_IMAGES = 4  # a prompt's default pixel budget: this many images at the per-image budget


def processor_max_pixels(hf_dir: str | os.PathLike) -> int:
    """The most pixels the model's image processor leaves an image (its ``max_pixels``): it resizes anything larger
    down to this, so a larger source only costs memory."""
    return _pixels(image_processor(str(hf_dir)), "max_pixels", "longest_edge")


def pixel_budgets(hf_dir: str | os.PathLike, per_image: int | None, per_prompt: int | None) -> tuple[int, int]:
    """(per image, per prompt) source pixels a data row's images may have (``data.max_image_pixels``,
    ``data.max_prompt_pixels``); None: the processor's ``max_pixels`` (:func:`processor_max_pixels`), and
    :data:`PROMPT_IMAGES` times the image's. Never over :data:`MAX_IMAGE_PIXELS` an image."""
    image = min(per_image if per_image is not None else processor_max_pixels(hf_dir), MAX_IMAGE_PIXELS)
    return image, per_prompt if per_prompt is not None else PROMPT_IMAGES * image


def resize_to_tokens(img, hf_dir: str | os.PathLike, min_tokens: int | None, max_tokens: int | None):
    """``img`` resized (Qwen's ``smart_resize``: sides multiples of patch·merge, aspect kept) so it is at least
    ``min_tokens`` and at most ``max_tokens`` image tokens (Relax's ``--image-min/max-token-num``); None: the
    processor's own bound. The processor leaves an image so sized as it is, unless its own bounds are tighter."""
    if min_tokens is None and max_tokens is None:
        return img
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = image_processor(str(hf_dir))
    factor = ip.patch_size * ip.merge_size
    lo = min_tokens * factor ** 2 if min_tokens is not None else _pixels(ip, "min_pixels", "shortest_edge")
    hi = max_tokens * factor ** 2 if max_tokens is not None else _pixels(ip, "max_pixels", "longest_edge")
    try:
        h, w = smart_resize(img.height, img.width, factor=factor, min_pixels=lo, max_pixels=hi)
    except ValueError as e:  # an aspect ratio over 200
        raise ImageError(f"{img.width}×{img.height}: {e}") from None
    return img if (w, h) == img.size else img.resize((w, h), resample=_bicubic())


def _pixels(ip, attr: str, size_key: str) -> int:
    v = getattr(ip, attr, None)
    return int(v if v is not None else ip.size[size_key])


def _bicubic():
    from PIL import Image

    return Image.Resampling.BICUBIC


def expand_pads(ids: Sequence[int], counts: Sequence[int], pad_id: int, *, what: str = "image",
                pad: str = IMAGE_PAD, item: str | None = None, error: type[ValueError] = ImageError) -> list[int]:
    """``ids`` with each item's pad token (one per item, in order) repeated ``counts[i]`` times: the placeholder
    expansion of images, videos and audio clips alike. Already expanded ids (each run as long as its count) come back
    as they are; anything else raises ``error`` naming ``what`` (the pads' kind: "image", "video", "audio"), ``item``
    (what one is, default ``what``) and ``pad``."""
    item = item or what
    counts = [int(c) for c in counts]
    runs: list[int] = []  # lengths of the runs of pad ids, in order
    prev = None
    for t in ids:
        if t == pad_id:
            if prev == pad_id:
                runs[-1] += 1
            else:
                runs.append(1)
        prev = t
    if runs == counts:
        return list(ids)
    if len(runs) != len(counts) or any(r != 1 for r in runs):
        raise error(f"the prompt has {sum(runs)} {what} pad tokens in {len(runs)} run(s) {runs} for "
                    f"{len(counts)} {item}(s) of {counts} tokens: it needs one {pad} per {item} "
                    "(the chat template's placeholder), or the runs already expanded")
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out += [t] * next(it) if t == pad_id else [t]
    return out


def grid_tokens(grid_thw, merge: int) -> list[int]:
    """Tokens of each image or video of a processor's grid: its merged patches, ``t·h·w / merge²``."""
    return [int(t) * int(h) * int(w) // (merge * merge) for t, h, w in (list(map(int, g)) for g in grid_thw)]


def expand_placeholders(ids: Sequence[int], grid_thw, pad_id: int, merge: int) -> list[int]:
    """``ids`` with each image's ``<|image_pad|>`` (one per image, in order) repeated once per merged patch of that
    image (:func:`expand_pads`). Already expanded ids come back as they are; anything else raises
    :class:`ImageError`."""
    return expand_pads(ids, grid_tokens(grid_thw, merge), pad_id)


def images_end(ids: Sequence[int], n_images: int, vision_start_id: int, pad_id: int) -> int:
    """The position after the ``n_images``-th image of ``ids`` (an image: ``<|vision_start|>`` right before a run of
    ``<|image_pad|>``; the run's end); 0 for no images, ``len(ids)`` when there are fewer. A multi-turn sample's
    images end in its last observation with images, and any vision token after them is a sampled one."""
    if n_images <= 0:
        return 0
    seen, i, n = 0, 0, len(ids)
    while i < n - 1:
        if ids[i] == vision_start_id and ids[i + 1] == pad_id:
            i += 1
            while i < n and ids[i] == pad_id:
                i += 1
            seen += 1
            if seen == n_images:
                return i
        else:
            i += 1
    return n


def token_id(hf_dir: str | os.PathLike, token: str) -> int:
    """The id of ``token`` (e.g. :data:`IMAGE_PAD`) in the tokenizer of ``hf_dir``."""
    return int(_tokenizer(str(hf_dir)).convert_tokens_to_ids(token))


def encode_ids(hf_dir: str | os.PathLike, input_ids: Sequence[int], images: Sequence) -> dict:
    """:func:`encode` for token ids: ``input_ids`` [1, S] (placeholders expanded as :func:`expand_placeholders`),
    ``pixel_values``, ``image_grid_thw``. ``images``: PIL images."""
    import torch

    ip = image_processor(str(hf_dir))
    try:
        feats = ip(images=list(images), return_tensors="pt")
    except ValueError as e:  # e.g. an aspect ratio over 200 (Qwen's smart_resize)
        raise ImageError(f"the image processor refused it: {e}") from None
    pad_id = _tokenizer(str(hf_dir)).convert_tokens_to_ids(IMAGE_PAD)
    ids = expand_placeholders(list(input_ids), feats["image_grid_thw"].tolist(), pad_id, ip.merge_size)
    return {"input_ids": torch.tensor([ids]), "pixel_values": feats["pixel_values"],
            "image_grid_thw": feats["image_grid_thw"]}


def encode(hf_dir: str | os.PathLike, text: str, images: Sequence | None = None) -> dict:
    """``input_ids`` [1, S], ``pixel_values`` and ``image_grid_thw`` for one chat text with its images, as
    Qwen2.5-VL's processor makes them: each ``<|image_pad|>`` becomes one token per merged patch of its image.

    transformers' ``AutoProcessor`` for Qwen2.5-VL needs torchvision (for its video processor) even for images;
    without it this takes the image processor and the tokenizer the directory holds and expands the
    placeholders the same way (``Qwen2_5_VLProcessor.__call__``)."""
    tok = _tokenizer(str(hf_dir))
    if images:
        if text.count(IMAGE_PAD) != len(images):
            raise ValueError(f"{text.count(IMAGE_PAD)} {IMAGE_PAD} placeholders in the text for {len(images)} images")
        return encode_ids(hf_dir, tok.encode(text, add_special_tokens=False), images)
    return {"input_ids": tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]}


def video_grid(hf_dir: str | os.PathLike, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid the processor makes of a video of ``frames`` frames of ``height`` × ``width``
    (frames padded to a multiple of its ``temporal_patch_size``, sides by ``smart_resize``), without processing it."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = image_processor(str(hf_dir))
    h, w = smart_resize(height, width, factor=ip.patch_size * ip.merge_size,
                        min_pixels=_pixels(ip, "min_pixels", "shortest_edge"),
                        max_pixels=_pixels(ip, "max_pixels", "longest_edge"))
    tp = ip.temporal_patch_size
    return -(-int(frames) // tp), h // ip.patch_size, w // ip.patch_size


def video_values(hf_dir: str | os.PathLike, videos: Sequence[Sequence]) -> dict:
    """``pixel_values_videos`` [patches, C·T·P·P] and ``video_grid_thw`` [videos, 3] of videos (each a list of PIL
    frames of one size), as Qwen2.5-VL's processor makes them (the image processor's ``_preprocess`` of the frames
    together: its video path, which the video processor only moves to torchvision), and ``second_per_grid_ts``
    (one per video: ``temporal_patch_size / MODEL_FPS``)."""
    import numpy as np
    import torch

    ip = image_processor(str(hf_dir))
    pix, grids = [], []
    for frames in videos:
        try:
            p, g = ip._preprocess(list(frames), do_resize=ip.do_resize, size=ip.size, resample=ip.resample,
                                  do_rescale=ip.do_rescale, rescale_factor=ip.rescale_factor,
                                  do_normalize=ip.do_normalize, image_mean=ip.image_mean, image_std=ip.image_std,
                                  patch_size=ip.patch_size, temporal_patch_size=ip.temporal_patch_size,
                                  merge_size=ip.merge_size, do_convert_rgb=True)
        except ValueError as e:  # e.g. an aspect ratio over 200
            raise ImageError(f"the image processor refused the video: {e}") from None
        pix.append(np.asarray(p))
        grids.append(list(g))
    return {"pixel_values_videos": torch.from_numpy(np.concatenate(pix)).float(),
            "video_grid_thw": torch.tensor(grids, dtype=torch.long),
            "second_per_grid_ts": torch.full((len(videos),), ip.temporal_patch_size / MODEL_FPS)}


def encode_media_ids(hf_dir: str | os.PathLike, input_ids: Sequence[int], images: Sequence = (),
                     videos: Sequence[Sequence] = ()) -> dict:
    """:func:`encode_ids` with videos too: ``input_ids`` [1, S] with each ``<|image_pad|>`` and ``<|video_pad|>``
    expanded, the images' ``pixel_values``/``image_grid_thw`` (when any) and the videos' ``pixel_values_videos``,
    ``video_grid_thw`` and ``second_per_grid_ts`` (when any, :func:`video_values`)."""
    import torch

    out = encode_ids(hf_dir, input_ids, images) if images else {"input_ids": torch.tensor([list(input_ids)])}
    if videos:
        ip = image_processor(str(hf_dir))
        out.update(video_values(hf_dir, videos))
        ids = expand_pads(out["input_ids"][0].tolist(), grid_tokens(out["video_grid_thw"].tolist(), ip.merge_size),
                          token_id(hf_dir, VIDEO_PAD), what="video", pad=VIDEO_PAD)
        out["input_ids"] = torch.tensor([ids])
    return out
