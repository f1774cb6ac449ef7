"""The GenRM client: reward functions ask the run's LLM judge (the ``genrm`` role's engines) for text.

    from relax_hpc.rollout import genrm

    async def reward_func(args, sample, **kwargs):
        verdict = await genrm.generate([{"role": "user", "content": f"Is {sample.response!r} right? 1 or 0"}])
        return 1.0 if verdict.startswith("1") else 0.0

:func:`generate` is Relax's ``get_genrm_client().generate(messages, sampling_params=None)`` (Relax's service API,
``relax/components/genrm.py``) without the service in between: the rollout role talks to the judge engines itself.

- The messages are rendered with the judge model's chat template (``apply_chat_template(...,
  add_generation_prompt=True, **genrm.sampling.chat_template_kwargs)``) and sent as token ids to ``/generate``.
- Sampling: ``genrm.sampling`` (Relax's fallbacks: temperature 0.2, top_p 1, top_k −1, max_response_len 1024),
  overridden per call by ``sampling_params`` (SGLang names; ``max_response_len`` is read as ``max_new_tokens``).
  Each request is seeded by its token ids unless the call gives ``sampling_seed``, so a judged text gets the same
  verdict from any judge, and a step generated again (a resume, a damaged chunk) is scored again alike.
- Load balancing: the judge with the fewest calls in flight, round-robin among equals. A judge that refused a
  connection is passed over for :data:`DOWN_S` seconds.
- Failures: a transport error or 5xx is retried on the next judge, ``genrm.retries`` attempts in all with backoff
  ``0.5·2^k`` s, inside one deadline ``genrm.request_timeout_s``; a 4xx is not retried. The last error is raised
  as :class:`GenRMError`; ``dapo-genrm`` turns a transient one into score 0 with ``format_error:
  judge_transient_error``, as Relax does, but lets a 4xx fail the reward (``rollout.reward_error_policy``): Relax
  would score every sample 0 for a judge that refuses every prompt, and nobody would see why.
- ``route_key``: Relax routes between several judge instances by it; a run here has one judge, so only None
  (or Relax's ``"__default__"``) is accepted. A key naming another judge is refused rather than silently sent to
  the one there is.

Metrics, per rollout step (:func:`take_metrics`): ``genrm/requests`` (calls made), ``genrm/errors`` (calls that
failed after their retries), ``genrm/latency_p50`` (median seconds of the calls that succeeded).

The rollout role calls :func:`configure` with the judges' URLs the controller sends with each task; code that
runs elsewhere (a test, a tool) may call it too.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import zlib
from typing import TYPE_CHECKING, Any, Sequence

from relax_hpc.engines.client import EngineClient, EngineError
from relax_hpc.engines.picker import LeastBusy

if TYPE_CHECKING:
    from relax_hpc.rollout.config import GenRMConfig

DOWN_S = 5.0  # a judge that refused a connection is skipped this long (Relax's engine-cache cooldown)
BACKOFF_S = 0.5
DEFAULT_ROUTES = (None, "__default__")


class GenRMError(RuntimeError):
    """A judge call failed. ``transient``: every attempt failed on transport errors, 5xx or the deadline (another
    try later may work); not transient: no judge is configured, or a judge refused the request (4xx: e.g. a
    prompt longer than the judge's context), which would fail every time."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class GenRMClient:
    """Calls to a set of judge engines ``{name: url}`` (thread-safe; usable from any event loop)."""

    def __init__(self, engines: dict[str, str], cfg: GenRMConfig, tokenizer: Any, *, api_key: str | None = None):
        self.cfg, self.tokenizer, self.api_key = cfg, tokenizer, api_key
        self._lock = threading.Lock()
        self._clients: dict[str, EngineClient] = {}
        self._picker = LeastBusy()
        self._down: dict[str, float] = {}
        self._requests = self._errors = 0
        self._latencies: list[float] = []
        self.set_engines(engines)

    def set_engines(self, engines: dict[str, str]) -> None:
        """The judges now; a judge whose URL is unchanged keeps its client."""
        with self._lock:
            keep = {n: c for n, c in self._clients.items() if engines.get(n) == c.url}
            for n, c in self._clients.items():
                if n not in keep:
                    c.close()
            # retries are this client's (on the next judge), so each engine call is one attempt
            self._clients = {n: keep.get(n) or EngineClient(u, retries=0, api_key=self.api_key,
                                                             generate_timeout=self.cfg.request_timeout_s)
                             for n, u in engines.items()}
            self._down = {n: t for n, t in self._down.items() if n in self._clients}

    @property
    def engines(self) -> dict[str, str]:
        return {n: c.url for n, c in self._clients.items()}

    # -- what is sent
    def render(self, messages: Sequence[dict]) -> list[int]:
        """The judge prompt's token ids: its chat template with the generation prompt (Relax's service does so)."""
        if isinstance(messages, str) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise GenRMError(f"genrm.generate takes messages [{{'role': ..., 'content': ...}}, ...], got {messages!r:.200}")
        kwargs = dict(self.cfg.sampling.chat_template_kwargs)
        ids = self.tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def sampling(self, ids: Sequence[int], overrides: dict | None) -> dict:
        """``genrm.sampling`` under SGLang's names, then ``overrides``; seeded by the prompt's ids unless given."""
        s = self.cfg.sampling
        sp: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                              "max_new_tokens": s.max_response_len}
        for k, v in (overrides or {}).items():
            sp["max_new_tokens" if k == "max_response_len" else k] = v
        sp.setdefault("sampling_seed", zlib.crc32(bytes(str(list(ids)), "ascii")) & 0x7FFFFFFF)
        return sp

    # -- choosing a judge
    def _pick(self, tried: set[str]) -> str | None:
        """The least busy judge not tried yet (all tried: any), passing over those down (all down: any)."""
        with self._lock:
            now = time.monotonic()
            names = [n for n in self._clients if n not in tried] or list(self._clients)
            up = [n for n in names if self._down.get(n, 0.0) <= now] or names
        return self._picker.acquire(up)

    # -- the call
    async def generate(self, messages: Sequence[dict], sampling_params: dict | None = None,
                       route_key: str | None = None) -> str:
        """The judge's answer to ``messages`` (its text, stripped)."""
        if route_key not in DEFAULT_ROUTES:
            raise GenRMError(f"genrm.generate: route_key {route_key!r} names a judge instance, and this run has one "
                             "judge (roles.genrm). Fix: call without route_key")
        if not self._clients:
            raise GenRMError("genrm.generate: the run has no judge engines (roles.genrm has none running)")
        ids = self.render(messages)
        sp = self.sampling(ids, sampling_params)
        with self._lock:
            self._requests += 1
        t0 = time.monotonic()
        deadline = t0 + self.cfg.request_timeout_s
        tried: set[str] = set()
        last: BaseException | None = None
        for attempt in range(self.cfg.retries):
            name = self._pick(tried)
            left = deadline - time.monotonic()
            if name is None or left <= 0:
                break
            tried.add(name)
            try:
                gen = await self._clients[name].agenerate(ids, sp, return_logprob=False, timeout=left)
            except EngineError as e:
                last = e
                if e.status is not None and 400 <= e.status < 500:
                    break  # the request is wrong: another judge would say so too
                if e.status is None:
                    with self._lock:
                        self._down[name] = time.monotonic() + DOWN_S
                if attempt + 1 < self.cfg.retries:
                    await asyncio.sleep(min(BACKOFF_S * 2 ** attempt, max(deadline - time.monotonic(), 0.0)))
                continue
            finally:
                self._picker.release(name)
            text = gen.text if gen.text is not None else self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            with self._lock:
                self._latencies.append(time.monotonic() - t0)
            return text.strip()
        with self._lock:
            self._errors += 1
        refused = isinstance(last, EngineError) and last.status is not None and 400 <= last.status < 500
        why = f": {last}" if last is not None else f": no answer within genrm.request_timeout_s = {self.cfg.request_timeout_s:g} s"
        fix = (". Fix: the judge refused the request itself (e.g. a prompt longer than the judge model's context): "
               "shorten the prompt or use a judge with a longer context" if refused else "")
        raise GenRMError(f"genrm.generate failed after {len(tried)} attempt(s) on {', '.join(sorted(tried)) or 'no judge'}"
                         f"{why}{fix}", transient=not refused) from last

    def take_metrics(self) -> dict[str, float]:
        """``genrm/requests``, ``genrm/errors``, ``genrm/latency_p50`` since the last take (a step's)."""
        with self._lock:
            lat, self._latencies = self._latencies, []
            out = {"genrm/requests": float(self._requests), "genrm/errors": float(self._errors)}
            self._requests = self._errors = 0
        if lat:
            out["genrm/latency_p50"] = float(statistics.median(lat))
        return out

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


_client: GenRMClient | None = None


def configure(engines: dict[str, str], cfg: GenRMConfig, *, tokenizer: Any = None, api_key: str | None = None,
              model_path: str | None = None) -> GenRMClient:
    """Point the module's client at ``engines`` (made at the first call: the judge's tokenizer is loaded from
    ``model_path``, default ``cfg.model_path``, unless given)."""
    global _client
    if _client is None or _client.cfg is not cfg:
        if tokenizer is None:
            from relax_hpc.rollout.data import load_tokenizer

            tokenizer = load_tokenizer(model_path or cfg.model_path)
        if _client is not None:
            _client.close()
        _client = GenRMClient(engines, cfg, tokenizer, api_key=api_key)
    else:
        _client.set_engines(engines)
    return _client


def reset() -> None:
    """Forget the client (tests; a role that ends)."""
    global _client
    if _client is not None:
        _client.close()
    _client = None


def get_genrm_client() -> GenRMClient:
    """The run's judge client (Relax's ``get_genrm_client``); :class:`GenRMError` when the run has no judge."""
    if _client is None:
        raise GenRMError("this run has no GenRM judge. Fix: set genrm.model_path and roles.genrm.enabled: true "
                         "(with its nodes) in the recipe")
    return _client


async def generate(messages: Sequence[dict], sampling_params: dict | None = None, route_key: str | None = None) -> str:
    """The judge's answer to ``messages``: see :meth:`GenRMClient.generate`."""
    return await get_genrm_client().generate(messages, sampling_params, route_key)


def take_metrics() -> dict[str, float]:
    return _client.take_metrics() if _client is not None else {}
