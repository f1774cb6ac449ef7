"""The OPD teacher client: on-policy distillation asks a teacher model for the log-probs of the student's own
response tokens (Relax's ``--opd-type sglang``, ``relax/engine/rollout/on_policy_distillation.py``).

    from relax_hpc.rollout.teacher import TeacherClient, TeacherClientConfig

    teacher = TeacherClient(TeacherClientConfig(urls=["http://node7:30000"], timeout_s=30, batch_size=16))
    scores = await teacher.ascore(samples)      # one TeacherScore per sample, in order
    scores[i].log_probs                         # sample i's response_length teacher log-probs (None: see .error)
    teacher.take_metrics()                      # {"opd/teacher_calls": ..., ...} for this step

- **The request** is SGLang's, as Relax sends it (``build_prefill_payload_base``): the sample's ``tokens`` (prompt +
  response) as ``input_ids``, ``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len = prompt_length - 1``,
  and ``top_logprobs_num`` = ``top_k`` when > 0. SGLang's first ``input_token_logprobs`` row (position
  ``logprob_start_len``) is always null, so the rows from 1 on are the response tokens' log-probs, exactly
  ``response_length`` of them (:meth:`~relax_hpc.engines.client.EngineClient.ainput_logprobs`). The teacher must
  use the student's tokenizer: the ids are sent as they are.
- **Batches**: ``batch_size`` samples per ``/generate`` call (SGLang's batch form), at most
  :data:`IN_FLIGHT_PER_TEACHER` calls in flight per teacher.
- **Teachers**: ``urls`` (teacher engines, or one router in front of them): each call goes to the one with the fewest
  calls in flight, round-robin among equals; one that refused a connection or answered a malformed or inconsistent
  answer is passed over for :data:`DOWN_S` seconds.
- **Failures**, as the GenRM client handles its judges (:mod:`relax_hpc.rollout.genrm`): a transport error, a 5xx or
  an answer of the wrong shape is retried on the next teacher, ``retries`` attempts in all with backoff ``0.5·2^k`` s,
  all inside one deadline of ``timeout_s`` per batch; then :class:`TeacherError` (transient: the rollout role serves
  on, and the controller starts the run's own teacher role again alone and gives the step's generate again). A 4xx
  (but 408 and 429) is the request's fault and would come back from every teacher: it raises
  :class:`TeacherRefused` at once, a :class:`~relax_hpc.errors.PermanentError` naming the teacher, its answer and the
  fix.
- **Every number is checked.** A teacher log-prob that is NaN, null, infinite or positive (or such a top-k value)
  sends that sample to the next teacher; when every attempt gave a bad value, the sample's :class:`TeacherScore`
  has no log-probs and an ``error`` naming the teacher, the position and the value. The caller marks the sample
  with it; nothing is silently dropped or replaced.

Metrics, per step (:meth:`TeacherClient.take_metrics`): ``opd/teacher_calls`` (``/generate`` calls made, retries
included), ``opd/teacher_retries`` (calls after a batch's first), ``opd/teacher_latency_mean`` and ``_max``
(seconds of the calls answered), ``opd/teacher_bad_samples`` (samples returned with an ``error``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence
from urllib.parse import urlsplit

from relax_hpc.engines.client import EngineClient, EngineError, EngineOutputError, InputLogprobs
from relax_hpc.engines.picker import LeastBusy
from relax_hpc.errors import PermanentError

if TYPE_CHECKING:
    from relax_hpc.rollout.sample import Sample

DOWN_S = 5.0  # a teacher that refused a connection (or answered garbage) is passed over this long
BACKOFF_S = 0.5
IN_FLIGHT_PER_TEACHER = 2  # batch calls in flight per teacher: enough to keep one busy without queueing to the deadline


@dataclass
class TeacherClientConfig:
    """Where the teacher is and how to ask it. ``urls``: teacher engines or a router (``http://host:port``);
    ``timeout_s``: the deadline of one batch, every attempt included (Relax's ``--opd-teacher-timeout-s`` 30);
    ``batch_size``: samples per call; ``top_k``: top log-probs per response position too (Relax's
    ``--opd-log-prob-top-k``; 0: none); ``retries``: attempts per batch in all."""

    urls: list[str] = field(default_factory=list)
    timeout_s: float = 30.0
    batch_size: int = 16
    top_k: int = 0
    retries: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.urls, str) or not self.urls or not all(
                isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"teacher urls = {self.urls!r}: give a list of teacher engine (or router) URLs, "
                             "e.g. ['http://node7:30000']")
        checks = (("timeout_s", self.timeout_s, self.timeout_s > 0, "a number of seconds > 0"),
                  ("batch_size", self.batch_size, isinstance(self.batch_size, int) and self.batch_size >= 1,
                   "an integer >= 1"),
                  ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0: none)"),
                  ("retries", self.retries, isinstance(self.retries, int) and self.retries >= 1, "an integer >= 1"))
        for key, value, ok, want in checks:
            if not ok or isinstance(value, bool):
                raise ValueError(f"teacher {key} = {value!r}: it must be {want}")


@dataclass
class TeacherScore:
    """The teacher's answer for one sample. ``log_probs``: ``response_length`` floats, the teacher's log-prob of each
    response token; ``top_log_probs`` / ``top_ids`` (when ``top_k`` > 0): ``response_length`` rows of ``top_k``, largest
    first. ``error`` (then ``log_probs`` is None): why this sample has none (every teacher asked answered a bad
    value for it, or its tokens are not a prompt followed by a response); the caller marks the sample with it."""

    log_probs: list[float] | None
    top_log_probs: list[list[float]] | None = None
    top_ids: list[list[int]] | None = None
    teacher: str | None = None
    weight_version: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class TeacherError(RuntimeError):
    """A batch got no answer from any teacher within ``timeout_s`` and ``retries`` (transport errors, 5xx, answers of
    the wrong shape): a restart, or a later try, may find the teacher back. ``restartable``, and ``serve_on``: the
    rollout role reports it as its generate's outcome and serves on (:func:`relax_hpc.roles.tasks.serve`). With the
    run's own teacher (``roles.teacher``) the controller waits for the teacher's liveness verdict: dead, it is started
    again alone (role tier) and the step's generate goes again, from the same data cursor; alive, the generate goes
    again (:data:`relax_hpc.controller.training.TEACHER_RETRIES` times), then the teacher is started again alone. An
    outside teacher (``opd.teacher_url``): every step restarts (``checkpoint.max_restarts``)."""

    restartable = True
    serve_on = True


class TeacherRefused(TeacherError, PermanentError):
    """A teacher refused the request itself (4xx): every teacher would, every time. The run fails with the reason."""

    restartable = False
    serve_on = False


class TeacherBadValues(TeacherError, PermanentError):
    """The teachers answered, but never with usable numbers for some sample (NaN, inf, positive log-probs on every
    attempt): the same tokens would get the same answer again, so the run fails rather than restarting."""

    restartable = False
    serve_on = False


class TeacherClient:
    """Scoring calls to a set of teacher engines (thread-safe; usable from any event loop)."""

    def __init__(self, cfg: TeacherClientConfig, *, api_key: str | None = None):
        self.cfg = cfg
        # the retries are this client's (on the next teacher), so each engine call is one attempt
        self._clients = {u: EngineClient(u, retries=0, api_key=api_key, generate_timeout=cfg.timeout_s)
                         for u in dict.fromkeys(u.rstrip("/") for u in cfg.urls)}
        self._picker = LeastBusy()
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}
        self._calls = self._retries = self._bad = 0
        self._latencies: list[float] = []

    # -- choosing a teacher
    def _pick(self, tried: set[str]) -> str | None:
        """The least busy teacher not tried yet by this batch (all tried: any), passing over those down (all down:
        any)."""
        with self._lock:
            now = time.monotonic()
            names = [u for u in self._clients if u not in tried] or list(self._clients)
            up = [u for u in names if self._down.get(u, 0.0) <= now] or names
        return self._picker.acquire(up)

    # -- the calls
    async def ascore(self, samples: Sequence[Sample]) -> list[TeacherScore]:
        """The teacher's log-probs of each sample's response tokens, in sample order (see the module docstring)."""
        out: list[TeacherScore | None] = [None] * len(samples)
        todo: list[tuple[int, Sample]] = []
        for i, s in enumerate(samples):
            r = int(s.response_length or 0)
            prompt = len(s.tokens) - r
            if r < 0 or prompt < 0:
                out[i] = TeacherScore(log_probs=None, error=f"sample {s.index} has response_length {r} for "
                                      f"{len(s.tokens)} tokens: not a prompt followed by a response")
            elif r == 0:
                out[i] = TeacherScore(log_probs=[], top_log_probs=[] if self.cfg.top_k else None,
                                      top_ids=[] if self.cfg.top_k else None)
            elif prompt == 0:
                out[i] = TeacherScore(log_probs=None, error=f"sample {s.index} has no prompt token before its "
                                      "response: the teacher cannot score the first response token")
            else:
                todo.append((i, s))
        gate = asyncio.Semaphore(IN_FLIGHT_PER_TEACHER * len(self._clients))

        async def one(batch):
            async with gate:
                return await self._batch(batch)

        n = self.cfg.batch_size
        tasks = [asyncio.ensure_future(one(todo[j:j + n])) for j in range(0, len(todo), n)]
        try:
            batches = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # one batch failed the call: the others' answers would be thrown away
                t.cancel()
            raise
        for found in batches:
            for i, score in found.items():
                out[i] = score
        bad = sum(1 for x in out if x is not None and x.error is not None)
        with self._lock:
            self._bad += bad
        return out  # type: ignore[return-value]  # every index filled

    def score(self, samples: Sequence[Sample]) -> list[TeacherScore]:
        """Blocking :meth:`ascore` (from code with no event loop running)."""
        _test_gate(list(self._clients))
        async def run():
            try:
                return await self.ascore(samples)
            finally:
                for c in self._clients.values():
                    await c.aclose()  # this loop ends here; its connections must not outlive it
        return asyncio.run(run())

    async def _batch(self, items: list[tuple[int, Sample]]) -> dict[int, TeacherScore]:
        """One batch, retried on the next teacher; the samples whose values were bad on every attempt come back with
        an error. Raises :class:`TeacherRefused` on a 4xx, :class:`TeacherError` when no answer came in time."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.timeout_s
        done: dict[int, TeacherScore] = {}
        bad: dict[int, str] = {}  # the last bad value seen for a sample still pending
        pending = list(items)
        tried: set[str] = set()
        last: BaseException | None = None
        calls = 0
        for attempt in range(cfg.retries):
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            calls += 1
            url = self._pick(tried)
            tried.add(url)
            with self._lock:
                self._calls += 1
                self._retries += attempt > 0
            t0 = time.monotonic()
            try:
                answers = await self._clients[url].ainput_logprobs(
                    [s.tokens for _, s in pending], [len(s.tokens) - s.response_length - 1 for _, s in pending],
                    top_logprobs_num=cfg.top_k, timeout=left)
            except EngineError as e:
                last = e
                if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                    raise TeacherRefused(_refusal(url, e, pending)) from e
                if e.status is None or isinstance(e, EngineOutputError):
                    with self._lock:
                        self._down[url] = time.monotonic() + DOWN_S
                if attempt + 1 < cfg.retries:
                    await asyncio.sleep(min(BACKOFF_S * 2 ** attempt, max(deadline - time.monotonic(), 0.0)))
                continue
            finally:
                self._picker.release(url)
            with self._lock:
                self._latencies.append(time.monotonic() - t0)
            still = []
            for (i, s), a in zip(pending, answers):
                if a.problem is not None:
                    bad[i] = f"teacher {url}: {a.problem}"
                    still.append((i, s))
                else:
                    done[i] = _score(url, a, s.response_length, cfg.top_k)
                    bad.pop(i, None)
            pending = still
        for i, _ in pending:
            if i in bad:  # answered, but never with good numbers: the sample is marked, the step goes on
                done[i] = TeacherScore(log_probs=None, teacher=None, error=f"{bad[i]} (after {calls} teacher "
                                       f"call(s); every answer for it had a bad value)")
        missing = [i for i, _ in pending if i not in done]
        if missing:
            why = f": {last}" if last is not None else ""
            raise TeacherError(f"the OPD teacher gave no answer for {len(missing)} sample(s) within teacher timeout_s "
                               f"= {cfg.timeout_s:g} s and {cfg.retries} attempt(s), tried {', '.join(sorted(tried))}"
                               f"{why}. Fix: check the teacher engines are up (their logs), or raise the teacher's "
                               "timeout_s if they are just slow")
        return done

    def take_metrics(self) -> dict[str, float]:
        """``opd/teacher_calls``, ``opd/teacher_retries``, ``opd/teacher_bad_samples``, and
        ``opd/teacher_latency_mean`` / ``_max`` when a call was answered, since the last take (a step's)."""
        with self._lock:
            lat, self._latencies = self._latencies, []
            out = {"opd/teacher_calls": float(self._calls), "opd/teacher_retries": float(self._retries),
                   "opd/teacher_bad_samples": float(self._bad)}
            self._calls = self._retries = self._bad = 0
        if lat:
            out["opd/teacher_latency_mean"] = sum(lat) / len(lat)
            out["opd/teacher_latency_max"] = max(lat)
        return out

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


_calls = itertools.count(1)  # score() calls of this process (one per generate with OPD): the test gate counts them


def _test_gate(urls: list[str]) -> None:
    """Test hook: ``RELAX_TEST_TEACHER_GATE=<k>[,<k>...]:<dir>``: at this process's k-th :meth:`TeacherClient.score`
    call (the rollout role's k-th generate), once per run (the file ``<dir>/asked-<k>`` says it was done), write that
    file and wait until every teacher refuses connections (a test kills the teacher then: a ``kill -9`` that lands
    mid-generate without racing it), then ask them as always."""
    spec = os.environ.get("RELAX_TEST_TEACHER_GATE", "")
    k = next(_calls)
    ks, _, where = spec.partition(":")
    mark = Path(where) / f"asked-{k}"
    if not spec or str(k) not in ks.split(",") or mark.exists():
        return
    mark.write_text(" ".join(urls))
    deadline = time.monotonic() + 300.0  # never forever: a test that does not kill fails on its own asserts
    while time.monotonic() < deadline and any(_accepts(u) for u in urls):
        time.sleep(0.05)


def _accepts(url: str) -> bool:
    """Whether ``url``'s host:port takes a TCP connection."""
    u = urlsplit(url)
    try:
        with socket.create_connection((u.hostname, u.port or 80), timeout=1.0):
            return True
    except OSError:
        return False


def _score(url: str, a: InputLogprobs, response_length: int, top_k: int) -> TeacherScore:
    """Rows 1.. of a good answer (row 0 is SGLang's null pad at ``prompt_length - 1``): the response tokens'."""
    lps = [float(x) for x in a.logprobs[1:1 + response_length]]
    top_lp = top_ids = None
    if top_k:
        top_lp = [list(row[0]) for row in a.top[1:1 + response_length]]  # type: ignore[index]
        top_ids = [list(row[1]) for row in a.top[1:1 + response_length]]  # type: ignore[index]
    return TeacherScore(log_probs=lps, top_log_probs=top_lp, top_ids=top_ids, teacher=url,
                        weight_version=a.weight_version)


def _refusal(url: str, e: EngineError, pending: list[tuple[int, Sample]]) -> str:
    """The message of a 4xx: the teacher, its answer, and the fix for the usual causes."""
    longest = max(len(s.tokens) for _, s in pending)
    text = (e.body or e.cause or "").lower()
    if e.status in (401, 403):
        fix = "give the teacher client the API key the teacher engine requires (the run's engine key)"
    elif "context length" in text or "longer than" in text:
        fix = (f"the longest sample has {longest} tokens (prompt + response): use a teacher whose context holds it, "
               "or shorten the prompts or the rollout's max response length")
    elif "input_ids" in text or "vocab" in text:
        fix = ("the teacher's vocabulary does not hold the student's token ids: the teacher must use the student's "
               "tokenizer")
    elif e.status == 404:
        fix = "is this URL an SGLang engine or router? It has no /generate"
    else:
        fix = "the teacher refuses this request itself, and every teacher would; see its answer above"
    return f"the OPD teacher {url} refused the scoring request: {e}. Fix: {fix}"
