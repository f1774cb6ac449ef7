"""The SGLang client: the one module that knows SGLang's HTTP wire format (0.5.23 native API).

Everything relax_hpc asks of an inference engine goes through :class:`EngineClient`: generation for the
rollout driver, health/info for launch and supervision, pause/flush/abort around weight syncs, and the
weight-update calls for the actor. Real SGLang servers and relax_hpc's CPU engine
(:mod:`relax_hpc.engines.cpu_engine`) answer the same calls the same way, so nothing above this module
knows which one it is talking to.

Failure policy (why it is shaped this way):

* every failure is an :class:`EngineError` naming the engine URL, the call and the cause (HTTP status and
  body, timeout, connection refused), because a run with dozens of engines must say *which* one broke;
* one total deadline per call (connect + send + the whole answer + retries): an engine that accepts the
  connection and then trickles bytes, or never answers, fails the call after that many seconds, not never;
* retries only where they cannot duplicate work, with exponential backoff and full jitter (:class:`Backoff`)
  inside the same deadline: idempotent calls (health, info, flush, weight reads) retry on any transport error
  or 5xx; ``/generate`` on a 5xx, a dropped connection or a failed connect (it has no side effect beyond
  compute); every other call (weight updates, pause, the memory release and resume, which are refused or
  fail when sent twice) only when the connection was never made, i.e. the engine cannot have seen the
  request. A call whose deadline ran out is *not* resent. 4xx and an answer that is not JSON are not retried;
* ``api_key`` is sent as ``Authorization: Bearer KEY`` on every call (what SGLang's ``--api-key`` checks);
* a ``/generate`` answer is checked before anyone believes it (:func:`output_problem`): log-probs finite, at most
  0 and within float32 (the exchange's column), one per output token and present when asked for; token ids in
  ``[0, vocab_size)``; ``completion_tokens`` equal to the tokens sent; no empty output but an abort or a
  ``max_new_tokens`` of 0; routed experts (MoE routing replay) one row a token the engine ran, ids in
  ``[0, num_experts)``, a token's top-k distinct. An answer that fails is an :class:`EngineOutputError`: the
  engine is broken (bad weights, a faulty kernel, the wrong model), so the driver declares it dead instead of
  training on its output;
* a scoring request (:meth:`EngineClient.ainput_logprobs`: ``max_new_tokens`` 0, ``logprob_start_len``, the
  teacher's request in on-policy distillation) is checked alike (:func:`parse_input_logprobs`): shapes and ids
  raise, a bad log-prob value is reported per prompt (:attr:`InputLogprobs.problem`).

Typical use::

    c = EngineClient("http://node12:30000")
    g = await c.agenerate([1, 5, 7], SamplingParams(max_new_tokens=64, temperature=1.0), return_logprob=True)
    g.output_ids, g.output_logprobs, g.finish_reason.type, g.weight_version

    fut = c.submit(c.update_weights_from_distributed, names, dtypes, shapes, group_name="wg", weight_version="3")
    for t in tensors: dist.broadcast(t, src=0, group=pg)   # the engine receives while the HTTP call waits
    fut.result()
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import random
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import httpx

if TYPE_CHECKING:
    from relax_hpc.exchange.fields import Routing

log = logging.getLogger(__name__)

# Seconds, each the total deadline of one call (retries included). Generation can legitimately take minutes
# (long responses, queued behind others; the recipe's rollout.request_timeout_s); control calls should answer
# fast; a weight update waits for the whole broadcast.
DEFAULT_TIMEOUT = 60.0
GENERATE_TIMEOUT = 600.0
WEIGHTS_TIMEOUT = 1800.0
CONNECT_TIMEOUT = 10.0
KEEPALIVE_S = 4.0  # an idle kept-alive connection is dropped after this long (see EngineClient.__init__)
# Connections kept open when idle, of the up to max_connections a burst of requests opens. httpcore 1.0's pool
# looks at every connection for each idle one whenever a request starts or ends, so a pool of N idle connections
# costs O(N²) per request: a step's 128 concurrent requests took half the rollout's CPU. Measured here (one
# process: an HTTP server and 10 bursts of N requests): N=128 10.4 -> 2.4 CPU-s, N=512 40 -> 10 CPU-s with 16
# kept instead of all; the rest reconnect, which on a cluster's network costs less than the scan did.
KEEPALIVE_CONNECTIONS = 16


OLDEST_SGLANG = (0, 5, 15)  # the oldest release Relax pins; older ones answer the update calls differently
SESSION_SGLANG = (0, 5, 23)  # from here, /update_weights_from_distributed only inside /begin…/end_weight_update


def update_protocol(version: Any) -> str:
    """How to update an engine's weights, from the ``version`` its ``/server_info`` reports: ``"session"``
    (``/begin_weight_update`` … ``/end_weight_update`` around the updates: SGLang >= 0.5.23, and relax_hpc's CPU
    engine) or ``"plain"`` (the updates alone: SGLang 0.5.15-0.5.22). An older SGLang is refused, naming it."""
    text = str(version or "")
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", text)
    if m is None:  # not an SGLang release string (the CPU engine's "relax_hpc-cpu-engine/1"): the current protocol
        return "session"
    release = tuple(int(x) for x in m.groups())
    if release < OLDEST_SGLANG:
        raise ValueError(f"an engine runs SGLang {text}; relax_hpc updates weights on SGLang 0.5.15 or newer "
                         "(the releases Relax pins). Fix: install a newer SGLang in RELAX_SGLANG_PYTHON's environment")
    return "session" if release >= SESSION_SGLANG else "plain"


class EngineError(RuntimeError):
    """An engine call failed. ``str(e)`` reads "engine URL: CALL failed: CAUSE"."""

    def __init__(self, engine_url: str, call: str, cause: str, *, status: int | None = None, body: str | None = None):
        self.engine_url, self.call, self.cause, self.status, self.body = engine_url, call, cause, status, body
        super().__init__(f"engine {engine_url}: {call} failed: {cause}")

    @property
    def restartable(self) -> bool:
        """An engine that stopped answering (no HTTP status: it died, e.g. between the sync's health check and
        its fingerprint check) or failed inside (5xx) is the machinery, not the recipe: a task failing with it
        restarts the steps from the checkpoint (:mod:`relax_hpc.roles.tasks`). A 4xx, a request the engine
        refuses, would fail again: the run fails with it."""
        return self.status is None or self.status >= 500


class EngineOutputError(EngineError):
    """An engine answered ``/generate`` with output that cannot be right (:func:`output_problem` says what): a
    log-prob that is NaN, infinite or positive, none where they were asked for, a token id outside the
    vocabulary, counts that disagree, an empty output that was not aborted. The fault is the engine's, not the
    request's: the driver declares the engine dead with this reason (the controller starts it again) and sends
    the request to another engine. ``str(e)`` reads "engine URL: /generate failed: bad output: WHAT"."""

    def __init__(self, engine_url: str, cause: str, *, body: str | None = None):
        super().__init__(engine_url, "/generate", f"bad output: {cause}", body=body)


@dataclass(frozen=True)
class FinishReason:
    """SGLang's tagged finish reason: ``stop`` (``matched`` token id or string), ``length`` (``length``),
    ``abort`` (``message``). ``unknown`` if the engine sent none."""

    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None

    @classmethod
    def from_json(cls, d: dict | None) -> "FinishReason":
        if not d:
            return cls("unknown")
        return cls(str(d.get("type")), d.get("matched"), d.get("length"), d.get("message"))


@dataclass
class SamplingParams:
    """The sampling knobs relax_hpc sets, under SGLang's names; ``extra`` passes any other SGLang key through."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
             "top_k": self.top_k, "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is not None:
            d["sampling_seed"] = self.sampling_seed
        return {**d, **self.extra}


@dataclass
class Generation:
    """One finished generation. ``output_logprobs[i]`` is the engine's log-prob of ``output_ids[i]``."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None
    text: str | None = None
    meta_info: dict = field(default_factory=dict, repr=False)

    @property
    def aborted(self) -> bool:
        return self.finish_reason.type == "abort"

    @property
    def truncated(self) -> bool:
        return self.finish_reason.type == "length"


def decode_routed_experts(raw: str, tokens: int | None = None):
    """SGLang's ``routed_experts`` wire form (base64 of little-endian int32, C order) as a compact numpy array: the
    one reader of it (:func:`routed_experts` shapes it; ``Sample.update_from_meta_info`` keeps it). int16 when every
    id fits (any model with fewer than 32768 experts: half of int32, a tenth of a Python list's ~8 bytes a pointer,
    ~0.8 KB a token at Qwen3-30B-A3B's 48 layers × top-8), else int32. ``tokens`` (the tokens the engine ran: prompt
    + completion − 1): the array as ``[tokens, layers × top_k]``, where its size is a whole multiple of it; else
    flat, as the wire had it (the writer refuses ids that do not fit the sample's tokens)."""
    import base64

    import numpy as np

    flat = np.frombuffer(base64.b64decode(raw), dtype="<i4")
    if flat.size and -(1 << 15) <= int(flat.min()) and int(flat.max()) < (1 << 15):
        flat = flat.astype(np.int16)
    else:
        flat = flat.astype(np.int32)  # native order, and a copy: the decoded bytes are not kept alive by a view
    if tokens and tokens > 0 and flat.size and flat.size % tokens == 0:
        return flat.reshape(tokens, flat.size // tokens)
    return flat


def routed_experts(gen: Generation, layers: int, top_k: int):
    """SGLang's ``meta_info["routed_experts"]`` (asked with ``return_routed_experts``; SGLang needs
    ``--enable-return-routed-experts``) decoded: base64 of int32 in C order, ``[prompt + completion tokens - 1,
    layers, top_k]`` (every token the engine ran forward: all but the last), as a numpy array; None where the
    answer has none. ``ValueError`` when its size is not that shape's."""
    raw = gen.meta_info.get("routed_experts")
    if raw is None:
        return None
    flat = decode_routed_experts(raw).astype("<i4")
    n = gen.prompt_tokens + gen.completion_tokens - 1
    if flat.size != n * layers * top_k:
        raise ValueError(f"routed_experts has {flat.size} expert ids, not [{n} tokens, {layers} layers, top-{top_k}]")
    return flat.reshape(n, layers, top_k)


_expansion_warned: set[str] = set()


def _check_expansion(url: str, gen: Generation, sent: int) -> None:
    """A request with images whose prompt was sent expanded (rollout/data.py) should come back as long as it went:
    otherwise the engine resized an image differently (SGLang applies its own pixel bounds) and saw other image
    tokens than the trainer will. Said once per engine, not refused: the response itself is sound."""
    if gen.prompt_tokens and gen.prompt_tokens != sent and url not in _expansion_warned:
        _expansion_warned.add(url)
        log.warning("engine %s expanded a prompt with images to %d tokens, %d were sent: it sized an image "
                    "differently from the data (data.image_min/max_token_num outside the engine's own bounds?); "
                    "the trainer sees the sent ones", url, gen.prompt_tokens, sent)


@functools.cache
def _bounds() -> tuple[float, float]:
    """(log-prob tolerance above 0, the largest magnitude the ``rollout_log_probs`` column stores): the exchange's
    schema says both (exchange/fields.py; imported here, not at the top: it loads the exchange package)."""
    from relax_hpc.exchange.fields import LOGPROB_TOLERANCE, finite_max

    return LOGPROB_TOLERANCE, finite_max("rollout_log_probs")


def output_problem(gen: Generation, *, return_logprob: bool | None = None, vocab_size: int | None = None,
                   max_new_tokens: int | None = None, routing: Routing | None = None) -> str | None:
    """What is wrong with the engine's answer ``gen``, or None. Checked: each log-prob finite, within float32, and
    at most the schema's ``LOGPROB_TOLERANCE`` above 0 (a log-probability is never positive); log-probs present when
    ``return_logprob`` was asked; every token id in ``[0, vocab_size)`` (only ``>= 0`` when the vocabulary is not
    known); ``completion_tokens`` equal to the number of output ids; an empty output only when the request was
    aborted or asked for ``max_new_tokens`` = 0 (an engine stops or runs out of length after a token it sent,
    never before the first); and ``meta_info.routed_experts`` where the answer has them (:func:`routed_problem`,
    against the model's ``routing`` when known). None of these happens to a working engine."""
    ids, lps = gen.output_ids, gen.output_logprobs
    bad = next(((i, t) for i, t in enumerate(ids) if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        where = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary (ids are >= 0)"
        return f"output token {bad[0]} has id {bad[1]}, outside {where}"
    if return_logprob and lps is None and ids:
        return f"no output_token_logprobs for {len(ids)} output tokens, though return_logprob was asked"
    if lps is not None and len(lps) != len(ids):
        return f"{len(lps)} log-probs for {len(ids)} output tokens"
    tolerance, largest = _bounds()
    for i, lp in enumerate(lps or ()):
        if lp is None or not math.isfinite(lp) or abs(lp) > largest:
            return (f"the log-prob of output token {i} (id {ids[i]}) is {lp}: log-probs must be finite "
                    f"(float32, as the exchange stores them)")
        if lp > tolerance:
            return f"the log-prob of output token {i} (id {ids[i]}) is {lp} > 0: a log-probability is never positive"
    if gen.completion_tokens != len(ids):
        return f"meta_info.completion_tokens = {gen.completion_tokens} for {len(ids)} output ids"
    if not ids and not gen.aborted and max_new_tokens != 0:
        return (f"an empty output with finish reason {gen.finish_reason.type!r} (max_new_tokens "
                f"{max_new_tokens}): only an aborted request, or one asking for 0 tokens, ends with none")
    return routed_problem(gen, routing)


def routed_problem(gen: Generation, routing: Routing | None = None) -> str | None:
    """What is wrong with the answer's ``meta_info.routed_experts`` (MoE routing replay), or None (also when it
    has none): base64 of int32, one row of ``layers × top_k`` ids for each token the engine ran (prompt +
    completion − 1; the rows of an aborted answer or one without ``prompt_tokens`` are not counted), judged by the
    exchange's schema (:func:`~relax_hpc.exchange.fields.routed_experts_problem`: with ``routing``, ids in
    ``[0, num_experts)`` and a token's top-k distinct per layer; without, ids >= 0). An engine that routes a token
    to an expert the model has not, or to one expert twice, is broken like one that returns a NaN log-prob: its
    output never trains."""
    import binascii

    from relax_hpc.exchange.fields import routed_experts_problem

    raw = gen.meta_info.get("routed_experts")
    if raw is None:
        return None
    try:
        flat = decode_routed_experts(raw)
    except (binascii.Error, TypeError, ValueError) as e:
        return f"meta_info.routed_experts is not base64 of int32 ({type(e).__name__}: {e})"
    n = gen.prompt_tokens + gen.completion_tokens - 1
    if gen.aborted or not isinstance(gen.meta_info.get("prompt_tokens"), int):
        # an abort may cut the rows short, and without prompt_tokens the tokens ran are unknown: the number of rows
        # is not checked, their ids are
        w = routing.width if routing is not None else None
        n = flat.size // w if w and flat.size % w == 0 else n
    problem = routed_experts_problem(flat, n, routing)
    return None if problem is None else f"meta_info.routed_experts: {problem}"


def parse_generation(engine_url: str, obj: Any, *, return_logprob: bool | None = None,
                     vocab_size: int | None = None, max_new_tokens: int | None = None,
                     routing: Routing | None = None) -> Generation:
    """Turn one SGLang ``/generate`` response object into a :class:`Generation`, checked (:func:`output_problem`,
    with what the request asked); :class:`EngineOutputError` if it fails a check, an :class:`EngineError` if it is
    malformed (as garbage from something between us and the engine would be: retried, the engine not blamed)."""
    try:
        meta = obj["meta_info"]
        finish = FinishReason.from_json(meta.get("finish_reason"))
        # SGLang answers a request aborted before its prefill with no output_ids at all
        out_ids = [int(t) for t in obj["output_ids"]] if "output_ids" in obj or finish.type != "abort" else []
        rows = meta.get("output_token_logprobs")
        logprobs = row_ids = None
        if rows is not None:  # SGLang sends a NaN as null: kept as None, refused by the check
            logprobs = [None if r[0] is None else float(r[0]) for r in rows]
            row_ids = [int(r[1]) for r in rows]
        gen = Generation(
            rid=str(meta.get("id")), output_ids=out_ids, output_logprobs=logprobs,
            finish_reason=finish, prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(out_ids))),
            weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
            text=obj.get("text"), meta_info=meta)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as e:
        raise EngineError(engine_url, "/generate",
                          f"malformed response ({type(e).__name__}: {e}): {str(obj)[:300]}") from e
    problem = output_problem(gen, return_logprob=return_logprob, vocab_size=vocab_size, max_new_tokens=max_new_tokens,
                             routing=routing)
    if problem is None and row_ids is not None and row_ids != out_ids:
        problem = (f"the token ids of output_token_logprobs ({len(row_ids)} rows) are not output_ids "
                   f"({len(out_ids)} tokens)")
    if problem is not None:
        raise EngineOutputError(engine_url, problem)
    return gen


@dataclass
class InputLogprobs:
    """One prompt's answer to a scoring request (:meth:`EngineClient.ainput_logprobs`): SGLang's input log-probs from
    position ``start`` on. ``logprobs[j]`` is the log-prob of ``token_ids[j] = input_ids[start + j]`` given every
    token before it, for j >= 1; ``logprobs[0]`` is None (SGLang pads it: the logits before ``start`` are not
    computed), so the log-probs of ``input_ids[a:]`` are asked with ``start = a - 1`` and read from ``logprobs[1:]``.
    ``top[j]`` (when ``top_logprobs_num`` was asked; ``top[0]`` None) is ``(log-probs, token ids)`` of the N most
    likely tokens at that position, largest first. ``problem``: what is wrong with the numbers (a log-prob that is
    NaN, null, infinite, beyond float32 or above 0), None when they are all good; the caller decides what to do with
    the prompt (the counts and ids are checked before, :func:`parse_input_logprobs`)."""

    rid: str
    start: int
    token_ids: list[int]
    logprobs: list[float | None]
    top: list[tuple[list[float], list[int]] | None] | None
    weight_version: str | None
    problem: str | None = None
    meta_info: dict = field(default_factory=dict, repr=False)


def _value_problem(lp: Any, what: str) -> str | None:
    """Why the log-prob ``lp`` cannot be right (as :func:`output_problem` judges output log-probs), or None."""
    tolerance, largest = _bounds()
    if lp is None or not isinstance(lp, (int, float)) or not math.isfinite(lp) or abs(lp) > largest:
        return f"{what} is {lp}: log-probs must be finite (float32, as the exchange stores them)"
    if lp > tolerance:
        return f"{what} is {lp} > 0: a log-probability is never positive"
    return None


def parse_input_logprobs(engine_url: str, obj: Any, input_ids: Sequence[int], start: int,
                         top_logprobs_num: int = 0) -> InputLogprobs:
    """One SGLang ``/generate`` answer to a scoring request (``max_new_tokens`` 0, ``return_logprob``,
    ``logprob_start_len`` = ``start``) as :class:`InputLogprobs`.

    SGLang's shape (``scheduler_output_processor_mixin.py`` ``add_input_logprob_return_values``; rows as
    ``tokenizer_manager.py`` ``detokenize_logprob_tokens`` writes them): ``meta_info.input_token_logprobs`` holds
    ``len(input_ids) - start`` rows ``[logprob, token_id, text|null]``, the first log-prob always null;
    ``input_top_logprobs`` as many entries, the first null, each other a list of N such rows. Checked here, raising
    :class:`EngineOutputError` (the engine is wrong: another may be right): nothing generated, the row count, the
    first row null, each row's token id the input's, N rows per top-k position. A row reporting id 0 is accepted
    whatever the input id: SGLang reports ids from ``vocab_size - 1`` up as 0 (it clips image-token hashes).
    The log-prob values are judged into :attr:`InputLogprobs.problem`, not raised: one bad prompt of a batch must
    not cost the others their answers. A malformed object is an :class:`EngineError` (retried, engine not blamed)."""
    call = "/generate"
    try:
        meta = obj["meta_info"]
        out_ids = list(obj.get("output_ids") or [])
        finish = FinishReason.from_json(meta.get("finish_reason"))
        rows = meta["input_token_logprobs"]
        lps = [None if r[0] is None else float(r[0]) for r in rows]
        ids = [int(r[1]) for r in rows]
        top = None
        if top_logprobs_num:
            top = [None if e is None else ([None if x[0] is None else float(x[0]) for x in e], [int(x[1]) for x in e])
                   for e in meta["input_top_logprobs"]]
        rid = str(meta.get("id"))
        version = None if meta.get("weight_version") is None else str(meta["weight_version"])
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as e:
        raise EngineError(engine_url, call, f"malformed scoring response ({type(e).__name__}: {e}): "
                                            f"{str(obj)[:300]}") from e
    want = list(input_ids[start:])
    if out_ids or finish.type == "abort":
        problem = (f"a scoring request (max_new_tokens 0) was answered with {len(out_ids)} output tokens, finish "
                   f"reason {finish.type!r}{': ' + str(finish.message) if finish.message else ''}")
    elif len(ids) != len(want):
        problem = (f"{len(ids)} input_token_logprobs rows for logprob_start_len {start} of {len(input_ids)} input "
                   f"tokens: SGLang sends {len(want)} (positions {start}..{len(input_ids) - 1})")
    elif lps and lps[0] is not None:
        problem = (f"the first input_token_logprobs row has log-prob {lps[0]}: SGLang's is null (the row before "
                   "logprob_start_len is not computed), so the rows would be read one position off")
    elif any(a != b and a != 0 for a, b in zip(ids, want)):
        j = next(j for j, (a, b) in enumerate(zip(ids, want)) if a != b and a != 0)
        problem = f"input_token_logprobs row {j} is for token {ids[j]}, but input position {start + j} holds {want[j]}"
    elif top is not None and (len(top) != len(want) or (top and top[0] is not None)
                              or any(e is None or len(e[0]) != top_logprobs_num for e in top[1:])):
        problem = (f"input_top_logprobs is not {len(want)} entries (the first null) of {top_logprobs_num} rows each: "
                   f"{str(meta.get('input_top_logprobs'))[:200]}")
    else:
        problem = None
    if problem is not None:
        raise EngineOutputError(engine_url, problem)
    value = None
    for j in range(1, len(lps)):
        value = _value_problem(lps[j], f"the input log-prob of position {start + j} (token {want[j]})")
        if value is None and top is not None:
            value = next(filter(None, (_value_problem(v, f"a top log-prob of position {start + j} (token {t})")
                                       for v, t in zip(*top[j]))), None)
        if value is not None:
            break
    return InputLogprobs(rid=rid, start=start, token_ids=want, logprobs=lps, top=top, weight_version=version,
                         problem=value, meta_info=meta)


def requested_max_new_tokens(sampling_params: Any) -> int | None:
    """``max_new_tokens`` of a request's sampling parameters (a :class:`SamplingParams` or SGLang's dict); None
    when not given (the engine's default: whatever fits the context)."""
    v = sampling_params.max_new_tokens if isinstance(sampling_params, SamplingParams) \
        else (sampling_params or {}).get("max_new_tokens") if isinstance(sampling_params, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# Retry classes by call path. Idempotent calls retry on any transport error or 5xx. /generate has no side
# effect beyond compute, so it is resent after a 5xx or a dropped connection too (never after the deadline).
# Every other call (weight updates, pause, abort) retries only when the connection was never made.
_IDEMPOTENT = {"/health_generate", "/health", "/server_info", "/model_info", "/flush_cache", "/get_weights_by_name"}
_RESENDABLE = _IDEMPOTENT | {"/generate"}
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)  # connection closed mid-request


def _refused(e: BaseException) -> bool:
    """Was the connection refused? httpx's async transport says "All connection attempts failed" and keeps
    the ConnectionRefusedError down the exception chain."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if isinstance(x, ConnectionRefusedError) or "refused" in str(x).lower():
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: retry ``k`` (0-based) waits ``uniform(0, min(cap, base * factor**k))``.

    Why jitter: when an engine hiccups, hundreds of in-flight generates fail at once; without jitter they would
    all come back at the same instant and knock it over again. Tests inject a tiny ``base``."""

    base: float = 0.5
    factor: float = 2.0
    cap: float = 10.0
    jitter: bool = True

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        d = min(self.cap, self.base * self.factor ** attempt)
        return (rng or random).uniform(0.0, d) if self.jitter else d


class EngineClient:
    """Sync and async calls to one engine (SGLang or relax_hpc's CPU engine) at ``url``.

    ``timeout``: the total deadline (seconds) of a control call, ``generate_timeout`` that of a ``/generate``
    (the recipe's ``rollout.request_timeout_s``); a deadline covers connect, send, the whole answer body and
    every retry, so an engine that trickles bytes cannot hold a request forever. ``retries``: how many times a
    failed call is sent again (see the retry classes above), waiting ``backoff`` (a :class:`Backoff`, or a
    float: its base) between attempts. ``api_key``: sent as ``Authorization: Bearer KEY`` on every call
    (SGLang's ``--api-key``; the CPU engine's ``RELAX_ENGINE_API_KEY``).
    """

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT, generate_timeout: float = GENERATE_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT, retries: int = 3, backoff: Backoff | float | None = None,
                 max_connections: int = 1024, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout, self.generate_timeout, self.connect_timeout = timeout, generate_timeout, connect_timeout
        self.retries = int(retries)
        self.backoff = backoff if isinstance(backoff, Backoff) else Backoff() if backoff is None else Backoff(float(backoff))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # an idle connection is dropped after 4 s, before the server side closes it (SGLang's uvicorn after 5 s, the
        # CPU engine after 15 s): a call never goes out on a connection the server is closing
        self._limits = httpx.Limits(max_connections=max_connections,
                                    max_keepalive_connections=min(max_connections, KEEPALIVE_CONNECTIONS),
                                    keepalive_expiry=KEEPALIVE_S)
        self._aclients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the private loop that serves the sync calls
        self._loop_thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    # ------------------------------------------------------------------ transport
    def _timeout(self, left: float) -> httpx.Timeout:
        # httpx's timeouts are per phase/read; the total deadline is asyncio.timeout in arequest
        return httpx.Timeout(left, connect=min(self.connect_timeout, left), pool=None)

    def _async(self) -> httpx.AsyncClient:
        # an httpx.AsyncClient belongs to one event loop; keep one per loop (tests and tools call asyncio.run often)
        loop = asyncio.get_running_loop()
        got = self._aclients.get(id(loop))
        if got is None or got[0] is not loop:
            got = (loop, httpx.AsyncClient(limits=self._limits, headers=self._headers))
            self._aclients = {k: v for k, v in self._aclients.items() if not v[0].is_closed()}
            self._aclients[id(loop)] = got
        return got[1]

    def _sync_loop(self) -> asyncio.AbstractEventLoop:
        """Sync calls run on one private event loop in a daemon thread: the async path's total deadline then
        holds for them too (httpx's sync client has per-read timeouts only), and the thread never blocks exit."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name=f"engine-client {self.url}", daemon=True)
                t.start()
                self._loop, self._loop_thread = loop, t
            return self._loop

    def _fail(self, call: str, e: Exception, budget: float) -> EngineError:
        if isinstance(e, httpx.ConnectError):
            cause = "connection refused (is the engine running?)" if _refused(e) \
                else f"cannot connect: {e or type(e).__name__}"
        elif isinstance(e, httpx.ConnectTimeout):
            cause = f"connect timed out after {self.connect_timeout} s"
        elif isinstance(e, (httpx.TimeoutException, TimeoutError)):
            return self._deadline_error(call, budget)
        elif isinstance(e, _DROPPED):
            cause = f"connection closed by the engine mid-request (did it die?): {e or type(e).__name__}"
        else:
            cause = f"{type(e).__name__}: {e}"
        return EngineError(self.url, call, cause)

    def _deadline_error(self, call: str, budget: float) -> EngineError:
        knob = "rollout.request_timeout_s" if call == "/generate" else "the call's timeout"
        return EngineError(self.url, call, f"timed out after {budget:g} s in total (connect, send, answer and "
                                           f"retries; raise {knob} if the engine is just slow)")

    def _status_error(self, call: str, r: httpx.Response) -> EngineError:
        body = r.text
        hint = " (the engine wants the run's API key: Authorization: Bearer ...)" if r.status_code == 401 else ""
        return EngineError(self.url, call, f"HTTP {r.status_code}{hint}: {body[:2000] or '(empty body)'}",
                           status=r.status_code, body=body)

    @staticmethod
    def _retryable(path: str, e: Exception | None, status: int | None) -> bool:
        if e is not None:
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                return True  # never reached the engine
            if isinstance(e, (httpx.TimeoutException, TimeoutError)):
                return False  # the deadline is spent
            return path in _IDEMPOTENT or (path in _RESENDABLE and isinstance(e, _DROPPED))
        if status is None or status < 500:
            return False  # 4xx: the engine refuses this request; sending it again changes nothing
        return path == "/generate" or (path in _IDEMPOTENT and status != 503)  # 503 from a health check = unhealthy

    def _next_wait(self, path: str, failed: Exception | httpx.Response, attempt: int, retries: int,
                   deadline: float) -> float | None:
        """Seconds to wait before sending again, or None: give up (not retryable, out of attempts or of time)."""
        e = failed if isinstance(failed, Exception) else None
        status = failed.status_code if isinstance(failed, httpx.Response) else None
        if attempt >= retries or not self._retryable(path, e, status):
            return None
        wait = self.backoff.delay(attempt)
        return wait if time.monotonic() + wait < deadline else None

    def request(self, method: str, path: str, json: Any = None, *, timeout: float | None = None,
                ok_statuses: Sequence[int] = (200,), retries: int | None = None) -> httpx.Response:
        """Blocking :meth:`arequest` (run on this client's private event loop)."""
        coro = self.arequest(method, path, json, timeout=timeout, ok_statuses=ok_statuses, retries=retries)
        return asyncio.run_coroutine_threadsafe(coro, self._sync_loop()).result()

    async def arequest(self, method: str, path: str, json: Any = None, *, timeout: float | None = None,
                       ok_statuses: Sequence[int] = (200,), retries: int | None = None) -> httpx.Response:
        """One call under one total deadline (``timeout``, default the client's), retried with backoff as the
        retry classes say; raises EngineError unless the status is in ``ok_statuses``."""
        budget = self.timeout if timeout is None else float(timeout)
        retries = self.retries if retries is None else retries
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._deadline_error(path, budget)
            try:
                async with asyncio.timeout(left):  # connect + send + the whole body, however it trickles
                    r = await self._async().request(method, self.url + path, json=json, timeout=self._timeout(left))
            except (httpx.TransportError, TimeoutError) as e:
                failed: Exception | httpx.Response = e
            else:
                if r.status_code in ok_statuses:
                    return r
                failed = r
            wait = self._next_wait(path, failed, attempt, retries, deadline)
            if wait is None:
                if isinstance(failed, httpx.Response):
                    raise self._status_error(path, failed)
                raise self._fail(path, failed, budget) from failed
            log.warning("engine %s: %s failed (%s); retry %d/%d in %.2f s", self.url, path,
                        failed.status_code if isinstance(failed, httpx.Response) else type(failed).__name__,
                        attempt + 1, retries, wait)
            await asyncio.sleep(wait)
            attempt += 1

    def _json(self, path: str, r: httpx.Response) -> Any:
        try:
            return r.json() if r.content else None
        except ValueError as e:
            raise EngineError(self.url, path, f"HTTP {r.status_code} but the answer is not valid JSON ({e}); not "
                              f"retried, is something else listening at this URL? Body: {r.text[:300]!r}",
                              status=r.status_code, body=r.text) from e

    def _success(self, path: str, payload: dict, timeout: float | None = None) -> dict:
        """The ``{"success", "message"}`` calls (session and weight updates)."""
        r = self.request("POST", path, payload, timeout=timeout)
        d = self._json(path, r) or {}
        if d.get("success") is False:
            raise EngineError(self.url, path, f"engine reported failure: {d.get('message')}", status=r.status_code,
                              body=r.text)
        return d

    # ------------------------------------------------------------------ generation
    @staticmethod
    def _generate_payload(input_ids, sampling_params, return_logprob, rid, extra, image_data=None) -> dict:
        sp = sampling_params.to_json() if isinstance(sampling_params, SamplingParams) else dict(sampling_params or {})
        body = {"input_ids": list(input_ids), "sampling_params": sp, "return_logprob": bool(return_logprob)}
        if rid is not None:
            body["rid"] = rid
        if image_data:  # SGLang's form for one request: its images (base64, data: URLs, paths), in placeholder order
            body["image_data"] = list(image_data)
        body.update(extra or {})
        return body

    async def agenerate(self, input_ids: Sequence[int], sampling_params: SamplingParams | dict | None = None, *,
                        return_logprob: bool = True, rid: str | None = None, timeout: float | None = None,
                        extra: dict | None = None, vocab_size: int | None = None,
                        image_data: Sequence | None = None, routing: Routing | None = None) -> Generation:
        """``POST /generate`` for one prompt of token ids (``timeout``: total deadline, default the client's
        ``generate_timeout``), with its images (``image_data``, SGLang's: base64 strings, ``data:`` URLs or paths the
        engine can read, one per ``<|image_pad|>`` run of the prompt, in order). Many may run concurrently
        (asyncio.gather); the engine batches them. An aborted request (pause/abort) returns normally with
        ``finish_reason.type == "abort"``. The answer is checked (:func:`output_problem`; token ids against
        ``vocab_size`` when given, routed experts against ``routing``): :class:`EngineOutputError` if bad; with
        images, :func:`_check_expansion`."""
        body = self._generate_payload(input_ids, sampling_params, return_logprob, rid, extra, image_data)
        r = await self.arequest("POST", "/generate", body, timeout=self.generate_timeout if timeout is None else timeout)
        gen = parse_generation(self.url, self._json("/generate", r), return_logprob=return_logprob,
                               vocab_size=vocab_size, max_new_tokens=requested_max_new_tokens(body["sampling_params"]),
                               routing=routing)
        if image_data:
            _check_expansion(self.url, gen, len(body["input_ids"]))
        return gen

    async def agenerate_group(self, prompts: Sequence[Sequence[int]], sampling_params: Sequence[SamplingParams], *,
                              return_logprob: bool = True, timeout: float | None = None, extra: dict | None = None,
                              vocab_size: int | None = None, routing: Routing | None = None) -> list[Generation]:
        """``POST /generate`` for several prompts in one request (SGLang's batch form: ``input_ids`` a list of lists,
        ``sampling_params`` one dict per prompt); the answers in prompt order, each checked as :meth:`agenerate`
        checks one. A GRPO group is one such request (``rollout.batch_group_requests``): one HTTP round trip for
        ``n_samples_per_prompt`` samples instead of one each. No images, no ``rid`` (nothing to abort one by one)."""
        if len(prompts) != len(sampling_params) or not prompts:
            raise ValueError(f"{len(prompts)} prompts with {len(sampling_params)} sampling parameters")
        sps = [sp.to_json() for sp in sampling_params]
        body = {"input_ids": [list(p) for p in prompts], "sampling_params": sps, "return_logprob": bool(return_logprob)}
        body.update(extra or {})
        r = await self.arequest("POST", "/generate", body, timeout=self.generate_timeout if timeout is None else timeout)
        out = self._json("/generate", r)
        if not isinstance(out, list) or len(out) != len(prompts):
            got = f"a list of {len(out)}" if isinstance(out, list) else type(out).__name__
            raise EngineOutputError(self.url, f"a batch of {len(prompts)} prompts answered with {got}")
        return [parse_generation(self.url, o, return_logprob=return_logprob, vocab_size=vocab_size,
                                 max_new_tokens=requested_max_new_tokens(sp), routing=routing)
                for o, sp in zip(out, sps)]

    def generate(self, input_ids: Sequence[int], sampling_params: SamplingParams | dict | None = None, *,
                 return_logprob: bool = True, rid: str | None = None, timeout: float | None = None,
                 extra: dict | None = None, vocab_size: int | None = None,
                 image_data: Sequence | None = None, routing: Routing | None = None) -> Generation:
        """Blocking :meth:`agenerate`."""
        body = self._generate_payload(input_ids, sampling_params, return_logprob, rid, extra, image_data)
        r = self.request("POST", "/generate", body, timeout=self.generate_timeout if timeout is None else timeout)
        gen = parse_generation(self.url, self._json("/generate", r), return_logprob=return_logprob,
                               vocab_size=vocab_size, max_new_tokens=requested_max_new_tokens(body["sampling_params"]),
                               routing=routing)
        if image_data:
            _check_expansion(self.url, gen, len(body["input_ids"]))
        return gen

    @staticmethod
    def _scoring_payload(prompts: Sequence[Sequence[int]], starts: Sequence[int], top_logprobs_num: int) -> dict:
        body = {"input_ids": [list(p) for p in prompts],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0, "skip_special_tokens": False},
                "return_logprob": True, "logprob_start_len": list(starts)}
        if top_logprobs_num:
            body["top_logprobs_num"] = int(top_logprobs_num)
        return body

    async def ainput_logprobs(self, prompts: Sequence[Sequence[int]], logprob_start_len: int | Sequence[int], *,
                              top_logprobs_num: int = 0, timeout: float | None = None) -> list[InputLogprobs]:
        """``POST /generate`` scoring ``prompts`` (one request, SGLang's batch form): ``max_new_tokens`` 0,
        ``return_logprob``, ``logprob_start_len`` (one for all, or one per prompt), and ``top_logprobs_num`` N when
        > 0; nothing is generated. The engine's log-probs of each prompt's tokens from its start on, as
        :class:`InputLogprobs` in prompt order (checked: :func:`parse_input_logprobs`). To score a response that
        follows a prompt of P tokens, ask ``logprob_start_len = P - 1`` and read ``logprobs[1:]`` (Relax's OPD
        teacher request). ``timeout``: the total deadline, default the client's ``generate_timeout``. Retried as
        ``/generate`` is (a 5xx, a dropped or failed connection); a 4xx is an :class:`EngineError` with its status."""
        prompts = [list(p) for p in prompts]
        starts = [logprob_start_len] * len(prompts) if isinstance(logprob_start_len, int) else list(logprob_start_len)
        if len(starts) != len(prompts) or not prompts:
            raise ValueError(f"{len(starts)} logprob_start_len for {len(prompts)} prompts (and at least one prompt)")
        for p, k in zip(prompts, starts):
            if not 0 <= k < len(p):
                raise ValueError(f"logprob_start_len {k} for a prompt of {len(p)} tokens: it must be in [0, {len(p)})")
        body = self._scoring_payload(prompts, starts, top_logprobs_num)
        r = await self.arequest("POST", "/generate", body, timeout=self.generate_timeout if timeout is None else timeout)
        out = self._json("/generate", r)
        if not isinstance(out, list) or len(out) != len(prompts):
            raise EngineError(self.url, "/generate", f"malformed scoring response: expected a list of {len(prompts)} "
                                                      f"answers, got {str(out)[:300]}")
        return [parse_input_logprobs(self.url, o, p, k, top_logprobs_num) for o, p, k in zip(out, prompts, starts)]

    def input_logprobs(self, prompts: Sequence[Sequence[int]], logprob_start_len: int | Sequence[int], *,
                       top_logprobs_num: int = 0, timeout: float | None = None) -> list[InputLogprobs]:
        """Blocking :meth:`ainput_logprobs`."""
        coro = self.ainput_logprobs(prompts, logprob_start_len, top_logprobs_num=top_logprobs_num, timeout=timeout)
        return asyncio.run_coroutine_threadsafe(coro, self._sync_loop()).result()

    def generate_batch(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams | dict | None = None, *,
                       return_logprob: bool = True, timeout: float | None = None) -> list[Generation]:
        """Blocking: all prompts concurrently (one request each), results in prompt order."""
        async def run():
            try:
                return await asyncio.gather(*(self.agenerate(p, sampling_params, return_logprob=return_logprob,
                                                             timeout=timeout) for p in prompts))
            finally:
                await self.aclose()  # this loop ends here; its connections must not outlive it
        return list(asyncio.run(run()))

    # ------------------------------------------------------------------ health and info
    def health_generate(self, timeout: float = 30.0) -> None:
        """``GET /health_generate``: the engine runs a 1-token generation. Raises EngineError (503 = unhealthy)."""
        self.request("GET", "/health_generate", timeout=timeout)

    async def ahealth_generate(self, timeout: float = 30.0) -> None:
        await self.arequest("GET", "/health_generate", timeout=timeout)

    def is_healthy(self, timeout: float = 30.0) -> bool:
        """Like :meth:`health_generate` but a bool, and no retries (for polling loops)."""
        try:
            self.request("GET", "/health_generate", timeout=timeout, retries=0)
            return True
        except EngineError:
            return False

    def server_info(self) -> dict:
        """``GET /server_info``: server args and scheduler state (``internal_states``)."""
        return self._json("/server_info", self.request("GET", "/server_info"))

    def model_info(self) -> dict:
        """``GET /model_info``: model path, ``weight_version``, architectures."""
        return self._json("/model_info", self.request("GET", "/model_info"))

    def weight_version(self) -> str | None:
        v = self.model_info().get("weight_version")
        return None if v is None else str(v)

    # ------------------------------------------------------------------ control
    def flush_cache(self, timeout: float | None = None) -> str:
        """``POST /flush_cache``. The engine refuses (HTTP 400 → EngineError) while requests run or wait."""
        return self.request("POST", "/flush_cache", timeout=timeout).text

    def pause_generation(self, mode: str = "abort", timeout: float | None = None) -> dict:
        """``POST /pause_generation``: ``abort`` (in-flight requests return aborted), ``retract`` (back to the
        queue, KV dropped) or ``in_place`` (kept with their KV). New requests wait until continue."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        r = self.request("POST", "/pause_generation", {"mode": mode}, timeout=timeout)
        return self._json("/pause_generation", r)

    async def apause_generation(self, mode: str = "abort", timeout: float | None = None) -> dict:
        r = await self.arequest("POST", "/pause_generation", {"mode": mode}, timeout=timeout)
        return self._json("/pause_generation", r)

    def continue_generation(self, timeout: float | None = None) -> dict:
        """``POST /continue_generation``."""
        return self._json("/continue_generation", self.request("POST", "/continue_generation", {}, timeout=timeout))

    async def acontinue_generation(self, timeout: float | None = None) -> dict:
        r = await self.arequest("POST", "/continue_generation", {}, timeout=timeout)
        return self._json("/continue_generation", r)

    def release_memory_occupation(self, tags: Sequence[str] | None = None, timeout: float | None = None) -> dict:
        """``POST /release_memory_occupation``: the engine gives back the device memory of ``tags`` (``"weights"``,
        ``"kv_cache"``, ``"cuda_graph"``; None: all), so a colocated trainer can use it. Refused (HTTP 400 →
        EngineError) while requests run or wait: pause with ``mode="abort"`` first. Resent only when the connection
        was never made: a second release is refused (here) or pauses memory twice (SGLang)."""
        body = {"tags": None if tags is None else list(tags)}
        d = self._json("/release_memory_occupation", self.request("POST", "/release_memory_occupation", body,
                                                                  timeout=timeout))
        return d if isinstance(d, dict) else {}  # SGLang answers a JSON null

    def resume_memory_occupation(self, tags: Sequence[str] | None = None, timeout: float | None = None) -> dict:
        """``POST /resume_memory_occupation``: the engine takes the memory of ``tags`` (None: all) again. The weights
        come back with undefined contents: update them (e.g. :meth:`update_weights_from_tensor`) before generating.
        Resent only when the connection was never made: resuming what is not released is refused (here) or fails
        in SGLang's scheduler."""
        body = {"tags": None if tags is None else list(tags)}
        d = self._json("/resume_memory_occupation", self.request("POST", "/resume_memory_occupation", body,
                                                                 timeout=timeout))
        return d if isinstance(d, dict) else {}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request``: the request ``rid`` (or all) finishes with ``finish_reason.type == "abort"``."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def aabort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self.arequest("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    # ------------------------------------------------------------------ weights
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout: float | None = WEIGHTS_TIMEOUT) -> dict:
        """``POST /init_weights_update_group``. Blocks until every rank joined: run it with :meth:`submit`
        while the trainer (rank 0) creates its side of the group."""
        return self._success("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._success("/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self) -> dict:
        """``POST /begin_weight_update``: SGLang ≥ 0.5.23 accepts distributed/tensor updates only inside a session."""
        return self._success("/begin_weight_update", {})

    def end_weight_update(self) -> dict:
        return self._success("/end_weight_update", {})

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
                                        *, flush_cache: bool = True, weight_version: str | None = None,
                                        load_format: str | None = None, abort_all_requests: bool = False,
                                        timeout: float | None = WEIGHTS_TIMEOUT) -> dict:
        """``POST /update_weights_from_distributed``: the engine receives ``dist.broadcast(src=0)`` of each
        (name, dtype, shape) in order, or one flat buffer with ``load_format="flattened_bucket"``. It returns
        only after the broadcasts: start it with :meth:`submit`, then broadcast. dtypes are torch names
        ("bfloat16"); names are HF parameter names."""
        body = {"names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests, "weight_version": weight_version, "load_format": load_format}
        return self._success("/update_weights_from_distributed", body, timeout)

    def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], *, load_format: str | None = None,
                                   flush_cache: bool = False, abort_all_requests: bool = False,
                                   weight_version: str | None = None, timeout: float | None = None) -> dict:
        """``POST /update_weights_from_tensor``: one entry per TP rank of the engine, each a
        :func:`~relax_hpc.engines.tensor_wire.serialize_named` list of (HF name, tensor) handles (CUDA IPC on the
        same GPU, shared memory on the CPU). The engine copies them in before answering: keep the tensors alive
        until this returns. ``timeout`` defaults to :data:`WEIGHTS_TIMEOUT`. Resent only when the connection was
        never made."""
        body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests, "weight_version": weight_version}
        return self._success("/update_weights_from_tensor", body, WEIGHTS_TIMEOUT if timeout is None else timeout)

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                 load_format: str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False, timeout: float | None = WEIGHTS_TIMEOUT) -> dict:
        """``POST /update_weights_from_disk``: reload weights from an HF directory (late-joining engines)."""
        body = {"model_path": str(model_path), "weight_version": weight_version, "load_format": load_format,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        return self._success("/update_weights_from_disk", body, timeout)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        return self._success("/update_weight_version", {"new_version": str(new_version),
                                                        "abort_all_requests": abort_all_requests})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """``POST /get_weights_by_name``: the first ``truncate_size`` rows of a parameter, as float lists."""
        r = self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        return self._json("/get_weights_by_name", r)

    # ------------------------------------------------------------------ helpers
    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run a blocking call (e.g. :meth:`update_weights_from_distributed`) in a background thread."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-client")
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop = self._loop, self._loop_thread, None
            if loop is not None and not loop.is_closed():
                try:
                    asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(timeout=5.0)
                except Exception:  # noqa: BLE001 - closing idle connections is best effort
                    pass
                loop.call_soon_threadsafe(loop.stop)
                thread.join(timeout=5.0)
                if not thread.is_alive():
                    loop.close()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None

    async def aclose(self) -> None:
        got = self._aclients.pop(id(asyncio.get_running_loop()), None)
        if got is not None:
            await got[1].aclose()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_routing(model_path: str | None, tokenizer: Any = None) -> Routing | None:
    """The routing replay rows the model's engines send (:class:`~relax_hpc.exchange.fields.Routing`: layers ×
    top-k ids, each below its number of experts), from ``config.json`` of ``model_path``, else of the tokenizer's
    directory (a multimodal model's ``text_config``); None for a dense model or where no config is found (then
    an engine's routed experts are checked for what needs no model: ids >= 0, one row a token)."""
    from relax_hpc.exchange.fields import Routing

    config = next(_model_configs(model_path, tokenizer), None)
    return None if config is None else Routing.from_config(config)


def _model_configs(model_path: str | None, tokenizer: Any = None):
    """``config.json`` of ``model_path``, then of the tokenizer's directory, each that can be read."""
    for where in (model_path, getattr(tokenizer, "name_or_path", None)):
        if not where:
            continue
        try:
            yield json.loads((Path(where).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            continue


def vocabulary_size(model_path: str | None, tokenizer: Any = None) -> int | None:
    """The bound of a token id the engine may send: the model's ``vocab_size`` (``config.json`` of ``model_path``,
    else of the tokenizer's directory; a multimodal model's ``text_config``), else ``len(tokenizer)``, else None
    (not checked). The model's, not the tokenizer's: it is the rows of the embedding and of the logits, what the
    engine samples from and what the trainer indexes. It is often larger than ``len(tokenizer)`` (padded for the
    kernels), and an id in between is a legitimate, if unlikely, sample; one past it fails the trainer's embedding
    lookup. A relative ``model_path`` is relative to the working directory, as the roles read recipe paths."""
    for config in _model_configs(model_path, tokenizer):
        for c in (config, config.get("text_config") or {}):
            v = c.get("vocab_size") if isinstance(c, dict) else None
            if isinstance(v, int) and v > 0:
                return v
    if tokenizer is not None:
        try:
            return len(tokenizer)
        except TypeError:
            return None
    return None
