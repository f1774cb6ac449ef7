"""The reference engine's model: an HF transformers model and its tokenizer, the ``/generate`` request checks and
answers in SGLang's wire format, the health check, the server/model info and the memory hand-over
(``/release_memory_occupation``, ``/resume_memory_occupation``). HTTP-free; the batches run on its
:class:`~relax_hpc.engines.scheduler.Scheduler`, the weights arrive through its
:class:`~relax_hpc.engines.receiver.WeightReceiver` half.

The model sits on one device (``cpu`` or ``cuda:N``); the scheduler builds each batch's inputs on the CPU and moves
them there, and samples on the CPU from float32 logits, so a seeded request draws the same way on either.

**Input log-probs (scoring requests).** ``return_logprob`` with ``logprob_start_len`` K (>= 0) adds SGLang's
``meta_info.input_token_logprobs``: one ``[logprob, token_id, text|null]`` row per input position K..L-1, the first
row's log-prob ``null`` (SGLang pads it: the logits before position K are not computed), row j the log-prob of
``input_ids[K + j]`` given the tokens before it. ``top_logprobs_num`` N adds ``input_top_logprobs`` (``null``, then
N rows ``[logprob, token_id, text|null]`` per position, largest first) and ``output_top_logprobs`` (``[]``). They
come from one teacher-forced forward of the whole input (:meth:`CPUEngine.input_logprobs`), ``log_softmax`` of the
float32 logits **without** the request temperature, as SGLang's logits processor computes input log-probs (its
``temp_scaled_logprobs`` is off unless patched). ``max_new_tokens`` 0 then generates nothing: ``output_ids`` ``[]``,
finish reason ``{"type": "length", "length": 0}``, as SGLang's ``FINISH_LENGTH``. A teacher answers these.

**Images (a vision-language model).** A Qwen2.5-VL / Qwen3-VL directory (:func:`relax_hpc.multimodal.is_vlm`) loads
as ``AutoModelForImageTextToText``. A Qwen2.5-VL request's ``video_data`` (:meth:`CPUEngine._videos`: a video a
list of frames, as the data sends them) runs the same way. A request's ``image_data`` takes SGLang's forms (one image for one request, a
list for one request, a list per item of a batch; each a base64 string, a ``data:`` URL or a path on the engine's
host). The prompt (text or ids) has one ``<|image_pad|>`` per image, as the chat template writes it, or the runs
already expanded; :func:`relax_hpc.multimodal.encode_ids` makes the pixels and the expanded ids. A request with
images runs on its own in its HTTP thread, not in the scheduler's batches (its M-RoPE positions and pixels are per
request; the model lock per forward, as there; identical ones running at once share one prefill:
:meth:`CPUEngine._shared_prefill`); it obeys the pause modes and aborts between its tokens
(:meth:`CPUEngine._solo_control`; ``retract`` holds it as ``in_place``). Its answer adds
``meta_info["input_ids"]`` (relax_hpc's: the expanded prompt ids, so a caller can train on exactly what was run);
``prompt_tokens`` counts them, as SGLang counts the expanded prompt. A bad image is answered 400, naming it (its
place in ``image_data`` and the reason, never its bytes).

**Image memory is bounded** (:class:`PixelBudget`). Before any image of a request is decoded, its size is read from
its header (over :data:`~relax_hpc.multimodal.MAX_IMAGE_PIXELS` an image: 400) and the request's pixels are reserved
from the engine's budget (``--image-pixel-budget``, source pixels of the requests with images being served at
once), held until it is answered. A request that does not fit waits for room up to ``--image-wait-s``, then is
answered 503 with ``Retry-After`` (a client retries it, here or on another engine); one larger than the whole budget
can never fit: 400. So decoded images, the processor's pixels and their KV caches grow with the budget, not with the
number of concurrent requests.

**Routed experts (MoE routing replay).** ``return_routed_experts`` (one for all, or one per item) adds SGLang's
``meta_info["routed_experts"]``: base64 int32 ``[prompt + completion - 1, layers, top_k]``, each token's experts as
transformers' router picks them, from one teacher-forced forward after generation (:meth:`CPUEngine.routed_experts`).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import inspect
import logging
import os
import random
import sys
import threading
import time
import traceback
import uuid

import torch

from relax_hpc.engines.bad_output import BAD_OUTPUT_ENV, BadOutput
from relax_hpc.engines.http import ENGINE_VERSION, HTTPError, brief
from relax_hpc.engines.lora import AdapterServing
from relax_hpc.engines.receiver import WeightReceiver, checkpoint_key_mapping
from relax_hpc.engines.scheduler import Req, Scheduler, abort_reason, left_padded, sample_batch
from relax_hpc.engines import audio as engine_audio
from relax_hpc.multimodal import MAX_IMAGE_PIXELS, ImageError, is_vlm

log = logging.getLogger("relax_hpc.cpu_engine")

TOP_K_ALL = 1 << 30  # SGLang's "top_k off" value (1073741824); -1 also means off
IMAGE_PIXEL_BUDGET = 2 * MAX_IMAGE_PIXELS  # source pixels of the images being served at once (--image-pixel-budget)
IMAGE_WAIT_S = 30.0  # a request with images waits this long for room in the budget, then 503 (--image-wait-s)
RETRY_AFTER_S = 2  # the Retry-After of such a 503, seconds

# SGLang 0.5.23 SamplingParams keys (unknown keys are rejected, as SGLang does). The ones in _SUPPORTED
# change what we generate; the others are accepted only at a neutral value (None, default, empty).
_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
}
_SUPPORTED = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "ignore_eos",
              "sampling_seed", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
              "stream_interval", "custom_params"}
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "n": 1}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU memory types (sglang.srt.constants)


def resolve_device(device: str = "auto") -> str:
    """``auto``: ``cuda:0`` of the visible GPUs when torch sees one, else ``cpu``; ``cuda`` is ``cuda:0``."""
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}, but torch sees no CUDA device here. Fix: --device auto or cpu")
        return "cuda:0" if device == "cuda" else str(torch.device(device))
    if device != "cpu":
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {device!r}")
    return "cpu"


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    dt = getattr(torch, dtype, None)
    if dtype not in ("float32", "bfloat16", "float16") or not isinstance(dt, torch.dtype):
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {dtype!r}")
    return dt


class Busy(HTTPError):
    """503: the engine cannot take the request now; ``retry_after`` seconds is when to try again (the HTTP layer
    sends it as ``Retry-After``)."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S):
        super().__init__(503, message)
        self.retry_after = retry_after


class PixelBudget:
    """Source pixels (width × height, from the headers) of the images of the requests being served at once: a
    request reserves its images' pixels before decoding any and returns them when answered. ``in_use`` now,
    ``peak`` the most ever held (never over ``total``), ``waiting`` the requests waiting for room now, ``refused``
    those turned away for want of it."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"--image-pixel-budget must be at least 1 pixel, got {total}")
        self.total, self.in_use, self.peak, self.refused, self.waiting = int(total), 0, 0, 0, 0
        self.cv = threading.Condition()

    def acquire(self, n: int, wait_s: float) -> bool:
        """Reserve ``n`` pixels, waiting up to ``wait_s`` for room; False (and nothing reserved) if none came."""
        with self.cv:
            self.waiting += 1
            self.cv.notify_all()
            try:
                fits = self.cv.wait_for(lambda: self.in_use + n <= self.total, timeout=max(0.0, wait_s))
            finally:
                self.waiting -= 1
            if not fits:
                self.refused += 1
            else:
                self.in_use += n
                self.peak = max(self.peak, self.in_use)
            self.cv.notify_all()  # whoever watches the state (a test, a waiting request)
            return fits

    def release(self, n: int) -> None:
        with self.cv:
            self.in_use -= n
            self.cv.notify_all()

    def state(self) -> dict:
        with self.cv:
            return {"image_pixel_budget": self.total, "image_pixels_in_use": self.in_use,
                    "image_pixels_peak": self.peak, "image_requests_waiting": self.waiting,
                    "image_requests_refused": self.refused}


class SharedPrefill:
    """One prefill that identical requests with media running at once share (:meth:`CPUEngine._shared_prefill`):
    set once, by the first of them; ``waiting`` counts the others."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.logits: torch.Tensor | None = None
        self.cache = None
        self.waiting = 0


def _digest(media: dict) -> tuple:
    """A request's media tensors as a key: name, shape, dtype and a hash of the bytes of each."""
    out = []
    for k in sorted(media):
        v = media[k]
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous().view(-1)
            v = (tuple(v.shape), str(v.dtype), hashlib.blake2b(t.view(torch.uint8).numpy()).hexdigest())
        out.append((k, repr(v)))
    return tuple(out)


class CPUEngine(AdapterServing, WeightReceiver):  # AdapterServing: LoRA adapters (engines/lora.py)
    """The model, its weights and the endpoint logic (HTTP-free, so it reads like SGLang's request structs). The
    reference engine: on the CPU, or on one GPU (``device``)."""

    update_paths = ("distributed", "tensor", "disk")

    def __init__(self, model_path: str, dtype: str = "auto", max_batch: int = 64, batch_wait_ms: float = 5.0,
                 seed: int | None = None, weight_version: str = "default", served_model_name: str | None = None,
                 device: str = "auto", weight_sync_backends: list[str] | None = None,
                 image_pixel_budget: int = IMAGE_PIXEL_BUDGET, image_wait_s: float = IMAGE_WAIT_S):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = str(model_path)
        self.served_model_name = served_model_name or self.model_path
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if weight_sync_backends:
            self.weight_sync_backends = list(weight_sync_backends)
        self.omni = engine_audio.is_omni(self.model_path)  # an omni thinker: audio (relax_hpc.engines.audio)
        self.config = engine_audio.load_config(self.model_path) if self.omni else \
            AutoConfig.from_pretrained(self.model_path)
        self.vlm = is_vlm(self.model_path)
        if self.vlm:  # Qwen2_5_VLForConditionalGeneration / Qwen3VLForConditionalGeneration
            from transformers import AutoModelForImageTextToText as model_class
        elif self.omni:
            model_class = engine_audio.model_class()
        else:
            model_class = AutoModelForCausalLM
        self.model = model_class.from_pretrained(self.model_path, dtype=self.dtype).eval()
        if self.device != "cpu":
            torch.cuda.set_device(self.device)
            self.model.to(self.device)
        self.model.requires_grad_(False)
        # the sender's names are the checkpoint's; transformers renames some on load (Qwen2.5-VL's model.layers.*)
        super().__init__(self.model.state_dict(keep_vars=True), weight_version,
                         key_mapping=checkpoint_key_mapping(self.model))
        self.released: set[str] = set()  # SGLang memory tags released and not yet resumed
        self.memory_lock = threading.Lock()  # one release or resume at a time
        # whether a release frees the weights: on CUDA (a test sets it on the CPU, to run that path in CI)
        self.frees_memory = self.device != "cpu"
        self.stash: dict[int, tuple[torch.Tensor, torch.Size, torch.dtype]] = {}  # released params: shape, dtype
        self.tokenizer = _load_tokenizer(self.model_path)
        text_cfg = getattr(self.config, "text_config", None) or self.config  # a VLM's text model says these
        self.vocab_size = int(getattr(self.config, "vocab_size", None) or text_cfg.vocab_size)
        self.context_len = int(getattr(text_cfg, "max_position_embeddings", 4096))
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        pad = getattr(self.config, "pad_token_id", None)
        pad = pad if pad is not None else getattr(text_cfg, "pad_token_id", None)
        self.pad_id = pad if pad is not None else 0
        self.rng = random.Random(seed)
        spec = os.environ.get(BAD_OUTPUT_ENV)
        self.bad_output = BadOutput(spec, self.vocab_size) if spec else None
        self.started = time.time()
        self.scheduler = Scheduler(self, max_batch, batch_wait_ms / 1000.0)
        self.solo: dict[int, Req] = {}  # requests with images running alone (_generate_one), under scheduler.cv
        self.prefills: dict[tuple, SharedPrefill] = {}  # the prefills of such requests running now, by input
        self.prefills_lock = threading.Lock()
        self.pixels = PixelBudget(image_pixel_budget)  # the images being served at once (module docstring)
        self.image_wait_s = float(image_wait_s)
        self.scheduler.thread.start()
        self.host, self.port, self.url = "", 0, ""

    # ------------------------------------------------------------------ generate
    def finish_reason(self, r: Req, tok: int) -> dict | None:
        # SGLang order: the length check wins over a matched stop token on the last position.
        if len(r.output_ids) >= r.max_new_tokens:
            return {"type": "length", "length": r.max_new_tokens}
        if (tok in self.eos_ids and not r.ignore_eos) or tok in r.stop_ids:
            return {"type": "stop", "matched": tok}
        if r.stop_strs:  # decode a tail long enough to hold any stop string (a token is at least one char here)
            tail = self.tokenizer.decode(r.output_ids[-(max(map(len, r.stop_strs)) + 8):],
                                         skip_special_tokens=r.skip_special_tokens)
            for s in r.stop_strs:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def generate(self, body: dict):
        held: list[int] = []  # pixels this request reserved for its images (_images): returned once answered
        try:
            return self._generate(body, held)
        finally:
            if held:
                self.pixels.release(sum(held))

    def _generate(self, body: dict, held: list[int]):
        if body.get("stream"):
            raise HTTPError(400, "stream=true is not supported by the CPU engine")
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise HTTPError(400, "Either text or input_ids should be provided (exactly one).")
        if has_text:
            if self.tokenizer is None:
                raise HTTPError(400, "text input needs a tokenizer in the model directory; send input_ids")
            texts = body["text"]
            batched = isinstance(texts, list)
            prompts = [self.tokenizer.encode(t) for t in (texts if batched else [texts])]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise HTTPError(400, "input_ids must be a non-empty list of token ids (or a list of such lists)")
            batched = isinstance(ids[0], list)
            prompts = ids if batched else [ids]
        n = len(prompts)
        sps, rlps, rids, starts, tops = (_per_item(body.get(k), n, k) for k in (
            "sampling_params", "return_logprob", "rid", "logprob_start_len", "top_logprobs_num"))
        text_in_lp = bool(body.get("return_text_in_logprobs"))
        mms = self._images(body.get("image_data"), prompts, batched, held)
        vids = self._videos(body.get("video_data"), prompts, batched, held)
        if any(vids):
            if any(mms):
                raise HTTPError(400, "image_data and video_data in one request are not supported by the CPU engine")
            mms = vids
        auds = engine_audio.audio_inputs(self, body.get("audio_data"), prompts, batched, HTTPError)
        if any(auds):
            if any(mms):
                raise HTTPError(400, "image_data and audio_data in one request are not supported by the CPU engine")
            mms = auds
        if any(mms):
            prompts = [p if mm is None else mm["input_ids"][0].tolist() for p, mm in zip(prompts, mms)]
        reqs = [self._make_req(p, sp or {}, bool(lp), rid) for p, sp, lp, rid in zip(prompts, sps, rlps, rids)]
        for r, mm in zip(reqs, mms):
            r.mm = mm
        scoring = [_input_request(r, k, t) for r, k, t in zip(reqs, starts, tops)]
        if any(mms) and any(k is not None for k, _ in scoring):  # refused before any forward is spent on it
            raise HTTPError(400, "input log-probs (logprob_start_len) of a request with images are not supported "
                                 "by the CPU engine")
        asked = [(r.input_ids, k, t) for r, (k, t) in zip(reqs, scoring) if k is not None]
        found = iter(self.input_logprobs(asked) if asked else [])
        inputs = [next(found) if k is not None else None for k, _ in scoring]
        for r, inp in zip(reqs, inputs):
            if inp is not None and r.max_new_tokens == 0:  # answered by that forward: the weights it used
                r.weight_version = self.weight_version
        todo = [r for r in reqs if not r.done.is_set()]
        if any(mms):
            with self.scheduler.cv:
                if self.scheduler.refusal is not None:
                    raise HTTPError(400, self.scheduler.refusal)
            for r in todo:  # one at a time, outside the batches (module docstring)
                if r.mm is None:
                    self.scheduler.submit([r])
                    continue
                with self.scheduler.cv:
                    self.scheduler.stats["num_requests"] += 1
                    self.solo[id(r)] = r
                self._generate_one(r)
        else:
            self.scheduler.submit(todo)
        for r in reqs:
            r.done.wait()
        errors = [r.error for r in reqs if r.error]
        if errors:
            raise HTTPError(500, f"generation failed: {errors[0]}")
        outs = [self._response(r, text_in_lp, inp, t) for r, inp, (_, t) in zip(reqs, inputs, scoring)]
        routed = _per_item(body.get("return_routed_experts"), n, "return_routed_experts")
        if any(routed):  # MoE routing replay: SGLang's meta_info["routed_experts"] (routed_experts below)
            if any(mms):
                raise HTTPError(400, "return_routed_experts with images is not supported by the CPU engine")
            asked = [(r, o) for r, o, want in zip(reqs, outs, routed) if want]
            for (_, o), ids in zip(asked, self.routed_experts([r.input_ids + r.output_ids for r, _ in asked])):
                o["meta_info"]["routed_experts"] = base64.b64encode(ids.numpy().astype("<i4").tobytes()).decode()
        if self.bad_output is not None:
            for o in outs:
                self.bad_output.spoil(o)
        return outs if batched else outs[0]

    def _images(self, image_data, prompts: list, batched: bool, held: list[int]) -> list[dict | None]:
        """Per item: None (no images) or :func:`relax_hpc.multimodal.encode_ids`'s inputs (``input_ids`` expanded,
        ``pixel_values``, ``image_grid_thw``). SGLang's forms of ``image_data`` (module docstring): for one request
        an image or a list of images, for a batch one entry per item (:meth:`_media`)."""
        from relax_hpc.multimodal import encode_ids, image_bytes, open_header

        def open_image(ref) -> list:
            try:
                return [open_header(image_bytes(ref))]
            except ImageError as e:  # the reason names a path or a size, never the bytes
                kind = f"{type(ref).__name__} of {len(ref)}" if hasattr(ref, "__len__") else type(ref).__name__
                raise ImageError(f"({kind}) is not a usable image: {e}") from None

        return self._media("image", image_data, prompts, batched, held, serves="a Qwen2.5-VL or Qwen3-VL",
                           as_list=lambda x: [] if x is None else x if isinstance(x, list) else [x], opened=open_image,
                           encode=lambda p, media: encode_ids(self.model_path, p, [frames[0] for frames in media]))

    def _videos(self, video_data, prompts: list, batched: bool, held: list[int]) -> list[dict | None]:
        """Per item: None (no videos) or :func:`relax_hpc.multimodal.encode_media_ids`'s inputs (``input_ids`` with
        each ``<|video_pad|>`` expanded, ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``).
        ``video_data`` in SGLang's forms: for one request a video or a list of videos, for a batch one entry per
        item; a video is a list of frames (each an image form: base64, ``data:`` URL, a path on the engine's host;
        shown at :data:`~relax_hpc.multimodal.MODEL_FPS`, as sent) or an animated GIF/PNG/WebP (:meth:`_media`)."""
        from relax_hpc.multimodal import encode_media_ids, image_bytes, open_header, video_frame_refs

        def open_video(v) -> list:
            try:
                refs, _ = video_frame_refs(v)
                if not refs:
                    raise ImageError("a video without frames")
                frames = []
                for k, f in enumerate(refs):
                    try:
                        frames.append(open_header(image_bytes(f)))
                    except ImageError as e:
                        raise ImageError(f"frame {k}: {e}") from None
                return frames
            except ImageError as e:
                raise ImageError(f"is not a usable video: {e}") from None

        def encode(p: list, videos: list[list]) -> dict:
            for j, frames in enumerate(videos):
                if len({f.size for f in frames}) > 1:
                    raise ImageError(f"video_data[{j}]: frames of more than one size")
            return encode_media_ids(self.model_path, p, videos=videos)

        refusal = None if getattr(self.config, "model_type", None) == "qwen2_5_vl" else (
            f"video_data for a {getattr(self.config, 'model_type', '?')} model: the CPU engine serves videos to "
            "Qwen2.5-VL only (megatron-bridge 0.3.1's Qwen3-VL takes no video)")
        return self._media("video", video_data, prompts, batched, held, serves="a Qwen2.5-VL", refusal=refusal,
                           as_list=lambda x: [] if x is None else [x] if isinstance(x, (str, dict)) else list(x),
                           opened=open_video, encode=encode)

    def _media(self, kind: str, data, prompts: list, batched: bool, held: list[int], *, serves: str, as_list,
               opened, encode, refusal: str | None = None) -> list[dict | None]:
        """The one path of a request's images or videos (``kind``): per item None or ``encode(prompt, decoded)``,
        ``decoded`` holding per image or video its frames (an image: one). ``as_list`` makes an item's entry a list
        of images or videos, ``opened`` reads one to its frames' headers (nothing decoded; ImageError saying why).
        400 naming a bad one, a prompt with pad tokens and no media for them, or media for a model without vision
        (``refusal``: a vision model that does not take this kind). Every frame's header is read first and the
        request's pixels reserved from :attr:`pixels` (appended to ``held``) before any is decoded: 503 +
        Retry-After when they do not fit within ``image_wait_s``."""
        from relax_hpc.multimodal import decode

        pad = getattr(self.config, f"{kind}_token_id", None) if self.vlm else None
        item = (lambda i: f"item {i}: " if batched else "")

        def none_for(i: int, p: list) -> None:
            if pad is not None and pad in p:  # the model would embed the bare pad token as if it were text
                raise HTTPError(400, f"{item(i)}the prompt has {kind} pad tokens (id {pad}) but the request has no "
                                     f"{kind}_data for it")

        if data is None or data == []:
            for i, p in enumerate(prompts):
                none_for(i, p)
            return [None] * len(prompts)
        if not self.vlm:
            raise HTTPError(400, f"{kind}_data given, but the model ({getattr(self.config, 'model_type', '?')}) has no "
                                 f"vision: serve {serves} directory")
        if refusal is not None:
            raise HTTPError(400, refusal)
        if not batched:
            per_item = [as_list(data)]
        elif isinstance(data, list) and len(data) == len(prompts):
            per_item = [as_list(x) for x in data]
        else:
            raise HTTPError(400, f"{kind}_data must have one entry per item of the batch of {len(prompts)}")
        where = (lambda i, j: f"{kind}_data[{i}][{j}]" if batched else f"{kind}_data[{j}]")
        heads: list[list[list]] = []  # per item, per image or video, its frames opened to the header
        for i, (p, refs) in enumerate(zip(prompts, per_item)):
            if not refs:
                none_for(i, p)
            heads.append([])
            for j, ref in enumerate(refs):
                try:
                    heads[-1].append(opened(ref))
                except ImageError as e:
                    raise HTTPError(400, f"{where(i, j)} {e}") from None
        need = sum(f.width * f.height for media in heads for frames in media for f in frames)
        noun = "images" if kind == "image" else "video frames"
        if need > self.pixels.total:
            raise HTTPError(400, f"the request's {noun} have {need} pixels, more than this engine serves at once "
                                 f"({self.pixels.total}, --image-pixel-budget): it can never fit. Fix: smaller or "
                                 f"fewer {noun} per request")
        if not self.pixels.acquire(need, self.image_wait_s):
            raise Busy(f"the request's {noun} have {need} pixels and the engine's image budget has "
                       f"{self.pixels.total - self.pixels.in_use} of {self.pixels.total} free (--image-pixel-budget) "
                       f"after waiting {self.image_wait_s:g} s: try again later")
        held.append(need)
        out: list[dict | None] = []
        for i, (p, media) in enumerate(zip(prompts, heads)):
            if not media:
                out.append(None)
                continue
            try:
                decoded = []
                for j, frames in enumerate(media):
                    try:
                        decoded.append([decode(f) for f in frames])
                    except ImageError as e:
                        raise ImageError(f"{where(i, j)}: {e}") from None
                out.append(encode(p, decoded))
            except ImageError as e:
                raise HTTPError(400, f"{item(i)}{e}") from None
        return out

    @torch.inference_mode()
    def _generate_one(self, r: Req) -> None:
        """A request with images, alone: its M-RoPE positions from the ids and the image grid (transformers'
        ``get_rope_index``), a prefill with its pixels, then one token at a time, each at the position after the last
        (the same in all three sections). Positions are passed explicitly, so nothing is kept in the model between
        forwards, and the model lock is taken per forward, as the scheduler does: a health check or a text batch runs
        in between. The same sampler and finish rule as the batches."""
        mm, dev = r.mm, self.device
        ids = torch.tensor([r.input_ids])
        mask = torch.ones_like(ids)
        try:
            if "features" in mm:  # audio (relax_hpc.engines.audio)
                pos, delta, media = engine_audio.prefill_kwargs(mm, ids, dev, self.dtype)
            elif "video_grid_thw" in mm:  # a video (Qwen2.5-VL): its time steps apart by second_per_grid_ts
                pos, delta = self.model.model.get_rope_index(input_ids=ids, video_grid_thw=mm["video_grid_thw"],
                                                             second_per_grid_ts=mm["second_per_grid_ts"],
                                                             attention_mask=mask)
                media = dict(pixel_values_videos=mm["pixel_values_videos"].to(dev, self.dtype),
                             video_grid_thw=mm["video_grid_thw"].to(dev),
                             second_per_grid_ts=mm["second_per_grid_ts"].to(dev))
            else:
                pos, delta = self.model.model.get_rope_index(input_ids=ids, image_grid_thw=mm["image_grid_thw"],
                                                             attention_mask=mask)  # [3, 1, L], [1, 1]
                media = dict(pixel_values=mm["pixel_values"].to(dev, self.dtype),
                             image_grid_thw=mm["image_grid_thw"].to(dev))

            def prefill():
                with self.model_lock:
                    return self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                                      use_cache=True, **media)

            logits, cache = self._shared_prefill(r, (tuple(r.input_ids), _digest(media)), prefill)
            while not r.done.is_set():
                (tok,), (lp,) = sample_batch([r], logits)
                r.output_ids.append(tok)
                if r.return_logprob:
                    r.logprobs.append(lp)
                reason = self.finish_reason(r, tok) or self._solo_control(r)
                if reason is not None:
                    r.finish_with(reason, self.weight_version)
                    break
                n = len(r.input_ids) + len(r.output_ids)  # the new token is at index n - 1
                at = (torch.tensor(n - 1) + delta).reshape(1, 1, 1).expand(3, 1, 1)
                with self.model_lock:
                    out = self.model(input_ids=torch.tensor([[tok]], device=dev),
                                     attention_mask=torch.ones((1, n), dtype=torch.long, device=dev),
                                     position_ids=at.to(dev), past_key_values=cache, use_cache=True,
                                     cache_position=torch.tensor([n - 1], device=dev))
                logits, cache = out.logits[:, -1, :].to("cpu", torch.float32), out.past_key_values
        except Exception as e:  # as a failed batch: this request fails, the engine goes on
            log.error("image request failed: %s", traceback.format_exc())
            r.error = f"{type(e).__name__}: {e}"
            r.done.set()
        finally:
            with self.scheduler.cv:
                self.solo.pop(id(r), None)
                self.scheduler.cv.notify_all()

    def _shared_prefill(self, r: Req, key: tuple, prefill):
        """The prefill of a request with media, shared by identical ones running at once (a GRPO group: one prompt,
        its media, n samples): the first runs it, the others take its last logits and a copy of its KV cache, as if
        batched with it, and say so in ``cached_tokens`` (SGLang's: the prompt tokens served from its cache).
        Returns the float32 logits ``[1, V]`` on the CPU and this request's own KV cache (None where it decodes no
        token past the first)."""
        with self.prefills_lock:
            slot = self.prefills.get(key)
            if slot is None:
                slot = self.prefills[key] = SharedPrefill()
                first = True
            else:
                slot.waiting += 1
                first = False
        if not first:
            slot.done.wait()
            if slot.logits is not None:
                r.cached_tokens = len(r.input_ids)
                return slot.logits, copy.deepcopy(slot.cache) if r.max_new_tokens > 1 else None
            slot = None  # the first one failed (its error is its own): this one runs its own prefill
        try:
            out = prefill()
            logits = out.logits[:, -1, :].to("cpu", torch.float32)
            if slot is not None:  # kept as it is for the others: this request's decode grows its own cache
                slot.logits = logits
                slot.cache = out.past_key_values if r.max_new_tokens <= 1 else copy.deepcopy(out.past_key_values)
        finally:
            if slot is not None:
                with self.prefills_lock:
                    self.prefills.pop(key, None)
                slot.done.set()
        return logits, out.past_key_values

    def _solo_control(self, r: Req) -> dict | None:
        """Between two tokens of a request with images: SGLang's pause modes as the scheduler applies them to a
        batch (``abort`` ends it, aborted; ``in_place`` and ``retract`` wait here, its KV cache kept, until
        ``/continue_generation``), and an abort of its rid. Returns the abort's finish reason, or None to go on."""
        sched = self.scheduler
        with sched.cv:
            sched.cv.wait_for(lambda: sched.paused not in ("in_place", "retract") or r.abort_message is not None)
            if sched.paused == "abort" and r.abort_message is None:
                r.abort_message = "Abort by pause_generation (mode=abort)."
        return None if r.abort_message is None else abort_reason(r.abort_message)

    def abort(self, rid: str | None, message: str) -> None:
        """Abort one rid (None: every request): the scheduler's, and the requests with images running alone."""
        self.scheduler.abort(rid, message)
        with self.scheduler.cv:
            for r in self.solo.values():
                if rid is None or r.rid == rid:
                    r.abort_message = message
            self.scheduler.cv.notify_all()

    def _make_req(self, input_ids, sp: dict, return_logprob: bool, rid) -> Req:
        if not input_ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in input_ids):
            raise HTTPError(400, f"input_ids must be a non-empty list of ints in [0, {self.vocab_size})")
        sp = _check_sampling(sp)
        if sp["stop"] and self.tokenizer is None:
            raise HTTPError(400, "stop strings need a tokenizer in the model directory; use stop_token_ids")
        if len(input_ids) >= self.context_len:
            raise HTTPError(400, f"The input ({len(input_ids)} tokens) is longer than the model's context "
                                 f"length ({self.context_len} tokens).")
        if sp["max_new_tokens"] is None:
            sp["max_new_tokens"] = self.context_len - len(input_ids)
        if sp["max_new_tokens"] + len(input_ids) > self.context_len:
            raise HTTPError(400, f"Requested token count exceeds the model's maximum context length of "
                                 f"{self.context_len} tokens: {len(input_ids)} prompt + {sp['max_new_tokens']} new.")
        seed = sp["sampling_seed"]
        gen = torch.Generator().manual_seed(int(seed) if seed is not None else self.rng.getrandbits(63))
        r = Req(str(rid) if rid else uuid.uuid4().hex, list(input_ids), sp, return_logprob, gen)
        if r.max_new_tokens == 0:
            r.finish_with({"type": "length", "length": 0}, self.weight_version)
        return r

    def _response(self, r: Req, text_in_lp: bool, inputs: tuple | None = None, top_n: int = 0) -> dict:
        meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.input_ids),
                "completion_tokens": len(r.output_ids), "cached_tokens": r.cached_tokens,
                "weight_version": r.weight_version,
                "e2e_latency": time.monotonic() - r.created}
        if getattr(r, "mm", None) is not None:
            meta["input_ids"] = list(r.input_ids)  # the expanded prompt (module docstring)
        if r.return_logprob:
            dec = (lambda t: self.tokenizer.decode([t])) if (text_in_lp and self.tokenizer) else (lambda t: None)
            meta["output_token_logprobs"] = [[lp, t, dec(t)] for lp, t in zip(r.logprobs, r.output_ids)]
            if inputs is not None:  # SGLang's shapes (tokenizer_manager.py detokenize_logprob_tokens)
                start, lps, top = inputs
                meta["input_token_logprobs"] = [[lp, t, dec(t)] for lp, t in zip(lps, r.input_ids[start:])]
                if top_n:
                    meta["input_top_logprobs"] = [None if row is None else [[v, t, dec(t)] for v, t in zip(*row)]
                                                  for row in top]
            if top_n:
                meta["output_top_logprobs"] = []
        out = {"output_ids": r.output_ids, "meta_info": meta}
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=r.skip_special_tokens)
            m = (r.finish or {}).get("matched")
            if isinstance(m, str) and not r.no_stop_trim and m in text:  # SGLang trims a matched stop string
                text = text[:text.rindex(m)]
            out = {"text": text, **out}
        return out

    def input_logprobs(self, items: list[tuple[list[int], int, int]]) -> list[tuple]:
        """SGLang's input log-probs for each ``(input_ids, start, top_n)``: ``(start, logprobs, top)`` where
        ``logprobs[j]`` is ``log_softmax(logits[start + j - 1])[input_ids[start + j]]`` for j >= 1 and None for j = 0
        (SGLang's pad), and ``top[j]`` (None for j = 0, and everywhere when ``top_n`` is 0) the ``top_n`` largest
        ``(log-probs, token ids)`` of the same distribution.

        One teacher-forced forward per ``max_batch`` prompts, left-padded as the scheduler pads its prefill, under
        the model lock (so a weight load lands before or after it, never inside), keeping only the logits it reads
        (``logits_to_keep``); float32 ``log_softmax`` without temperature, as SGLang's logits processor. Like a new
        generate request it waits while generation is paused, and is refused (400) while the memory is released.
        Nothing is checked here: a NaN the model computes is answered as NaN, for the client's checks to refuse."""
        sched = self.scheduler
        with sched.cv:  # SGLang queues requests that arrive while paused until /continue_generation
            sched.cv.wait_for(lambda: sched.paused is None or sched.refusal is not None)
            if sched.refusal is not None:
                raise HTTPError(400, sched.refusal)
        out: list[tuple] = []
        for i in range(0, len(items), sched.max_batch):
            out += self._score(items[i:i + sched.max_batch])
        return out

    @torch.inference_mode()
    def _score(self, items: list[tuple[list[int], int, int]]) -> list[tuple]:
        seqs = [ids for ids, _, _ in items]
        L = max(map(len, seqs))
        keep = max(len(ids) - start for ids, start, _ in items)  # the last columns hold every logit read
        ids, mask, pos = left_padded(seqs, self.pad_id)
        with self.model_lock:
            if self.released:  # released while this request waited for the lock
                raise HTTPError(400, "the engine's memory is released (/release_memory_occupation): call "
                                     "/resume_memory_occupation before /generate")
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                position_ids=pos.to(self.device), use_cache=False,
                                **self._keep_kwarg(keep)).logits[:, -keep:]
        out = []
        for i, (s, start, top_n) in enumerate(items):
            # logits column c of the row predicts the token at row position c + 1; kept column 0 is column L - keep
            cols = torch.arange(start, len(s) - 1) + (L - len(s)) - (L - keep)
            rows = torch.log_softmax(logits[i, cols.to(logits.device)].float(), dim=-1)  # one row at a time: [n, V]
            tgt = torch.tensor(s[start + 1:], dtype=torch.long, device=rows.device).reshape(-1, 1)
            lps = rows.gather(1, tgt)[:, 0].tolist()
            top: list = [None] * (len(s) - start)
            if top_n:
                v, t = rows.topk(min(top_n, rows.shape[-1]), dim=-1)
                top = [None, *zip(v.tolist(), t.tolist())]
            out.append((start, [None, *lps], top))
        return out

    @torch.inference_mode()
    def routed_experts(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, the experts each MoE layer's router chose for every token but the last (SGLang's
        ``routed_experts``: the tokens the engine ran forward): int32 ``[len - 1, layers, top_k]``, from the router
        logits (``output_router_logits``) of one teacher-forced forward of the sequence, left-padded and under the
        model lock as :meth:`_score` (with the weights served now: those that sampled it, unless an update landed
        since), picked as transformers' ``Qwen3MoeSparseMoeBlock`` picks them: top-k of the float32 softmax.
        400 for a model without experts, or with dense layers among them (SGLang's -1 rows are not made)."""
        text_cfg = getattr(self.config, "text_config", None) or self.config
        k, layers = getattr(text_cfg, "num_experts_per_tok", None), int(text_cfg.num_hidden_layers)
        if not k or not getattr(text_cfg, "num_experts", None):
            raise HTTPError(400, f"return_routed_experts: the model ({getattr(self.config, 'model_type', '?')}) has "
                                 "no experts to route to")
        out: list[torch.Tensor] = []
        for i in range(0, len(seqs), self.scheduler.max_batch):
            part = [s[:-1] for s in seqs[i:i + self.scheduler.max_batch]]
            B, L = len(part), max(1, max(map(len, part)))
            ids = torch.full((B, L), self.pad_id, dtype=torch.long)
            mask = torch.zeros((B, L), dtype=torch.long)
            for j, s in enumerate(part):
                if s:
                    ids[j, L - len(s):] = torch.tensor(s)
                    mask[j, L - len(s):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            with self.model_lock:
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    position_ids=pos.to(self.device), use_cache=False, output_router_logits=True,
                                    **self._keep_kwarg(1)).router_logits
            if len(logits) != layers:
                raise HTTPError(400, f"return_routed_experts: {len(logits)} of the model's {layers} layers route "
                                     "(dense layers among them are not supported by the CPU engine)")
            # [layers, B·L, E] → top-k of softmax, as the sparse block routes → [B, L, layers, k]
            top = torch.stack([torch.softmax(x.float(), dim=-1).topk(k, dim=-1).indices for x in logits])
            top = top.reshape(layers, B, L, k).permute(1, 2, 0, 3).to("cpu", torch.int32)
            out += [top[j, L - len(s):] for j, s in enumerate(part)]
        return out

    def _keep_kwarg(self, keep: int) -> dict:
        """``logits_to_keep=keep`` where the model takes it (HF causal LMs do), so only the columns read are made."""
        if not hasattr(self, "_takes_keep"):
            self._takes_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        return {"logits_to_keep": keep} if self._takes_keep else {}

    def health_generate(self, timeout_s: float = 20.0) -> bool:
        """A 1-token forward of ``input_ids=[0]`` (SGLang's default health check generates one token).

        It runs between decode steps instead of queueing behind a batch: with static batching a long batch
        would otherwise make a healthy engine look dead (SGLang's continuous batching answers at once). It
        answers while paused too, as the model is still there. While the memory is released it answers healthy
        without the model (the engine is alive; a controller must not take it for dead)."""
        if self.released:  # alive, its memory handed over: nothing to run the model with, and nothing wrong
            return True
        if not self.model_lock.acquire(timeout=timeout_s):
            return False
        try:
            if self.released:
                return True
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([[0]], device=self.device)).logits[0, -1]
            return bool(torch.isfinite(logits).all())
        except Exception:
            log.error("health check failed: %s", traceback.format_exc())
            return False
        finally:
            self.model_lock.release()

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> tuple[bool, str]:
        running, waiting = self.scheduler.busy()
        running += len(self.solo)
        if running or (waiting and self.scheduler.paused is None):
            return False, (f"Cache not flushed because there are pending requests: #queue-req: {waiting}, "
                           f"#running-req: {running}")
        return True, "Cache flushed.\nPlease check backend logs for more details. (When there are running or " \
                     "waiting requests, the operation will not be performed.)\n"

    def server_info(self) -> dict:
        running, waiting = self.scheduler.busy()
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name, "host": self.host, "port": self.port, "tp_size": 1,
            "dp_size": 1,
            "dtype": str(self.dtype).replace("torch.", ""), "context_length": self.context_len,
            "skip_tokenizer_init": self.tokenizer is None, "max_running_requests": self.scheduler.max_batch,
            "launch_command": " ".join(sys.argv), "status": "ready", "max_total_num_tokens": None,
            "max_req_input_len": self.context_len - 1, "startup_time": self.started,
            "internal_states": [{"last_gen_throughput": self.scheduler.stats["last_gen_throughput"],
                                 "num_running_reqs": running, "num_waiting_reqs": waiting,
                                 "paused": self.scheduler.paused, **self.scheduler.stats}],
            "version": self.reported_version or ENGINE_VERSION, "engine": "relax_hpc-cpu", "frontend": "python",
            **self.sync_info(), "memory_released": bool(self.released), **self.pixels.state(),
        }

    def abort_all(self, message: str) -> None:
        self.abort(None, message)

    # ------------------------------------------------------------------ memory hand-over
    def updates_refused(self) -> str | None:
        if "weights" in self.released:
            return ("the engine's weights are released (/release_memory_occupation): resume first "
                    "(/resume_memory_occupation with the weights tag), then update them")
        return None

    @staticmethod
    def _tags(body: dict) -> list[str]:
        tags = body.get("tags")
        if tags is None or tags == []:  # SGLang: none or empty = every type
            return list(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise HTTPError(400, f"tags must be null or a list of {list(MEMORY_TAGS)}, not {brief(tags)}")
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise HTTPError(400, f"unknown memory tags {brief(unknown)}: the tags are {list(MEMORY_TAGS)} (null: all)")
        return list(dict.fromkeys(tags))

    def release_memory_occupation(self, body: dict) -> None:
        """SGLang's ``/release_memory_occupation``: give the device memory of ``tags`` (weights, KV cache, CUDA
        graphs; null: all) back, so another process on the same GPU (the colocated actor) can use it. Refused while
        requests run or wait. On CUDA each parameter's storage is freed (its shape and dtype kept) and the cache
        emptied; this engine keeps no KV cache or CUDA graphs between batches, so those tags free nothing. On the
        CPU nothing is freed, but the state is the same: until resumed, ``/generate`` is refused, updates are
        refused while the weights are released, and the health checks answer without the model."""
        tags = self._tags(body)
        with self.memory_lock:
            self._release(tags)
        log.info("memory released: %s (released now: %s)", tags, sorted(self.released))

    def _release(self, tags: list[str]) -> None:
        again = [t for t in tags if t in self.released]
        if again:
            raise HTTPError(400, f"memory of {again} is already released; resume it first (/resume_memory_occupation)")
        with self.scheduler.cv:  # no request can be queued between this check and the refusal being set
            # a finished request leaves the running batch a moment after its answer went out: not ongoing
            live = sum(not r.done.is_set() for r in self.scheduler.running)
            running, waiting = live + len(self.solo), len(self.scheduler.waiting)
            if running or waiting:
                raise HTTPError(400, f"release_memory_occupation should be called only when no ongoing request: "
                                     f"#running-req: {running}, #queue-req: {waiting}. Pause with mode abort (or "
                                     "let them finish) first")
            self.released.update(tags)
            self.scheduler.refusal = ("the engine's memory is released (/release_memory_occupation): call "
                                      "/resume_memory_occupation before /generate")
        if not self.frees_memory:
            return
        with self.model_lock:
            if "weights" in tags:
                for p in self._weights():
                    self.stash[id(p)] = (p, p.shape, p.dtype)
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            if self.device != "cpu":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()  # the freed weights, and the last batches' KV blocks the allocator held

    def resume_memory_occupation(self, body: dict) -> None:
        """SGLang's ``/resume_memory_occupation``: take the memory of ``tags`` (null: all released) again. The
        weights come back with undefined contents (SGLang without a weight backup): update them before the next
        generate."""
        with self.memory_lock:
            tags = self._tags(body) if body.get("tags") else sorted(self.released)
            missing = [t for t in tags if t not in self.released]
            if missing or not tags:
                raise HTTPError(400, f"memory of {missing or list(MEMORY_TAGS)} is not released; nothing to resume "
                                     f"(released now: {sorted(self.released)})")
            if "weights" in tags and self.stash:
                with self.model_lock:
                    for p, shape, dtype in self.stash.values():
                        p.data = torch.empty(shape, dtype=dtype, device=self.device)
                    self.stash.clear()
            with self.scheduler.cv:
                self.released.difference_update(tags)
                if not self.released:
                    self.scheduler.refusal = None
        log.info("memory resumed: %s (released now: %s)", tags, sorted(self.released))

    def _weights(self) -> list[torch.Tensor]:
        """The model's parameters, once each (tied ones share a parameter). Buffers stay: they are small, and the
        weight updates do not send them."""
        return list(self.model.parameters())

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": "safetensors", "model_type": getattr(self.config, "model_type", None),
            "architectures": getattr(self.config, "architectures", None), "has_image_understanding": self.vlm,
            "has_audio_understanding": False,
        }

def _check_sampling(sp: dict) -> dict:
    if not isinstance(sp, dict):
        raise HTTPError(400, "sampling_params must be an object")
    unknown = set(sp) - _SAMPLING_KEYS
    if unknown:
        raise HTTPError(400, f"unknown sampling_params keys: {brief(sorted(unknown))}")
    for k, v in sp.items():
        if k in _SUPPORTED or v in (None, "", [], {}) or (k in _NEUTRAL and v == _NEUTRAL[k]):
            continue
        raise HTTPError(400, f"sampling param {k}={brief(v)} is not supported by the CPU engine")
    out = {"max_new_tokens": sp.get("max_new_tokens", 128), "temperature": sp.get("temperature", 1.0),
           "top_p": sp.get("top_p", 1.0), "top_k": sp.get("top_k", -1), "stop_token_ids": sp.get("stop_token_ids"),
           "ignore_eos": sp.get("ignore_eos", False), "sampling_seed": sp.get("sampling_seed"),
           "stop": [sp["stop"]] if isinstance(sp.get("stop"), str) and sp["stop"] else list(sp.get("stop") or []),
           "skip_special_tokens": sp.get("skip_special_tokens", True), "no_stop_trim": sp.get("no_stop_trim", False)}
    if out["top_k"] in (-1, None) or out["top_k"] >= TOP_K_ALL:
        out["top_k"] = TOP_K_ALL
    if out["max_new_tokens"] is not None and out["max_new_tokens"] < 0:
        raise HTTPError(400, "max_new_tokens must be at least 0")
    if out["temperature"] < 0:
        raise HTTPError(400, "temperature must be non-negative")
    if not 0 < out["top_p"] <= 1:
        raise HTTPError(400, "top_p must be in (0, 1]")
    if out["top_k"] < 1:
        raise HTTPError(400, "top_k must be -1 (disable), or at least 1")
    return out


def _input_request(r: Req, start, top_n) -> tuple[int | None, int]:
    """``(logprob_start_len, top_logprobs_num)`` of one request, checked: the start is None (no input log-probs) for
    -1, for none given, or without ``return_logprob`` (SGLang ignores it then), else in ``[0, len(input_ids))``."""
    for key, v in (("logprob_start_len", start), ("top_logprobs_num", top_n)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise HTTPError(400, f"{key} must be an integer, not {brief(v)}")
    top_n = top_n or 0
    if top_n < 0:
        raise HTTPError(400, f"top_logprobs_num must be at least 0, not {top_n}")
    if not r.return_logprob:
        return None, 0
    if top_n and r.max_new_tokens:
        raise HTTPError(400, "output top log-probs (top_logprobs_num with max_new_tokens > 0) are not supported by the "
                             "CPU engine; input_top_logprobs are: send max_new_tokens 0 with a logprob_start_len")
    if start is None or start == -1:
        return None, top_n
    if start < 0:
        raise HTTPError(400, f"logprob_start_len must be -1 (output log-probs only) or at least 0, not {start}")
    if start >= len(r.input_ids):
        # SGLang's scheduler refuses it so (scheduler.py handle_generate_request)
        raise HTTPError(400, f"logprob_start_len={start} is higher than the number of input tokens "
                             f"{len(r.input_ids)}. Please use a smaller logprob_start_len.")
    return start, top_n


def _per_item(v, n: int, key: str) -> list:
    """SGLang batch fields: one value for all items, or a list with one value per item."""
    if isinstance(v, list):
        if len(v) != n:
            raise HTTPError(400, f"{key} has {len(v)} items for a batch of {n}")
        return v
    if key == "rid" and n > 1 and v is not None:
        raise HTTPError(400, "a batch needs one rid per item")
    return [v] * n


def _load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # no tokenizer in the dir: like SGLang's --skip-tokenizer-init, no "text"
        log.warning("no tokenizer loaded from %s (%s): responses carry no text", path, e)
        return None


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        ids.update(e if isinstance(e, (list, tuple)) else ([e] if e is not None else []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
