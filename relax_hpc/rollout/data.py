"""Prompt datasets (JSONL, Parquet) and the data source that hands out rollout batches, with a resumable cursor.

Relax's data contract (``--prompt-data``, ``--input-key``, ``--label-key``, ``--metadata-key``,
``--apply-chat-template``, ``--rollout-shuffle``/``--rollout-seed``):

- one record per prompt; ``input_key`` holds the prompt: a string, or OpenAI-style messages
  (``[{"role": ..., "content": ...}]``) when ``apply_chat_template`` is on;
- ``label_key`` (optional) becomes ``sample.label``; ``metadata_key`` (optional per record) becomes
  ``sample.metadata`` (a mapping, or a JSON string of one); it may carry ``rm_type``;
- with ``apply_chat_template`` the messages (a bare string counts as one user message; ``system_prompt``
  is put first when set; ``tool_key`` supplies tools) go through ``tokenizer.apply_chat_template(...,
  tokenize=False, add_generation_prompt=True, **apply_chat_template_kwargs)`` and ``sample.prompt`` is the
  resulting text, as in Relax;
- ``multimodal_keys`` (``{"image": COLUMN}``, Relax's ``--multimodal-keys``): the column holds each prompt's images
  (paths relative to the data file, bytes, base64, one or a list); Relax's ``<image>`` markers or Qwen's
  ``{"type": "image"}`` content parts place them. They are read when a step draws the prompt
  (:meth:`PromptDataset.with_images`): files only under the data file's directory and ``data.media_roots``, URLs only
  with ``data.allow_media_urls``, within the pixel budgets, their tokens counted in the prompt's length; a bad one
  fails only its sample (docs/multimodal.md).

:class:`PromptDataset` reads files eagerly and reports the file, the line (JSONL) or row (Parquet) and the
key for any bad record; blank lines are skipped and prompts over ``max_prompt_len`` dropped, each logged once per
file with their lines and counted (:meth:`RolloutDataSource.metrics`). :func:`check_data_files` reads the first
:data:`CHECK_ROWS` rows of each file the same way before submit, and reports every problem at once.
:class:`RolloutDataSource` walks it epoch by epoch (reshuffled per epoch from ``seed + epoch`` when ``shuffle``),
and returns groups of ``n_samples_per_prompt`` independent copies with ``group_index``/``index`` set. Its cursor
(:meth:`RolloutDataSource.state_dict`) is plain JSON.

No torch here; pyarrow and transformers are imported only when a Parquet file or a tokenizer is used, so
the check before submit counts prompt tokens with the ``tokenizers`` library alone. The recipe's check of these
sections is :func:`relax_hpc.rollout.checks.check_data`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

from relax_hpc.errors import PermanentError
from relax_hpc.media import data_roots, short_url, url_scheme
from relax_hpc.multimodal import (IMAGE_PAD, IMAGE_PLACEHOLDER, TEXT_IMAGE_MARKER, TEXT_VIDEO_MARKER, VIDEO_PLACEHOLDER,
                                  video_parts, video_refs)
from relax_hpc.rollout.checks import chat_template_kwargs
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.seed import DEFAULT_SEED

if TYPE_CHECKING:
    from relax_hpc.rollout.config import DataConfig, RolloutConfig

log = logging.getLogger(__name__)

CHECK_ROWS = 1000  # rows of each file read before submit (check_data_files)
CHECK_LINE_BYTES = 64 << 20  # a longer JSONL line before submit: not a prompt file
SHOWN = 10  # line numbers, and distinct problems per file, listed in one message


class DataError(ValueError, PermanentError):
    """A dataset record or file that cannot be used; the message names the file, line/row and key. Permanent:
    the data reads the same after a restart, so the run fails at once with it."""


@dataclass(frozen=True)
class DataKeys:
    """Which record fields are the prompt, label, metadata and tools (Relax's ``--*-key`` flags)."""

    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str | None = "metadata"
    tool_key: str | None = "tools"
    input_name: str = "data.input_key"  # the recipe keys that set input_key/label_key, for the messages
    label_name: str = "data.label_key"
    image_key: str | None = None  # the record field with the images (``data.multimodal_keys.image``)
    audio_key: str | None = None  # the record field with the audio clips (``data.multimodal_keys.audio``)
    video_key: str | None = None  # the record field with the videos (``data.multimodal_keys.video``)


# --------------------------------------------------------------------------------------------------
# Reading records
# --------------------------------------------------------------------------------------------------


def expand_paths(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Files from a path, a directory (its *.jsonl, *.json and *.parquet, sorted) or a list of those."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in (".jsonl", ".json", ".parquet") and q.is_file())
            if not found:
                raise DataError(f"{p}: directory has no .jsonl, .json or .parquet files")
            out += found
        elif p.is_file():
            out.append(p)
        elif p.exists():  # a FIFO would block the read for ever, a device never end it
            raise DataError(f"{p}: not a regular file (a FIFO, socket or device)")
        else:
            raise DataError(f"{p}: no such file or directory")
    if not out:
        raise DataError("no data files given")
    return out


class Row(NamedTuple):
    """One row of a data file: ``where`` ("file: line N" / "file: row N"), ``number`` (the line, 1-based, or the
    row, 0-based) and ``item``: the record (a dict), the :class:`DataError` of a row that is not one (not UTF-8,
    not JSON, not an object), or None for a blank line."""

    where: str
    number: int
    item: dict[str, Any] | DataError | None


def scan_records(path: str | os.PathLike, limit: int | None = None, max_line: int | None = None) -> Iterator[Row]:
    """Every row of a JSONL or Parquet file (the first ``limit`` rows, blank lines counted), bad ones included
    as their error; a file that cannot be read at all raises :class:`DataError`. ``max_line``: a JSONL line
    longer than this many bytes ends the scan with an error (a file that is not JSONL at all)."""
    path = Path(path)
    rows = _scan_parquet(path) if path.suffix == ".parquet" else _scan_jsonl(path, max_line)
    for n, row in enumerate(rows):
        if limit is not None and n >= limit:
            return
        yield row


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for every record of a JSONL or Parquet file; ``where`` is "file:line N" / "file row N".
    Blank lines are skipped; the first bad row raises its :class:`DataError`."""
    for row in scan_records(path):
        if isinstance(row.item, DataError):
            raise row.item
        if row.item is not None:
            yield row.where, row.item


def _scan_jsonl(path: Path, max_line: int | None) -> Iterator[Row]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    with f:
        for lineno in itertools.count(1):
            try:
                raw = f.readline(-1 if max_line is None else max_line + 1)
            except OSError as e:
                raise DataError(f"{path}: line {lineno}: cannot be read ({e.strerror or type(e).__name__})") from None
            if not raw:
                return
            where = f"{path}: line {lineno}"
            if max_line is not None and len(raw) > max_line and not raw.endswith(b"\n"):
                raise DataError(f"{where}: longer than {max_line} bytes; is this a JSONL file?")
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield Row(where, lineno, DataError(
                    f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}). Fix: re-encode the "
                    "file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"))
                continue
            if not line.strip():
                yield Row(where, lineno, None)
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield Row(where, lineno, DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})"))
                continue
            except RecursionError:
                yield Row(where, lineno, DataError(f"{where}: JSON nested too deeply to read"))
                continue
            if not isinstance(rec, dict):
                yield Row(where, lineno, DataError(
                    f"{where}: each line must be a JSON object ({{\"key\": value, ...}}), got {_json_kind(rec)}"))
                continue
            yield Row(where, lineno, rec)


def _json_kind(v: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)


def _scan_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from None
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                yield Row(f"{path}: row {row}", row, rec)
                row += 1
    except DataError:
        raise
    except Exception as e:  # a damaged page past the footer
        raise DataError(f"{path}: row {row}: cannot read as Parquet ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------


class _Records:
    """Record → :class:`Sample`: the keys, the chat template, the token ids. Shared by :class:`PromptDataset` and
    the check before submit (:func:`check_dataset`), so both judge a record alike."""

    def __init__(self, keys: DataKeys, tokenizer: Any, apply_chat_template: bool,
                 apply_chat_template_kwargs: dict[str, Any] | None, system_prompt: str | None) -> None:
        self.keys = keys
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.system_prompt = system_prompt

    def _to_sample(self, where: str, rec: dict[str, Any]) -> Sample:
        k = self.keys
        if k.input_key not in rec:
            raise DataError(f"{where}: missing key {k.input_key!r} ({k.input_name}); the record has {_keys(rec)}. "
                            f"Fix: set {k.input_name} to the field that holds the prompt")
        raw = rec[k.input_key]
        label = None
        if k.label_key:
            if k.label_key not in rec:
                raise DataError(f"{where}: missing key {k.label_key!r} ({k.label_name}); the record has {_keys(rec)}. "
                                f"Fix: set {k.label_name} to the field that holds the label, or null for none")
            label = rec[k.label_key]
        metadata: dict[str, Any] = {}
        if k.metadata_key and rec.get(k.metadata_key) is not None:
            metadata = rec[k.metadata_key]
            if isinstance(metadata, str):
                try:
                    metadata = json.loads(metadata)
                except (json.JSONDecodeError, RecursionError):
                    raise DataError(f"{where}: key {k.metadata_key!r} (data.metadata_key) is a string "
                                    "that is not JSON; it must be a mapping or a JSON object") from None
            if not isinstance(metadata, dict):
                raise DataError(f"{where}: key {k.metadata_key!r} (data.metadata_key) must be a mapping, "
                                f"got {type(metadata).__name__}")
        tools = rec.get(k.tool_key) if k.tool_key else None
        images = _image_refs(rec.get(k.image_key)) if k.image_key else None
        audios = _image_refs(rec.get(k.audio_key), "an audio clip") if k.audio_key else None
        if k.image_key and self.apply_chat_template and _is_messages(raw):
            raw = [image_parts(m) for m in raw]
        if k.audio_key and self.apply_chat_template and _is_messages(raw):
            raw = [audio_parts(m) for m in raw]
        videos = video_refs(rec.get(k.video_key)) if k.video_key else None
        if k.video_key and self.apply_chat_template and _is_messages(raw):
            raw = [video_parts(m) for m in raw]
        prompt = self._prompt_text(where, raw, tools)
        if k.image_key and not self.apply_chat_template and isinstance(prompt, str):
            prompt = prompt.replace(TEXT_IMAGE_MARKER, IMAGE_PLACEHOLDER)
        if k.audio_key and not self.apply_chat_template and isinstance(prompt, str):
            from relax_hpc.audio import AUDIO_PLACEHOLDER, TEXT_AUDIO_MARKER

            prompt = prompt.replace(TEXT_AUDIO_MARKER, AUDIO_PLACEHOLDER)
        if k.video_key and not self.apply_chat_template and isinstance(prompt, str):
            prompt = prompt.replace(TEXT_VIDEO_MARKER, VIDEO_PLACEHOLDER)
        sample = Sample(prompt=prompt, label=label, metadata=metadata)
        if images is not None:
            sample.multimodal_inputs = {"images": images}
        if audios is not None:
            sample.multimodal_inputs = {"audios": audios}
        if videos is not None:
            sample.multimodal_inputs = {"videos": videos}
        if self.tokenizer is not None:
            sample.tokens = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return sample

    def _prompt_text(self, where: str, raw: Any, tools: Any) -> str:
        key = f"{self.keys.input_key!r} ({self.keys.input_name})"
        if not self.apply_chat_template:
            if isinstance(raw, str):
                return raw
            if _is_messages(raw):
                raise DataError(f"{where}: key {key} holds chat messages; set data.apply_chat_template: true "
                                "(and model.path for the tokenizer) to turn them into a prompt")
            raise DataError(f"{where}: key {key} must be a string prompt, got {type(raw).__name__}")
        if isinstance(raw, str):
            messages = [image_parts({"role": "user", "content": raw}) if self.keys.image_key
                        else audio_parts({"role": "user", "content": raw}) if self.keys.audio_key
                        else video_parts({"role": "user", "content": raw}) if self.keys.video_key
                        else {"role": "user", "content": raw}]
        elif _is_messages(raw):
            messages = [dict(m) for m in raw]
        else:
            raise DataError(f"{where}: key {key} must be a string or a list of chat messages "
                            "({'role': ..., 'content': ...}), got " + type(raw).__name__)
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except (json.JSONDecodeError, RecursionError):
                raise DataError(f"{where}: key {self.keys.tool_key!r} (data.tool_key) is not JSON") from None
        if self.tokenizer is None:  # the check before submit, without the template: the text it is given
            return "".join(m["content"] if isinstance(m.get("content"), str) else "" for m in messages)
        kwargs = dict(self.apply_chat_template_kwargs)
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:
            raise DataError(f"{where}: the tokenizer's chat template failed on this record "
                            f"({type(e).__name__}: {e})") from e


class PromptDataset(_Records):
    """The prompts of one or more files as template :class:`Sample` objects (no group/index yet).

    ``tokenizer``: a HF tokenizer (or a path to load one from); needed for ``apply_chat_template`` and
    ``max_prompt_len``. With a tokenizer every sample's ``tokens`` are its prompt ids
    (``tokenizer.encode(prompt, add_special_tokens=False)``: the chat template already has them).
    Prompts longer than ``max_prompt_len`` tokens are dropped (Relax's ``--rollout-max-prompt-len``);
    :attr:`num_filtered` counts them, :attr:`num_blank` the blank lines skipped; each file's are logged once, with
    their lines. A bad record raises its :class:`DataError` (file, line or row, key).
    """

    def __init__(
        self,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        *,
        keys: DataKeys = DataKeys(),
        tokenizer: Any = None,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        max_prompt_len: int | None = None,
        image_min_token_num: int | None = None,
        image_max_token_num: int | None = None,
        media_roots: Iterable[str | os.PathLike] = (),
        allow_media_urls: bool = False,
        max_image_pixels: int | None = None,
        max_prompt_pixels: int | None = None,
        prompt_room: int | None = None,
        max_audio_seconds: float | None = None,
        video_fps: float = 2.0,
        video_max_frames: int | None = None,
    ) -> None:
        self.files = expand_paths(paths)
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        super().__init__(keys, tokenizer, apply_chat_template, apply_chat_template_kwargs, system_prompt)
        self.max_prompt_len = max_prompt_len
        if apply_chat_template and tokenizer is None:
            raise DataError("apply_chat_template needs a tokenizer (model.path); none was given")
        if max_prompt_len is not None and tokenizer is None:
            raise DataError("max_prompt_len needs a tokenizer (model.path) to count prompt tokens; none was given")
        if keys.audio_key and not getattr(tokenizer, "name_or_path", None):
            raise DataError("data.multimodal_keys.audio needs the model's directory (model.path: its feature extractor "
                            "and tokenizer) to read audio with; none was given")
        self.max_audio_seconds = max_audio_seconds  # None: the processor's (audio.max_seconds)
        if keys.video_key and not getattr(tokenizer, "name_or_path", None):
            raise DataError("data.multimodal_keys.video needs the model's directory (model.path: its image processor "
                            "and tokenizer) to read videos with; none was given")
        self.video_sampling = (video_fps, video_max_frames)  # the row's frames' rate, the most kept (multimodal)
        if keys.image_key and not getattr(tokenizer, "name_or_path", None):
            raise DataError("data.multimodal_keys needs the model's directory (model.path: its image processor and "
                            "tokenizer) to read images with; none was given")
        self.image_tokens = (image_min_token_num, image_max_token_num)
        # the files a row may name (relax_hpc.media): its file's directory, these roots; URLs only when allowed
        self.media_roots = data_roots(media_roots)
        self.allow_media_urls = allow_media_urls
        self.pixel_budget = (max_image_pixels, max_prompt_pixels)  # None: the processor's (multimodal.pixel_budgets)
        self.prompt_room = prompt_room  # the most prompt tokens, images expanded, a sample may start with
        self.num_filtered = 0
        self.num_blank = 0
        self.samples: list[Sample] = []
        self._rows: dict[int, tuple[str, Path]] = {}  # sample position -> (where, the data file's directory): images
        for f in self.files:
            self._load(f)
        if not self.samples:
            why = f" ({self.num_filtered} longer than max_prompt_len = {max_prompt_len})" if self.num_filtered else ""
            raise DataError(f"{', '.join(map(str, self.files))}: no usable prompts{why}")

    def _load(self, path: Path) -> None:
        blank: list[int] = []
        long: list[int] = []
        rows = 0
        for row in scan_records(path):
            if row.item is None:
                blank.append(row.number)
                continue
            if isinstance(row.item, DataError):
                raise row.item
            rows += 1
            sample = self._to_sample(row.where, row.item)
            if self.max_prompt_len is not None and len(sample.tokens) > self.max_prompt_len:
                long.append(row.number)
                continue
            if sample.multimodal_inputs is not None:
                self._rows[len(self.samples)] = (row.where, path.resolve().parent)
            self.samples.append(sample)
        what = "row" if path.suffix == ".parquet" else "line"
        if blank:
            log.warning("%s: %d blank line(s) skipped (%s)", path, len(blank), _numbers("line", blank))
        if long:
            log.warning("%s: %d of %d prompts dropped: longer than rollout.max_prompt_len = %d tokens (%s)",
                        path, len(long), rows, self.max_prompt_len, _numbers(what, long))
        self.num_blank += len(blank)
        self.num_filtered += len(long)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        """The prompt template ``i``; a row with images comes with them read (:meth:`with_images`)."""
        sample = self.samples[i]
        row = self._rows.get(i if i >= 0 else i + len(self.samples))
        if row is not None and "audios" in (sample.multimodal_inputs or {}):
            return self.with_audio(sample, *row)
        if row is not None and "videos" in (sample.multimodal_inputs or {}):
            return self.with_videos(sample, *row)
        return sample if row is None else self.with_images(sample, *row)

    def with_audio(self, sample: Sample, where: str, base_dir: Path) -> Sample:
        """A copy of ``sample`` whose ``multimodal_inputs["audios"]`` are read (:func:`relax_hpc.audio.load_audio`:
        WAV only; the files a row may name as images'), resampled to the processor's rate and kept as
        base64 WAV (SGLang's ``audio_data``), and whose ``tokens`` have each ``<|AUDIO|>`` repeated once per audio
        token. A clip longer than ``data.max_audio_seconds`` (judged from its header) or that cannot be read,
        placeholders that do not match, or a prompt too long with its audio fail only this sample (FAILED,
        ``metadata["image_error"]`` with its row and reason, as a bad image)."""
        from relax_hpc.audio import AUDIO_PAD, TEXT_AUDIO_MARKER, AudioError, audio_tokens, clip_frames, \
            expand_audio, load_audio, sampling_rate, token_id, wav_base64
        from relax_hpc.multimodal import ImageError, MediaPolicy

        refs = sample.multimodal_inputs["audios"]
        model_dir = str(self.tokenizer.name_or_path)
        policy = MediaPolicy(base_dir=base_dir, roots=self.media_roots, allow_urls=self.allow_media_urls)
        clips = []
        try:
            if isinstance(refs, str) and refs.startswith(_BAD):
                raise AudioError(refs[len(_BAD):])
            budget = None if self.max_audio_seconds is None else \
                "a clip may have (data.max_audio_seconds). Fix: a shorter clip, or raise data.max_audio_seconds"
            for n, ref in enumerate(refs):
                try:
                    clips.append(load_audio(ref, model_dir, policy, self.max_audio_seconds, budget))
                except AudioError as e:
                    raise AudioError(f"clip {n}{_ref_name(ref)}: {e}") from None
            placeholders = sample.prompt.count(AUDIO_PAD)
            if placeholders != len(clips):
                raise AudioError(f"{len(clips)} clip(s) but {placeholders} audio placeholder(s) in the prompt. Fix: "
                                 f'one {TEXT_AUDIO_MARKER} in the text or one {{"type": "audio"}} content part per '
                                 "clip")
            counts = [audio_tokens(clip_frames(model_dir, len(c))) for c in clips]  # the features' count, uncomputed
            if any(c < 1 for c in counts):
                raise AudioError(f"clips of {[len(c) for c in clips]} samples: too short for one audio token")
            tokens = expand_audio(sample.tokens, counts, token_id(model_dir, AUDIO_PAD)) if clips else sample.tokens
            self._check_length(len(tokens), len(tokens) - len(sample.tokens) + len(clips), "audio")
        except (AudioError, ImageError) as e:
            return image_failed(sample.copy(multimodal_inputs=None),
                                f"{where}: key {self.keys.audio_key!r} (data.multimodal_keys.audio): {e}",
                                getattr(self.tokenizer, "eos_token_id", None), "audio")
        rate = sampling_rate(model_dir)
        return sample.copy(tokens=tokens, multimodal_inputs={"audios": [wav_base64(c, rate) for c in clips]})

    def with_videos(self, sample: Sample, where: str, base_dir: Path) -> Sample:
        """A copy of ``sample`` whose ``multimodal_inputs["videos"]`` are read (:func:`relax_hpc.multimodal.read_videos`:
        frames sampled by ``data.video_fps``/``data.video_max_frames``, each checked as an image, kept as lists of
        base64 PNG, SGLang's ``video_data``) and whose ``tokens`` have each ``<|video_pad|>`` expanded. A bad frame,
        placeholders that do not match, or a prompt too long with its videos fail only this sample, naming its row
        (as a bad image)."""
        from relax_hpc.multimodal import ImageError, MediaPolicy, read_videos

        policy = MediaPolicy(base_dir=base_dir, roots=self.media_roots, allow_urls=self.allow_media_urls)
        try:
            tokens, videos = read_videos(sample.multimodal_inputs["videos"], sample.tokens,
                                         self.tokenizer.name_or_path, policy, *self.video_sampling,
                                         max_pixels=self.pixel_budget[0], max_prompt_pixels=self.pixel_budget[1])
            self._check_length(len(tokens), len(tokens) - len(sample.tokens) + len(videos), "videos")
        except ImageError as e:
            return image_failed(sample.copy(multimodal_inputs=None),
                                f"{where}: key {self.keys.video_key!r} (data.multimodal_keys.video): {e}",
                                getattr(self.tokenizer, "eos_token_id", None), "videos")
        return sample.copy(tokens=tokens, multimodal_inputs={"videos": videos})

    def with_images(self, sample: Sample, where: str, base_dir: Path) -> Sample:
        """A copy of ``sample`` whose ``multimodal_inputs["images"]`` are read
        (:func:`relax_hpc.multimodal.load_image`), resized to ``data.image_min/max_token_num`` and kept as base64
        PNG (SGLang's ``image_data``), and whose ``tokens`` are the processor's (each ``<|image_pad|>`` repeated per
        image token). Read here, when a step draws the prompt, not when the file is read: a dataset of images does
        not sit in memory.

        A row's files are read only from ``base_dir`` (its data file's directory) and ``data.media_roots``, URLs only
        with ``data.allow_media_urls`` (:mod:`relax_hpc.media`). Each image's size is checked from its header against
        the pixel budgets (``data.max_image_pixels``, ``data.max_prompt_pixels``) before it is decoded. The expanded
        prompt counts against ``rollout.max_prompt_len`` and :attr:`prompt_room` (what train.max_seq_len leaves).

        A bad row (a file outside those directories or missing, not an image, over a budget, placeholders that do not
        match the images, too long with its images) fails only this sample (:func:`image_failed`): status FAILED,
        its row and reason in ``metadata["image_error"]``; the reason names paths and sizes, never file contents."""
        from relax_hpc.multimodal import (PROMPT_IMAGES, ImageError, MediaPolicy, decode, encode_ids, image_bytes,
                                          open_header, pixel_budgets, png_base64, resize_to_tokens)

        refs = sample.multimodal_inputs["images"]
        model_dir = str(self.tokenizer.name_or_path)
        policy = MediaPolicy(base_dir=base_dir, roots=self.media_roots, allow_urls=self.allow_media_urls)
        imgs = []
        try:
            if isinstance(refs, str) and refs.startswith(_BAD):
                raise ImageError(refs[len(_BAD):])
            per_image, per_prompt = pixel_budgets(model_dir, *self.pixel_budget)
            image_budget = ("an image may have (data.max_image_pixels" +
                            ("" if self.pixel_budget[0] is not None else "; null: the model processor's max_pixels") +
                            "). Fix: a smaller image, or raise data.max_image_pixels")
            total = 0
            for n, ref in enumerate(refs):
                try:
                    img = open_header(image_bytes(ref, policy), per_image, image_budget)
                    total += img.width * img.height
                    if total > per_prompt:  # before this one is decoded
                        default = "" if self.pixel_budget[1] is not None else \
                            f"; null: {PROMPT_IMAGES} × data.max_image_pixels"
                        raise ImageError(
                            f"{img.width}×{img.height}: the row's images come to {total} pixels with it, over the "
                            f"{per_prompt} pixels a prompt's images may have (data.max_prompt_pixels{default}). "
                            "Fix: fewer or smaller images, or raise data.max_prompt_pixels")
                    imgs.append(resize_to_tokens(decode(img), model_dir, *self.image_tokens))
                except ImageError as e:
                    raise ImageError(f"image {n}{_ref_name(ref)}: {e}") from None
            placeholders = sample.prompt.count(IMAGE_PAD)
            if placeholders != len(imgs):
                raise ImageError(f"{len(imgs)} image(s) but {placeholders} image placeholder(s) in the prompt. Fix: "
                                 f'one {TEXT_IMAGE_MARKER} in the text or one {{"type": "image"}} content part per '
                                 "image")
            tokens = encode_ids(model_dir, sample.tokens, imgs)["input_ids"][0].tolist() if imgs else sample.tokens
            self._check_length(len(tokens), len(tokens) - len(sample.tokens) + len(imgs))
        except ImageError as e:
            return image_failed(sample.copy(multimodal_inputs=None),
                                f"{where}: key {self.keys.image_key!r} (data.multimodal_keys.image): {e}",
                                getattr(self.tokenizer, "eos_token_id", None))
        return sample.copy(tokens=tokens, multimodal_inputs={"images": [png_base64(im) for im in imgs]})

    def _check_length(self, n: int, image_tokens: int, kind: str = "images") -> None:
        """A prompt with its images (``kind``: or audio) expanded (``n`` tokens, ``image_tokens`` of them the
        media's) longer than ``rollout.max_prompt_len`` or :attr:`prompt_room`: an
        :class:`~relax_hpc.multimodal.ImageError`. Such a row cannot be dropped when the file is read (its media are
        read when drawn): it fails its sample instead of reaching the trainer, where it would fail the step."""
        from relax_hpc.multimodal import ImageError

        fix = "fewer or smaller images (data.image_max_token_num shrinks them)" if kind == "images" else \
            "fewer or shorter videos (data.video_max_frames bounds them)" if kind == "videos" else \
            "fewer or shorter clips (data.max_audio_seconds bounds them)"
        what = f"with its {kind} the prompt has {n} tokens ({image_tokens} of them the {kind}')"
        if self.max_prompt_len is not None and n > self.max_prompt_len:
            raise ImageError(f"{what}, more than rollout.max_prompt_len = {self.max_prompt_len}. Fix: {fix}, or "
                             "raise rollout.max_prompt_len")
        if self.prompt_room is not None and n > self.prompt_room:
            raise ImageError(f"{what}, more than the {self.prompt_room} a sample's prompt may have to fit "
                             f"train.max_seq_len with its response. Fix: {fix}, or raise train.max_seq_len")


def _numbers(what: str, numbers: list[int]) -> str:
    """"line 3", "lines 3, 5, 9", "lines 3, 5, ... and 40 more": the first :data:`SHOWN`."""
    shown = ", ".join(map(str, numbers[:SHOWN]))
    more = f" and {len(numbers) - SHOWN} more" if len(numbers) > SHOWN else ""
    return f"{what}{'s' if len(numbers) > 1 else ''} {shown}{more}"


_BAD = "\0bad:"  # a row's image column that is not images: the reason, kept for the sample to fail with


def _image_refs(v: Any, what: str = "an image") -> list[Any] | str:
    """A row's image column as a list of references (none for null), or the reason it is not one."""
    if v is None:
        return []
    one = isinstance(v, (str, bytes, bytearray)) or (isinstance(v, dict) and ("bytes" in v or "path" in v))
    if one:
        return [v]
    if isinstance(v, list) and all(isinstance(x, (str, bytes, bytearray, dict)) for x in v):
        return list(v)
    return f"{_BAD}must be {what} (a path, bytes or base64) or a list of them, got {type(v).__name__}"


def _ref_name(ref: Any) -> str:
    """How an image reference reads in a message: a short path as itself, else its kind and size."""
    if isinstance(ref, str) and url_scheme(ref):  # never its credentials or query (a signed URL's token)
        return f" ({short_url(ref)})"
    if isinstance(ref, str) and len(ref) < 200 and not ref.startswith("data:"):
        return f" ({ref!r})"
    return f" ({type(ref).__name__}, {len(ref)} long)" if isinstance(ref, (str, bytes, bytearray)) else ""


def image_parts(message: dict) -> dict:
    """A chat message whose string content holds Relax's ``<image>`` markers, as Qwen's content list
    (``{"type": "image"}`` where each marker was, ``{"type": "text", ...}`` between); other messages as they are."""
    content = message.get("content")
    if not isinstance(content, str) or TEXT_IMAGE_MARKER not in content:
        return dict(message)
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(content.split(TEXT_IMAGE_MARKER)):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return {**message, "content": parts}


def audio_parts(message: dict) -> dict:
    """A chat message whose string content holds Relax's ``<audio>`` markers, as Qwen's content list
    (``{"type": "audio"}`` where each marker was, ``{"type": "text", ...}`` between); other messages as they are."""
    from relax_hpc.audio import TEXT_AUDIO_MARKER

    content = message.get("content")
    if not isinstance(content, str) or TEXT_AUDIO_MARKER not in content:
        return dict(message)
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(content.split(TEXT_AUDIO_MARKER)):
        if i:
            parts.append({"type": "audio"})
        if text:
            parts.append({"type": "text", "text": text})
    return {**message, "content": parts}


def image_failed(sample: Sample, why: str, pad_id: int | None = None, kind: str = "images") -> Sample:
    """``sample`` failed for its images, before any engine saw it (the driver does not send a FAILED sample): status
    FAILED, ``metadata["image_error"]``, a one-token response with loss mask 0 and reward 0 (so the step's tensors
    keep their shape and the sample counts for nothing), as a failed environment does (rollout/multiturn.py)."""
    log.error("sample fails, its %s cannot be used: %s", kind, why)
    sample.metadata = {**sample.metadata, "image_error": why}
    sample.reset_response(list(sample.tokens))
    sample.append_response([int(pad_id or 0)], "", [0.0], loss_mask_value=0)
    sample.status = SampleStatus.FAILED
    sample.reward = 0.0
    return sample


def _is_messages(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, dict) and "role" in m for m in x)


def _keys(rec: dict[str, Any]) -> str:
    return "keys " + ", ".join(repr(k) for k in rec) if rec else "no keys"


def load_tokenizer(path: str | os.PathLike) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# --------------------------------------------------------------------------------------------------
# Data source with a cursor
# --------------------------------------------------------------------------------------------------


class RolloutDataSource:
    """Hands out prompt groups in a deterministic order and remembers where it is.

    Order: epoch ``e`` visits every prompt once, in file order, or, with ``shuffle``, in the order of
    ``random.Random(seed + e).shuffle`` (so a resumed run sees exactly the prompts it would have). A batch
    that runs past the end of an epoch continues into the next one.

    Cursor: ``epoch``, ``offset`` (prompts of this epoch already handed out), ``sample_group_index`` and
    ``sample_index`` (the next ids to assign; ids never repeat across epochs). A group's index counts the prompts
    handed out before it, so it is ``epoch · len(dataset) + offset``: the journal audit reads a trained group's
    epoch from it (:func:`relax_hpc.exchange.audit.epochs`). :meth:`state_dict` /
    :meth:`load_state_dict` save and restore it; :meth:`save`/:meth:`load` do so through a JSON file,
    written atomically.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        dataset: PromptDataset | list[Sample],
        *,
        rollout_batch_size: int,
        n_samples_per_prompt: int = 1,
        shuffle: bool = False,
        seed: int = 42,
    ) -> None:
        if rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be at least 1, got {rollout_batch_size}")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be at least 1, got {n_samples_per_prompt}")
        self.dataset = dataset
        self.rollout_batch_size = rollout_batch_size
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self._order: list[int] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _current_order(self) -> list[int]:
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        return self._order

    def next_prompts(self, num_prompts: int | None = None) -> list[Sample]:
        """The next ``num_prompts`` (default ``rollout_batch_size``) prompt templates, advancing the cursor."""
        n = self.rollout_batch_size if num_prompts is None else num_prompts
        out: list[Sample] = []
        while len(out) < n:
            order = self._current_order()
            if self.offset >= len(order):
                self.epoch += 1
                self.offset = 0
                self._order = None
                continue
            out.append(self.dataset[order[self.offset]])
            self.offset += 1
        return out

    def get_samples(self, num_groups: int | None = None) -> list[list[Sample]]:
        """The next ``num_groups`` (default ``rollout_batch_size``) groups of ``n_samples_per_prompt`` samples.

        Each sample is an independent copy of its prompt's template (its metadata can be edited without
        touching the others) with ``group_index`` and ``index`` set.
        """
        groups = []
        for template in self.next_prompts(num_groups):
            group = []
            for _ in range(self.n_samples_per_prompt):
                group.append(template.copy(group_index=self.sample_group_index, index=self.sample_index))
                self.sample_index += 1
            self.sample_group_index += 1
            groups.append(group)
        return groups

    next_batch = get_samples

    def metrics(self) -> dict[str, float]:
        """What reading the data dropped (each step's metrics carry it, docs/metrics.md): prompts longer than
        ``max_prompt_len`` and blank lines skipped, over all of ``data.path``'s files."""
        return {"rollout/data_dropped/too_long": float(getattr(self.dataset, "num_filtered", 0)),
                "rollout/data_dropped/blank_line": float(getattr(self.dataset, "num_blank", 0))}

    def __iter__(self) -> Iterator[list[list[Sample]]]:
        while True:
            yield self.get_samples()

    # --- cursor --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "num_prompts": len(self.dataset),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``. The dataset (its size), shuffle and seed must be those it was saved with."""
        for key, mine in (("num_prompts", len(self.dataset)), ("shuffle", self.shuffle), ("seed", self.seed)):
            if key in state and state[key] != mine:
                raise DataError(
                    f"cannot resume the data cursor: it was saved with {key} = {state[key]!r}, "
                    f"this run has {mine!r}. Fix: use the same data files and data.shuffle/data.seed as the saved run"
                )
        if not 0 <= int(state["offset"]) <= len(self.dataset):
            raise DataError(f"cannot resume the data cursor: offset {state['offset']} is outside the dataset "
                            f"of {len(self.dataset)} prompts")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.sample_group_index = int(state.get("sample_group_index", 0))
        self.sample_index = int(state.get("sample_index", 0))
        self._order = None

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        with open(path) as f:
            self.load_state_dict(json.load(f))


# --------------------------------------------------------------------------------------------------
# From the recipe
# --------------------------------------------------------------------------------------------------


def parse_chat_template_kwargs(value: str | dict | None) -> dict[str, Any]:
    """``data.apply_chat_template_kwargs``: a JSON object string, as Relax's flag takes it (or a dict)."""
    try:
        return chat_template_kwargs(value)
    except ValueError as e:
        raise DataError(str(e)) from None


def dataset_keys(data_cfg: DataConfig, evaluation: bool = False) -> DataKeys:
    """The record keys of ``data.path`` (or, ``evaluation``, of the eval sets: ``eval_input_key``/``eval_label_key``
    where set), with the recipe keys that set them for the messages."""
    e_in = evaluation and data_cfg.eval_input_key is not None
    e_label = evaluation and data_cfg.eval_label_key is not None
    return DataKeys(
        input_key=data_cfg.eval_input_key if e_in else data_cfg.input_key,
        label_key=data_cfg.eval_label_key if e_label else data_cfg.label_key,
        metadata_key=data_cfg.metadata_key,
        tool_key=data_cfg.tool_key,
        input_name="data.eval_input_key" if e_in else "data.input_key",
        label_name="data.eval_label_key" if e_label else "data.label_key",
        image_key=(data_cfg.multimodal_keys or {}).get("image"),
        audio_key=(data_cfg.multimodal_keys or {}).get("audio"),
        video_key=(data_cfg.multimodal_keys or {}).get("video"),
    )


def dataset_from_config(data_cfg: DataConfig, rollout_cfg: RolloutConfig, *, tokenizer: Any = None, path: Any = None,
                        input_key: str | None = None, label_key: str | None = None,
                        evaluation: bool = False) -> PromptDataset:
    """A :class:`PromptDataset` from the recipe's ``data``/``rollout`` sections (``path`` etc. override them;
    ``evaluation``: the eval sets' keys)."""
    keys = dataset_keys(data_cfg, evaluation)
    if input_key or label_key is not None:
        keys = DataKeys(input_key=input_key or keys.input_key,
                        label_key=label_key if label_key is not None else keys.label_key,
                        metadata_key=keys.metadata_key, tool_key=keys.tool_key, image_key=keys.image_key,
                        audio_key=keys.audio_key)
    path = path if path is not None else data_cfg.path
    if path is None:
        raise DataError("data.path is not set: give the JSONL/Parquet prompt file(s)")
    return PromptDataset(
        path, keys=keys, tokenizer=tokenizer,
        apply_chat_template=data_cfg.apply_chat_template,
        apply_chat_template_kwargs=parse_chat_template_kwargs(data_cfg.apply_chat_template_kwargs),
        system_prompt=data_cfg.system_prompt,
        max_prompt_len=rollout_cfg.max_prompt_len,
        image_min_token_num=data_cfg.image_min_token_num,
        image_max_token_num=data_cfg.image_max_token_num,
        media_roots=data_cfg.media_roots,
        allow_media_urls=data_cfg.allow_media_urls,
        max_image_pixels=data_cfg.max_image_pixels,
        max_prompt_pixels=data_cfg.max_prompt_pixels,
        max_audio_seconds=data_cfg.max_audio_seconds,
        video_fps=data_cfg.video_fps,
        video_max_frames=data_cfg.video_max_frames,
    )


def prompt_room(rollout_cfg: RolloutConfig, max_seq_len: int, multiturn: bool) -> int:
    """The most prompt tokens (images expanded) a sample may start with and still fit ``train.max_seq_len``, the
    longest sample the trainer takes: room for ``rollout.max_response_len`` after it (one turn), or for one token
    within the context bound (multi-turn: ``rollout.max_context_len``, else ``train.max_seq_len``; a custom generate
    function: ``train.max_seq_len``). :attr:`PromptDataset.prompt_room` of the run's training data."""
    if multiturn or rollout_cfg.custom_generate_function_path is not None:
        return max(1, min(rollout_cfg.max_context_len or max_seq_len, max_seq_len) - 1)
    return max(1, max_seq_len - rollout_cfg.max_response_len)


def eval_datasets_from_config(data_cfg: DataConfig, rollout_cfg: RolloutConfig, *,
                              tokenizer: Any = None) -> dict[str, PromptDataset]:
    """``data.eval_prompt_data`` (name → path) as datasets, read with ``eval_input_key``/``eval_label_key``."""
    return {
        name: dataset_from_config(data_cfg, rollout_cfg, tokenizer=tokenizer, path=path, evaluation=True)
        for name, path in data_cfg.eval_prompt_data.items()
    }


def data_source_from_config(dataset: PromptDataset, data_cfg: DataConfig, rollout_cfg: RolloutConfig,
                            run_seed: int = DEFAULT_SEED) -> RolloutDataSource:
    seed = data_cfg.seed if data_cfg.seed is not None else run_seed
    return RolloutDataSource(
        dataset, rollout_batch_size=rollout_cfg.rollout_batch_size,
        n_samples_per_prompt=rollout_cfg.n_samples_per_prompt,
        shuffle=data_cfg.shuffle, seed=seed,
    )


# --------------------------------------------------------------------------------------------------
# The check before submit
# --------------------------------------------------------------------------------------------------


@dataclass
class DataCheck:
    """What :func:`check_dataset` found: ``problems`` refuse the dataset (each names the file, the lines or rows,
    and the key); ``notes`` do not (blank lines skipped, some prompts over ``max_prompt_len``, a check skipped)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check_dataset(paths: str | os.PathLike | Iterable[str | os.PathLike], *, keys: DataKeys = DataKeys(),
                  apply_chat_template: bool = False, system_prompt: str | None = None,
                  max_prompt_len: int | None = None, count_tokens: Callable[[str], int] | None = None,
                  rows: int = CHECK_ROWS) -> DataCheck:
    """Read the first ``rows`` rows of each file of a dataset as :class:`PromptDataset` would, and report every
    problem at once instead of the first: a file that cannot be read (not Parquet, not a regular file), not
    UTF-8, not JSON, a row that is not an object, a missing key, a value of the wrong type (a Parquet column
    too), an empty file. Blank lines are skipped, as the run skips them: a note with their lines.

    ``count_tokens`` (the model's tokenizer; None: lengths are not checked) against ``max_prompt_len``: refused
    when every checked prompt would be dropped, a note with the count and lines when some would. With
    ``apply_chat_template`` the template is not applied here (that needs transformers, and torch): the text of
    the messages is counted, which the template only lengthens, so the count is a lower bound."""
    out = DataCheck()
    try:
        files = expand_paths(paths)
    except DataError as e:
        out.problems.append(str(e))
        return out
    records = _Records(keys, None, apply_chat_template, None, system_prompt)
    checked: list[tuple[Path, int]] = []  # every prompt checked, and those too long
    with_images = 0  # rows checked that have the image column
    long: dict[Path, list[int]] = {}
    empty: list[Path] = []
    partial = False  # a file longer than ``rows``: only its first rows were read
    for f in files:
        what = "row" if f.suffix == ".parquet" else "line"
        bad: dict[str, list[int]] = {}  # problem (without file and line) → lines
        blank: list[int] = []
        n = 0
        try:
            for row in scan_records(f, limit=rows, max_line=CHECK_LINE_BYTES):
                if row.item is None:
                    blank.append(row.number)
                    continue
                n += 1
                try:
                    if isinstance(row.item, DataError):
                        raise row.item
                    sample = records._to_sample(row.where, row.item)
                except DataError as e:
                    bad.setdefault(str(e).removeprefix(f"{row.where}: "), []).append(row.number)
                    continue
                checked.append((f, row.number))
                with_images += bool(keys.image_key and row.item.get(keys.image_key) is not None)
                if count_tokens is not None and max_prompt_len is not None \
                        and count_tokens(sample.prompt) > max_prompt_len:
                    long.setdefault(f, []).append(row.number)
        except DataError as e:
            out.problems.append(str(e))
        partial |= n + len(blank) >= rows
        for i, (text, numbers) in enumerate(bad.items()):
            if i == SHOWN:
                out.problems.append(f"{f}: {len(bad) - SHOWN} more different problems (fix these first)")
                break
            out.problems.append(f"{f}: {_numbers(what, numbers)}: {text}")
        if blank:
            out.notes.append(f"{f}: {len(blank)} blank line(s) will be skipped ({_numbers('line', blank)})")
        if n == 0 and not any(p.startswith(f"{f}: ") for p in out.problems):
            empty.append(f)
    for f in empty:
        text = f"{f}: empty: no records" + (" (only blank lines)" if f.suffix != ".parquet" and f.stat().st_size
                                          else "")
        # an empty file among others is only a note: the run reads the others
        (out.problems if len(empty) == len(files) else out.notes).append(text)
    if keys.image_key and checked and not with_images:
        out.problems.append(f"none of the {len(checked)} rows checked has the image column {keys.image_key!r} "
                            "(data.multimodal_keys.image). Fix: set data.multimodal_keys to {image: COLUMN}, the "
                            "record field that holds each prompt's image paths, bytes or base64")
    n_long = sum(map(len, long.values()))
    if n_long:
        lower = " at least" if apply_chat_template else ""
        where = "; ".join(f"{f}: {_numbers('row' if f.suffix == '.parquet' else 'line', v)}" for f, v in long.items())
        if partial:
            where += f"; the first {rows} rows of each file were checked"
        if n_long == len(checked):
            out.problems.append(
                f"all {n_long} prompts checked are longer than rollout.max_prompt_len = {max_prompt_len} tokens"
                f"{' (without the chat template)' if lower else ''}: every one would be dropped ({where}). "
                "Fix: raise rollout.max_prompt_len, or shorten the prompts")
        else:
            out.notes.append(f"{lower.strip() + ' ' if lower else ''}{n_long} of the {len(checked)} prompts checked "
                             f"are longer than rollout.max_prompt_len = {max_prompt_len} tokens and will be dropped "
                             f"({where})")
    return out


def token_counter(model_path: str | os.PathLike | None) -> tuple[Callable[[str], int] | None, str | None]:
    """(count_tokens, None) from the model's ``tokenizer.json`` (the ``tokenizers`` library: no torch, no
    transformers; the same ids as the run's fast tokenizer with ``add_special_tokens=False``), or (None, why not)."""
    if model_path is None:
        return None, "model.path is not set"
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        return None, f"no {path} (a local fast tokenizer) to count prompt tokens with"
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        return None, f"cannot load {path} ({type(e).__name__}: {e})"
    return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), None


def check_data_files(data_cfg: DataConfig, rollout_cfg: RolloutConfig, files: dict[str, Path],
                     model_path: str | os.PathLike | None, rows: int = CHECK_ROWS) -> tuple[list[tuple[str, str]],
                                                                                           list[str]]:
    """:func:`check_dataset` of each dataset of the recipe: ``files`` maps its key (``data.path``,
    ``data.eval_prompt_data.<name>``) to the resolved path. Returns ((key, problem) pairs, notes). The tokenizer
    is loaded (:func:`token_counter`) only when ``rollout.max_prompt_len`` is set; where it cannot be, the lengths
    are not checked and a note says why."""
    count = None
    notes: list[str] = []
    if rollout_cfg.max_prompt_len is not None and files:
        count, why = token_counter(model_path)
        if count is None:
            notes.append(f"prompt lengths not checked against rollout.max_prompt_len: {why}")
    problems: list[tuple[str, str]] = []
    for key, path in files.items():
        res = check_dataset(path, keys=dataset_keys(data_cfg, evaluation=key != "data.path"),
                            apply_chat_template=data_cfg.apply_chat_template, system_prompt=data_cfg.system_prompt,
                            max_prompt_len=rollout_cfg.max_prompt_len, count_tokens=count, rows=rows)
        problems += [(key, p) for p in res.problems]
        notes += [f"{key}: {n}" for n in res.notes]
    return problems, notes
