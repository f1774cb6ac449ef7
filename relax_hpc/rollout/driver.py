"""The rollout driver: one rollout batch from prompt groups, across engines, with rewards.

:meth:`RolloutDriver.generate_rollout` takes groups of samples (from
:meth:`relax_hpc.rollout.data.RolloutDataSource.get_samples`: ``n_samples_per_prompt`` copies of one prompt
per group) and, as Relax's default ``generate_rollout`` does:

1. sends one ``/generate`` per sample (prompt token ids, Relax's sampling parameters, log-probs on for
   training) to the engines, at most ``sglang_server_concurrency`` in flight per engine, each request to the
   least-loaded live engine;
2. writes the engine's answer into the sample: ``tokens`` = prompt + response ids, ``response``,
   ``response_length``, ``loss_mask`` (ones; zeros for ``remove_sample``), ``rollout_log_probs``,
   ``weight_versions`` (SGLang's ``meta_info["weight_version"]``) and ``status`` from ``finish_reason``;
3. scores each group as soon as it is complete (:class:`~relax_hpc.rollout.rewards.RewardRunner`);
4. computes Relax's ``rollout/...`` metrics. Rewards stay raw (R): group normalization and advantages run on
   the training side (:func:`relax_hpc.train.plan.train_batch`), which also reports ``rollout/rewards``.

Engine failures: a request that fails without an HTTP answer (connection refused or closed, timeout) makes
the driver probe that engine's ``/health_generate``; if the probe fails too the engine is declared dead —
logged and recorded by name (URL unless a name is given) in :attr:`RolloutResult.engine_failures`, reported
to ``on_engine_dead`` — and never used again by this driver; the request goes to another engine, from
scratch. An engine whose answer cannot be right (:class:`~relax_hpc.engines.client.EngineOutputError`: NaN,
infinite or positive log-probs, none where asked, a token id outside the model's vocabulary (:attr:`vocab_size`),
counts that disagree, an empty output that was not aborted; with ``train.routing_replay``, routed experts that do
not fit the model (:attr:`routing`: an expert id outside ``[0, num_experts)``, one expert twice in a token's top-k,
rows for another number of tokens or layers) is declared dead the same way, at once and with that
reason, and the request goes to another engine: a broken engine's output never reaches training. Only if no
engine is left does the batch fail, with :class:`NoEngineError` naming every dead engine and why. An engine
that answers an error (HTTP 5xx) or aborts the request is retried up to ``max_retries`` times (on another
engine when there is one); an HTTP 4xx (a request the engine refuses, e.g. a prompt longer than its context)
fails the batch at once with the sample named. Below that, each client resends a
generate after a 5xx or a dropped connection with jittered exponential backoff, so a short burst of errors never
reaches the driver.

Deadline: ``rollout.request_timeout_s`` is one total deadline per request, across every attempt, backoff, probe
and engine: the time the request spends at engines, not the time it queues in the driver for a free slot
(``sglang_server_concurrency``), which depends on the batch size, not on any engine. Each attempt gets what is left
of it, and when it runs out the request fails with :class:`RequestTimeout` (restartable: the engines did not answer;
a restart starts them again). So a hung engine fails its requests after that long, where each attempt used to get
the whole deadline again: (max_retries + 1) × 600 s = 40 minutes at the defaults. The driver does not probe an
engine merely because an answer is slow: SGLang's ``/health_generate`` answers 503 when its scheduler made no progress
for 20 s, as while it is paused for a weight sync, which would kill healthy engines in the syncs of an async run.

Reward failures are collected over the whole batch and handled once, in sample order: under
``reward_error_policy: fail`` the report reads the same whichever group's reward happened to fail first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from relax_hpc.engines.client import (Backoff, EngineError, EngineOutputError, Generation, SamplingParams,
                                     model_routing, vocabulary_size)
from relax_hpc.engines.pool import Engine, EngineLike, EnginePool, as_client
from relax_hpc.rollout.metrics import sample_metrics
from relax_hpc.rollout.rewards import GENERATE_PARAMS, RewardFailure, RewardRunner, positive_seconds
from relax_hpc.rollout.errors import NoEngineError, RequestTimeout, RolloutError
from relax_hpc.rollout.multiturn import MultiTurn, env_factory, generate_multiturn
from relax_hpc.rollout.sample import Sample, SampleStatus, sample_seed

Recipe = Any  # the run's relax_hpc.recipe.Recipe, by its attributes: rollout/ imports nothing of the recipe

log = logging.getLogger(__name__)

HEALTH_PROBE_TIMEOUT = 10.0  # seconds for the /health_generate probe after a transport error
MIN_ATTEMPT_S = 30.0  # the least share of a request's deadline an attempt gets while another engine could take it


@dataclass
class EngineFailure:
    """An engine the driver declared dead during a batch."""

    name: str
    url: str
    error: str
    time: float  # time.time() when declared dead


@dataclass
class RolloutResult:
    """One rollout batch: samples (groups consecutive, in the order given), rewards and metrics."""

    samples: list[Sample]
    raw_rewards: list[float]  # scalar reward per sample (through reward_key); normalized on the training side
    metrics: dict[str, float]
    group_size: int
    reward_failures: list[RewardFailure] = field(default_factory=list)
    engine_failures: list[EngineFailure] = field(default_factory=list)
    retries: int = 0  # requests sent again (dead engine, 5xx, abort)

    def groups(self) -> list[list[Sample]]:
        """The samples of each prompt group, in order (a group holds more than ``group_size`` when a custom
        generate function returned segments)."""
        return [[self.samples[i] for i in g] for g in group_spans(self.samples, self.group_size)]

    def group_rewards(self) -> list[list[float]]:
        """``raw_rewards`` cut as :meth:`groups` cuts the samples."""
        return [[self.raw_rewards[i] for i in g] for g in group_spans(self.samples, self.group_size)]


def group_spans(samples: Sequence[Sample], group_size: int) -> list[range]:
    """Index ranges of the prompt groups of a batch laid out group after group: consecutive ``group_size``
    samples, or, where segments make groups longer (samples with a ``rollout_id``), consecutive samples of one
    ``group_index``."""
    if not any(s.rollout_id is not None for s in samples):
        return [range(i, min(i + group_size, len(samples))) for i in range(0, len(samples), group_size)]
    spans, start = [], 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].group_index != samples[start].group_index:
            spans.append(range(start, i))
            start = i
    return spans


def rollout_view(samples: Sequence[Sample], raw: Sequence[float]) -> tuple[list[Sample], list[float]]:
    """One entry per rollout, for what counts rollouts (group statistics, pass@k, the reward mean): a rollout
    returned as segments is its last segment, with the mean of its segments' rewards. Without segments: as given."""
    if not any(s.rollout_id is not None for s in samples):
        return list(samples), list(raw)
    reps: list[Sample] = []
    means: list[float] = []
    i = 0
    while i < len(samples):
        j, key = i + 1, (samples[i].group_index, samples[i].rollout_id)
        while key[1] is not None and j < len(samples) and (samples[j].group_index, samples[j].rollout_id) == key:
            j += 1
        reps.append(samples[j - 1])
        means.append(statistics.fmean(raw[i:j]))
        i = j
    return reps, means


@dataclass
class BatchCounters:
    """Per-batch counters (several batches may run at once on one driver, e.g. eval beside training)."""

    retries: int = 0
    engine_failures: list[EngineFailure] = field(default_factory=list)


class RolloutDriver:
    """Generates rollout batches over a set of engines. See the module docstring for the behaviour.

    ``recipe``: the run's :class:`~relax_hpc.recipe.schema.Recipe`; the driver's settings are its ``rollout``
    section (:attr:`cfg`: sampling, ``eval_*``, ``sglang_server_concurrency``, ``max_retries``,
    ``request_timeout_s``, ``log_passrate``), the reward's are read by the :class:`RewardRunner` made from it
    (or ``reward``, given). ``engines``: a list of :class:`EngineClient`/``EngineHandle``/URLs
    (named by URL) or a ``{name: engine}`` mapping; for handles and URLs the driver builds the clients: total
    deadline ``request_timeout_s`` per generate, ``max_retries`` retries with ``backoff``, ``api_key`` (the
    run's engine key) on every call. A given EngineClient is used as it is. ``tokenizer``: turns prompts without token ids into ids
    (``encode(prompt, add_special_tokens=False)``) and decodes responses the engine sent no text for.
    ``on_engine_dead(name, reason)`` is called once per engine declared dead. ``vocab_size``: the bound of an
    output token id (:func:`vocabulary_size` of the recipe's model and the tokenizer when not given). With
    ``train.routing_replay``, :attr:`routing` is the model's (:func:`model_routing`: layers, top-k, experts), what
    each answer's routed experts are checked against.
    """

    def __init__(self, recipe: Recipe, engines: Sequence[EngineLike] | dict[str, EngineLike], *,
                 tokenizer: Any = None, reward: RewardRunner | None = None,
                 on_engine_dead: Callable[[str, str], None] | None = None, api_key: str | None = None,
                 backoff: Backoff | None = None, vocab_size: int | None = None) -> None:
        self.recipe = recipe
        self.cfg = recipe.rollout
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else vocabulary_size(recipe.model.path, tokenizer)
        replay = getattr(getattr(recipe, "train", None), "routing_replay", False)
        self.routing = model_routing(recipe.model.path, tokenizer) if replay else None
        self.reward = reward if reward is not None else RewardRunner(recipe)  # loads the reward function: fails early
        self.on_engine_dead = on_engine_dead
        # called as groups are generated and scored: the rollout role passes ctx.progress (logging.task_timeout_s)
        self.on_progress: Callable[[int], None] | None = None
        self.per_engine = self.cfg.sglang_server_concurrency
        self.max_retries = self.cfg.max_retries
        timeout = positive_seconds(self.cfg, "request_timeout_s", "the total deadline of one generate request; ")
        self.request_timeout_s = timeout
        self.client_kwargs: dict[str, Any] = {"generate_timeout": timeout, "retries": self.max_retries,
                                              "api_key": api_key, "backoff": backoff}
        self.engine_failures: list[EngineFailure] = []
        self._unbatched: list[EngineFailure] = []  # declared dead by the EngineRouter: the next batch reports them
        self._inflight: dict[str, Engine] = {}  # rid -> engine, for requests abort_inflight may abort
        self._generate_fns: dict[str, Callable] = {}  # custom generate functions, loaded once
        self.router: Any = None  # the EngineRouter custom generate functions call, started on first use
        self.multiturn = multiturn_from(recipe, self.reward.args)  # None: one /generate per sample
        self.leaving: Callable[[], frozenset[str]] = frozenset  # draining engines (the rollout role: RUN_DIR/draining)
        self.set_engines(engines)

    # --- engines -------------------------------------------------------------------------------------
    def set_engines(self, engines: Sequence[EngineLike] | dict[str, EngineLike]) -> None:
        """Replace the engine set (elastic scaling, restarted engines); dead marks are forgotten."""
        items = engines.items() if isinstance(engines, dict) else ((None, e) for e in engines)
        pool: list[Engine] = []
        for name, e in items:
            client = as_client(e, **self.client_kwargs)
            pool.append(Engine(name=str(name) if name is not None else client.url, client=client))
        names = [e.name for e in pool]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.pool = EnginePool(pool, self.per_engine, lambda: self.leaving(), none_left=NoEngineError)

    @property
    def live_engines(self) -> list[str]:
        return [e.name for e in self.pool.alive()]

    @property
    def dead_engines(self) -> dict[str, str]:
        return {e.name: e.dead for e in self.pool.engines if e.dead is not None}

    def engine_stats(self) -> dict[str, dict[str, Any]]:
        """Per engine: requests sent, the peak in flight, and why it is dead (None if alive)."""
        return {e.name: {"url": e.client.url, "requests": e.served, "peak_in_flight": e.peak, "dead": e.dead}
                for e in self.pool.engines}

    # --- sampling parameters -------------------------------------------------------------------------
    def sampling_params(self, evaluation: bool = False) -> SamplingParams:
        """Relax's sampling parameters from ``rollout``; for eval, each ``eval_*`` that is set overrides its own."""
        c = self.cfg

        def pick(eval_value: Any, value: Any) -> Any:
            return eval_value if evaluation and eval_value is not None else value

        extra: dict[str, Any] = {
            "skip_special_tokens": c.skip_special_tokens,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        if c.stop:
            extra["stop"] = list(c.stop)
        return SamplingParams(
            max_new_tokens=int(pick(c.eval_max_response_len, c.max_response_len)),
            temperature=float(pick(c.eval_temperature, c.temperature)),
            top_p=float(pick(c.eval_top_p, c.top_p)),
            top_k=int(pick(c.eval_top_k, c.top_k)),
            stop_token_ids=list(c.stop_token_ids) or None,
            extra=extra,
        )

    # --- one sample ----------------------------------------------------------------------------------
    def prompt_ids(self, sample: Sample) -> list[int]:
        if sample.tokens:
            return list(sample.tokens)
        if self.tokenizer is None:
            raise RolloutError(f"sample index={sample.index} has no prompt token ids and the driver has no tokenizer")
        if not isinstance(sample.prompt, str):
            raise RolloutError(f"sample index={sample.index}: the prompt is chat messages; apply the chat template "
                               "first (data.apply_chat_template)")
        return list(self.tokenizer.encode(sample.prompt, add_special_tokens=False))

    async def _engine_is_dead(self, engine: Engine, err: EngineError) -> bool:
        """After an error without an HTTP answer: is the engine gone (probe fails) or was it this request?"""
        if engine.dead is not None:
            return True
        if err.status is not None:
            return False
        return not await self._healthy(engine)

    async def _healthy(self, engine: Engine) -> bool:
        """Whether ``engine`` answers ``/health_generate``; a probe already in flight is shared (the requests an
        engine had in flight fail together when it dies: one probe, not hundreds)."""
        loop = asyncio.get_running_loop()
        probe = engine.probe
        if probe is None or probe.done() or probe.get_loop() is not loop:
            async def probe_once() -> bool:
                try:
                    await engine.client.arequest("GET", "/health_generate", timeout=HEALTH_PROBE_TIMEOUT)
                    return True
                except EngineError:
                    return False
            probe = engine.probe = loop.create_task(probe_once())
        return await asyncio.shield(probe)

    async def _declare_dead(self, engine: Engine, err: EngineError, batch: BatchCounters) -> None:
        if await self.pool.mark_dead(engine, err.cause):
            batch.engine_failures.append(self._dead(engine, err))

    def declare_dead_threadsafe(self, engine: Engine, err: EngineError) -> None:
        """:meth:`_declare_dead` from another thread (the EngineRouter's); the next batch to end reports it."""
        if self.pool.mark_dead_threadsafe(engine, err.cause):
            self._unbatched.append(self._dead(engine, err))

    def _dead(self, engine: Engine, err: EngineError) -> EngineFailure:
        """Record, log and report (``on_engine_dead``) an engine just marked dead."""
        fail = EngineFailure(name=engine.name, url=engine.client.url, error=str(err), time=time.time())
        self.engine_failures.append(fail)
        alive = self.live_engines
        log.error("rollout engine %s is dead (%s); its requests go to the %d engine(s) left: %s",
                  engine.name, err.cause, len(alive), ", ".join(alive) or "none")
        if self.on_engine_dead is not None:
            self.on_engine_dead(engine.name, err.cause)
        return fail

    async def generate_sample(self, sample: Sample, sp: SamplingParams, *, evaluation: bool = False,
                              batch: BatchCounters | None = None, seed: int | None = None,
                              stop: asyncio.Event | None = None, spent: float = 0.0) -> Sample:
        """Generate ``sample``'s response (retrying as the module docstring says); fills the sample in place.
        ``seed`` becomes the request's ``sampling_seed`` (the same on a retry, so a retry samples alike).

        Partial rollout (:mod:`relax_hpc.rollout.dynamic`): with ``stop``, the request carries a ``rid`` that
        :meth:`abort_inflight` can abort; once ``stop`` is set, an aborted request keeps the tokens it had
        (status ABORTED, ``abort_count`` + 1) instead of being retried, and a request not yet sent is not sent.
        A sample that already has a partial response continues it: the engine gets prompt + partial response
        and the tokens left of ``max_new_tokens``."""
        batch = batch if batch is not None else BatchCounters()
        if sample.status is SampleStatus.FAILED:  # failed before generation (its images: rollout/data.py)
            return sample
        if seed is not None:
            sp = dataclasses.replace(sp, sampling_seed=seed)
        resumed = sample.response_length > 0
        if resumed:
            prompt_ids = list(sample.tokens)
            left = (sp.max_new_tokens or 0) - sample.response_length
            if sp.max_new_tokens is not None and left <= 0:  # cut at the very end: nothing left to generate
                sample.status = SampleStatus.TRUNCATED
                return sample
            sp = dataclasses.replace(sp, max_new_tokens=left if sp.max_new_tokens is not None else None)
        else:
            prompt_ids = self.prompt_ids(sample)
        gen = await self.request(prompt_ids, sp, evaluation=evaluation, batch=batch, stop=stop, spent=spent,
                                 who=f"sample index={sample.index} group_index={sample.group_index}",
                                 image_data=(sample.multimodal_inputs or {}).get("images") or None,
                                 audio_data=(sample.multimodal_inputs or {}).get("audios") or None,
                                 video_data=(sample.multimodal_inputs or {}).get("videos") or None)
        if gen is None:  # the step ended before it was sent
            sample.status = SampleStatus.ABORTED if resumed else SampleStatus.PENDING
            return sample
        self._fill(sample, prompt_ids, gen, resumed=resumed)
        if gen.aborted and stop is not None and stop.is_set():  # aborted by abort_inflight: keep the tokens
            sample.status = SampleStatus.ABORTED
            sample.abort_count += 1
        return sample

    async def request(self, prompt_ids: list[int], sp: SamplingParams, *, evaluation: bool = False,
                      batch: BatchCounters | None = None, stop: asyncio.Event | None = None,
                      who: str = "a request", image_data: list | None = None, spent: float = 0.0,
                      audio_data: list | None = None, video_data: list | None = None) -> Generation | None:
        """One ``/generate`` on the least-loaded live engine, with the driver's handling (module docstring):
        dead engines left out, 5xx and aborts retried up to ``max_retries``, a 4xx a :class:`RolloutError` naming
        ``who``. With ``stop`` (partial rollout): None if ``stop`` is set before it is sent, and an abort after
        ``stop`` returns the partial generation instead of a retry. The multi-turn loop calls this per turn.
        ``spent``: seconds of the deadline already used for this sample (its group's request, which failed)."""
        batch = batch if batch is not None else BatchCounters()
        attempts = 0
        avoid: set[str] = set()
        budget = self.request_timeout_s  # the request's total deadline: time at engines (module docstring)
        last = "none"
        while True:
            if stop is not None and stop.is_set():
                return None
            if spent >= budget:
                raise _timeout(who, budget, last)
            engine = await self.pool.acquire(avoid)
            rid = f"relax-{id(prompt_ids):x}-{attempts}" if stop is not None else None
            t0 = time.monotonic()
            try:
                if rid is not None:
                    if stop.is_set():
                        continue
                    self._inflight[rid] = engine
                left = budget - spent
                # with another live engine, an attempt gets half of what is left (down to MIN_ATTEMPT_S): a hung
                # engine is given up in time for the request to finish elsewhere; with none, all of it
                cap = left / 2 if len(self.pool.alive()) > 1 and left >= 2 * MIN_ATTEMPT_S else left
                gen = await engine.client.agenerate(prompt_ids, sp, return_logprob=not evaluation, rid=rid,
                                                    vocab_size=self.vocab_size, routing=self.routing, timeout=cap,
                                                    extra={**(self._replay(evaluation) or {}), **(
                                                        {"audio_data": audio_data} if audio_data else {}), **(
                                                        {"video_data": video_data} if video_data else {})} or None,
                                                    **({"image_data": image_data} if image_data else {}))
            except EngineError as err:
                last = f"engine {engine.name}: {err.cause}"
                took = time.monotonic() - t0
                if spent + took >= budget and (err.status is None or err.status >= 500) \
                        and not isinstance(err, EngineOutputError):
                    raise _timeout(who, budget, last) from err  # nothing left to retry with: no probe either
                if err.status is None and took >= 0.95 * cap and not isinstance(err, EngineOutputError):
                    # its share of the deadline ran out: slow or hung, not known dead (a probe could answer 503
                    # while SGLang is paused for a weight sync), so the request goes elsewhere, the engine stays
                    log.warning("generate of %s on engine %s got no answer in %.0f s; sent to another engine", who,
                                engine.name, took)
                    avoid = {engine.name}
                    batch.retries += 1
                    continue
                # output that cannot be right: the engine is broken (whatever its health check says)
                if isinstance(err, EngineOutputError) or await self._engine_is_dead(engine, err):
                    await self._declare_dead(engine, err, batch)
                    batch.retries += 1
                    continue
                if err.status is not None and 400 <= err.status < 500 and err.status not in (408, 429):
                    raise RolloutError(f"engine {engine.name} refused the request of {who} ({len(prompt_ids)} "
                                       f"prompt tokens): {err.cause}") from err
                attempts += 1
                if attempts > self.max_retries:
                    raise RolloutError(f"{who}: generation failed {attempts} times, last on engine {engine.name}: "
                                       f"{err.cause} (rollout.max_retries = {self.max_retries})") from err
                log.warning("generate failed on engine %s (%s); retry %d/%d", engine.name, err.cause, attempts,
                            self.max_retries)
                avoid = {engine.name}
                batch.retries += 1
                continue
            finally:
                spent += time.monotonic() - t0
                self._inflight.pop(rid, None)
                await self.pool.release(engine)
            if gen.aborted and stop is not None and stop.is_set():
                return gen
            if gen.aborted and attempts < self.max_retries:
                attempts += 1
                batch.retries += 1
                last = f"engine {engine.name} aborted it"
                log.warning("engine %s aborted %s (%s); retry %d/%d", engine.name, who, gen.finish_reason.message,
                            attempts, self.max_retries)
                continue
            return gen

    # --- custom generate functions (Relax's --custom-generate-function-path) ---------------------------------
    def generate_function(self, sample: Sample) -> tuple[str, Callable] | None:
        """The custom generate function for ``sample``: its own ``generate_function_path``, else
        ``rollout.custom_generate_function_path``; None for the built-in path."""
        path = sample.generate_function_path or self.cfg.custom_generate_function_path
        if not path:
            return None
        if path not in self._generate_fns:
            from relax_hpc.plugins import load_plugin

            key = "sample.generate_function_path" if sample.generate_function_path else "rollout.custom_generate_function_path"
            self._generate_fns[path] = load_plugin(path, key, params=GENERATE_PARAMS)
        return path, self._generate_fns[path]

    async def _generate_one(self, sample: Sample, sp: SamplingParams, evaluation: bool, batch: BatchCounters,
                            seed: int | None, spent: float = 0.0) -> Sample | list[Sample]:
        if sample.status is SampleStatus.FAILED:  # failed before generation (its images: rollout/data.py)
            return sample
        custom = self.generate_function(sample)
        if custom is None and self.multiturn is not None:
            return await generate_multiturn(_TurnSession(self, evaluation, batch), self.multiturn, sample, sp,
                                            seed=seed)
        if custom is None:
            return await self.generate_sample(sample, sp, evaluation=evaluation, batch=batch, seed=seed, spent=spent)
        path, fn = custom
        args = self.reward.args
        if self.router is None:  # where a Relax function finds "SGLang's router": this driver's engines
            from relax_hpc.engines.router import EngineRouter

            self.router = EngineRouter(self)
        args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", self.router.port
        params = (dataclasses.replace(sp, sampling_seed=seed) if seed is not None else sp).to_json()
        kwargs = {"evaluation": evaluation} if _takes(fn, "evaluation") else {}
        refused = self.router.unauthorized
        try:
            out = fn(args, sample, params, **kwargs)
            if inspect.isawaitable(out):
                out = await out
        except Exception as e:  # the router answered 503 (every engine dead): say so, not the function's KeyError
            if not self.pool.alive():
                raise NoEngineError(f"no rollout engine left to generate with ({self.pool.dead_report()}); {path} "
                                    f"failed with {type(e).__name__}: {e}") from e
            if self.router.unauthorized > refused:  # most likely this function's: it sent no key
                raise RolloutError(f"{path} failed with {type(e).__name__}: {e}, after the router refused "
                                   f"{self.router.unauthorized - refused} request(s) without its key (HTTP 401). Fix: "
                                   "send it, `from relax_hpc.rollout.router import post` then "
                                   "`out = await post(url, payload)`, or headers=router_headers() with your own HTTP "
                                   "client (docs/agentic.md)") from e
            raise
        if isinstance(out, list):  # segments of one rollout: one group, one rollout_id, each trained as a sample
            if not out or not all(isinstance(x, Sample) for x in out):
                what = "an empty list" if not out else f"a list holding {sorted({type(x).__name__ for x in out})}"
                raise RolloutError(f"{path} returned {what} for sample index={sample.index}: a custom generate "
                                   "function returns the Sample it was given, or a non-empty list of Samples "
                                   "(the segments of this rollout)")
            for seg in out:
                seg.group_index, seg.rollout_id = sample.group_index, sample.index
        elif not isinstance(out, Sample):
            raise RolloutError(f"{path} returned {type(out).__name__} for sample index={sample.index}: a custom "
                               "generate function returns the Sample it was given, filled in")
        for seg in out if isinstance(out, list) else [out]:
            check_generated(seg, path)
            if seg.status is SampleStatus.PENDING:
                seg.status = SampleStatus.COMPLETED
        return out

    async def abort_inflight(self) -> int:
        """Abort every request sent with a ``stop`` event (partial rollout); returns how many were asked."""
        rids = list(self._inflight.items())
        for rid, engine in rids:
            try:
                await engine.client.aabort_request(rid)
            except EngineError as e:  # the request finishes anyway (or its engine is dead: handled there)
                log.warning("abort of %s on engine %s failed: %s", rid, engine.name, e.cause)
        return len(rids)

    def _replay(self, evaluation: bool) -> dict | None:
        """The fields every request adds: MoE routing replay (``train.routing_replay``) asks the engine for each
        token's experts (samples keep them); ``train.lora.mode: adapter`` names the adapter (SGLang's ``lora_path``)."""
        from relax_hpc.engines.lora import generate_fields  # train.lora.mode adapter: the adapter's name (SGLang)

        train = getattr(self.recipe, "train", None)
        out = {"return_routed_experts": True} if getattr(train, "routing_replay", False) and not evaluation else {}
        return {**out, **generate_fields(self.recipe)} or None

    def response_text(self, gen: Generation) -> str:
        """The engine's text of ``gen``, or its ids decoded (``rollout.skip_special_tokens``) when it sent none."""
        if gen.text is None and self.tokenizer is not None:
            return self.tokenizer.decode(gen.output_ids, skip_special_tokens=self.cfg.skip_special_tokens)
        return gen.text or ""

    def _fill(self, sample: Sample, prompt_ids: list[int], gen: Generation, *, resumed: bool = False) -> None:
        if not resumed:  # a retry starts over; a partial sample (partial rollout) grows
            sample.reset_response(prompt_ids)
        sample.append_response(gen.output_ids, self.response_text(gen), gen.output_logprobs,
                               loss_mask_value=0 if sample.remove_sample else 1)
        sample.update_from_meta_info(gen.meta_info)
        if sample.status is SampleStatus.PENDING:  # no/unknown finish reason: the engine finished the request
            sample.status = SampleStatus.COMPLETED

    # --- a batch -------------------------------------------------------------------------------------
    async def _group(self, group: list[Sample], sp: SamplingParams, evaluation: bool, batch: BatchCounters,
                     seeds: list[int | None]) -> list[RewardFailure]:
        done, spent = await self._group_request(group, sp, evaluation, seeds, batch)
        if done:
            outs: list[Sample | list[Sample]] = list(group)
        else:  # one by one, within what is left of each sample's deadline
            outs = await asyncio.gather(*(self._generate_one(s, sp, evaluation, batch, seed, spent)
                                          for s, seed in zip(group, seeds)))
        group[:] = [x for out in outs for x in (out if isinstance(out, list) else [out])]  # segments in place
        self._progressed(len(group))
        failures = await self.reward.score_group(group, evaluation=evaluation, apply_policy=False)
        self._progressed(1)
        return failures

    async def _group_request(self, group: list[Sample], sp: SamplingParams, evaluation: bool,
                             seeds: list[int | None], batch: BatchCounters) -> tuple[bool, float]:
        """The whole group as one ``/generate`` (``rollout.batch_group_requests``): each sample keeps its own
        ``sampling_seed``, so it samples what its own request would have. Only for plain single-turn samples (no
        custom generate function, no multi-turn, no images, none failed or partly generated). True when every
        sample is filled, and the seconds the attempt took (which count against each sample's
        ``rollout.request_timeout_s``); on any engine error nothing is filled and the group goes the per-sample way,
        whose retries, deadlines and dead-engine handling then apply. One group request is one of an engine's
        ``rollout.sglang_server_concurrency`` requests in flight. Output that cannot be right declares the engine dead
        here, as one request's would: its other answers are not trusted either."""
        if not self.cfg.batch_group_requests or len(group) < 2 or self.multiturn is not None or any(
                s.status is not SampleStatus.PENDING or s.response_length > 0 or s.multimodal_inputs
                or self.generate_function(s) is not None for s in group):
            return False, 0.0
        prompts = [self.prompt_ids(s) for s in group]
        sps = [sp if seed is None else dataclasses.replace(sp, sampling_seed=seed) for seed in seeds]
        engine = await self.pool.acquire(set())
        cap = self.request_timeout_s / 2 if len(self.pool.alive()) > 1 else self.request_timeout_s
        t0 = time.monotonic()
        try:
            gens = await engine.client.agenerate_group(prompts, sps, return_logprob=not evaluation, timeout=cap,
                                                       vocab_size=self.vocab_size, routing=self.routing,
                                                       extra=self._replay(evaluation))
        except EngineError as err:
            log.warning("group request of %d samples (group_index=%s) failed on engine %s (%s); sending them one by "
                        "one", len(group), group[0].group_index, engine.name, err.cause)
            bad = err
        else:
            bad = None
        finally:
            await self.pool.release(engine)
        took = time.monotonic() - t0
        if bad is not None:
            if isinstance(bad, EngineOutputError):
                await self._declare_dead(engine, bad, batch)
                batch.retries += 1
            return False, took
        if any(g.aborted for g in gens):  # paused or aborted mid-way: the per-sample path retries each
            return False, took
        for s, p, g in zip(group, prompts, gens):
            self._fill(s, p, g)
        return True, took

    def _progressed(self, n: int) -> None:
        if self.on_progress is not None:
            self.on_progress(n)

    async def generate_rollout(self, groups: Iterable[list[Sample]], *, evaluation: bool = False,
                               seed: int | None = None,
                               on_group: Callable[[int, list[Sample], list[RewardFailure]], None] | None = None
                               ) -> RolloutResult:
        """Generate and score one batch of groups (rewards stay raw); see the module docstring.

        With ``seed``, the k-th sample of the batch is requested with ``sampling_seed`` derived from
        (seed, k): its tokens then depend on the weights and the prompt only, not on which engine serves it
        or in which order, so a run resumed from a checkpoint samples what the uninterrupted run sampled.

        ``on_group(i, group, failures)`` is called in the event loop as soon as group ``i`` is generated and scored
        (rewards raw, the reward policy not yet applied): streaming within a step (``rollout.stream_groups``).

        Raises :class:`NoEngineError` when every engine died, :class:`RolloutError` for a request that cannot
        be served, and :class:`~relax_hpc.rollout.rewards.RewardError` under ``reward_error_policy: fail``.
        """
        groups = [list(g) for g in groups]
        if not groups:
            raise ValueError("generate_rollout needs at least one group")
        sizes = {len(g) for g in groups}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"all groups must have the same, non-zero size (n_samples_per_prompt), got sizes {sorted(sizes)}")
        n = sizes.pop()
        batch = BatchCounters()
        sp = self.sampling_params(evaluation)
        t0 = time.monotonic()
        async def group(i: int, g: list[Sample]) -> list[RewardFailure]:
            failures = await self._group(g, sp, evaluation, batch,
                                         [None if seed is None else sample_seed(seed, i * n + j) for j in range(n)])
            if on_group is not None:
                on_group(i, g, failures)
            return failures

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(group(i, g)) for i, g in enumerate(groups)]
        except BaseExceptionGroup as eg:
            raise first_error(eg) from None
        rollout_time = time.monotonic() - t0
        while self._unbatched:  # engines the EngineRouter declared dead (custom generate functions)
            batch.engine_failures.append(self._unbatched.pop(0))
        samples = [s for g in groups for s in g]
        # tasks are in group order and each group's failures in sample order: the batch's, in sample order
        reward_failures = [f for t in tasks for f in t.result()]
        self.reward.apply_policy(reward_failures)  # once for the batch, not per group as each finishes
        key = self.reward.reward_key(evaluation)
        raw = [s.get_reward_value(reward_key=key) for s in samples]
        metrics = self.batch_metrics(samples, raw, n, rollout_time, evaluation=evaluation, retries=batch.retries)
        return RolloutResult(samples=samples, raw_rewards=raw, metrics=metrics, group_size=n,
                             reward_failures=reward_failures, engine_failures=batch.engine_failures,
                             retries=batch.retries)

    def generate_rollout_sync(self, groups: Iterable[list[Sample]], *, evaluation: bool = False,
                              seed: int | None = None,
                              on_group: Callable[[int, list[Sample], list[RewardFailure]], None] | None = None
                              ) -> RolloutResult:
        """:meth:`generate_rollout` from synchronous code (runs its own event loop)."""
        return asyncio.run(self.generate_rollout(groups, evaluation=evaluation, seed=seed, on_group=on_group))

    def batch_metrics(self, samples: list[Sample], raw: list[float], n: int, rollout_time: float, *,
                      evaluation: bool = False, retries: int = 0) -> dict[str, float]:
        """The ``rollout/*`` and ``perf/*`` metrics of a batch of groups of ``n`` (dynamic sampling calls it for
        the groups it kept, out of several batches)."""
        reps, per_rollout = rollout_view(samples, raw)  # group statistics count rollouts, not segments
        base = sample_metrics(reps, per_rollout, reward_key=self.reward.reward_key(evaluation), group_size=n,
                              log_passrate=self.cfg.log_passrate)
        out = {f"rollout/{k}": v for k, v in base.items()}
        if len(reps) != len(samples):
            out["rollout/segments_per_rollout"] = len(samples) / len(reps)
        out["rollout/response_lengths"] = statistics.fmean(s.response_length for s in samples)
        out["rollout/total_lengths"] = statistics.fmean(len(s.tokens) for s in samples)
        out["rollout/truncated"] = out["rollout/truncated_ratio"]
        out["rollout/engine_retries"] = float(retries)
        out["rollout/engines_dead"] = float(len(self.dead_engines))
        out.update(_multiturn_metrics(samples))
        out["perf/rollout_time"] = rollout_time
        tokens = sum(s.response_length for s in samples)
        out["perf/tokens_per_sec"] = tokens / rollout_time if rollout_time > 0 else 0.0
        return out


def _timeout(who: str, budget: float, last: str) -> RequestTimeout:
    return RequestTimeout(f"{who}: no answer within rollout.request_timeout_s = {budget:g} s (its total: every "
                          f"attempt and engine together; last: {last}). Raise rollout.request_timeout_s if the "
                          "engines are just slow")


def first_error(eg: BaseExceptionGroup) -> BaseException:
    """The error to raise from a failed batch: prefer a real error over the cancellations it caused."""
    flat: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            flat.append(e)

    walk(eg)
    for e in flat:
        if not isinstance(e, asyncio.CancelledError):
            return e
    return flat[0]


def _takes(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _multiturn_metrics(samples: list[Sample]) -> dict[str, float]:
    """``rollout/turns`` (mean), ``rollout/env_tokens_ratio`` (response tokens the env wrote, not the model),
    ``rollout/env_failures``, ``rollout/truncated_observations`` and ``rollout/truncated_by/{turns,context,response}`` (share of samples stopped by
    each limit), for samples of the multi-turn loop."""
    multi = [s for s in samples if "rollout_turns" in s.metadata]
    if not multi:
        return {}
    model = sum(len(t.get("output_ids", ())) for s in multi for t in s.metadata["rollout_traces"])
    total = sum(s.response_length for s in multi)
    why = [s.metadata.get("rollout_stop_reason") for s in multi]
    out = {"rollout/turns": statistics.fmean(s.metadata["rollout_turns"] for s in multi),
           "rollout/env_tokens_ratio": (total - model) / total if total else 0.0,
           "rollout/env_failures": float(why.count("env_error")),
           "rollout/truncated_turns": float(sum(bool(t.get("truncated")) for s in multi
                                                for t in s.metadata["rollout_traces"])),
           # observations that did not fit the context bound (cut, or ending their rollout)
           "rollout/truncated_observations": float(sum("obs_truncated" in t for s in multi
                                                       for t in s.metadata["rollout_traces"]))}
    out.update({f"rollout/truncated_by/{k}": why.count(k) / len(multi) for k in ("turns", "context", "response")})
    return out


def multiturn_from(recipe: Recipe, args: Any) -> Any:
    """The multi-turn settings (:class:`~relax_hpc.rollout.multiturn.MultiTurn`) when an environment is named:
    ``rollout.interaction_env_path``, else Relax's ``rollout_interaction_env_path`` from ``custom_config_path``;
    ``max_turns`` likewise."""
    ro = recipe.rollout
    path = ro.interaction_env_path or getattr(args, "rollout_interaction_env_path", None)
    if not path:
        return None
    from relax_hpc.plugins import load_plugin

    key = "rollout.interaction_env_path" if ro.interaction_env_path else "rollout_interaction_env_path (custom_config_path)"
    turns = ro.max_turns if ro.max_turns is not None else getattr(args, "max_turns", None)
    if not isinstance(turns, int) or turns < 1:
        raise ValueError(f"{key} = {path!r} needs max_turns, at least 1: set rollout.max_turns (or max_turns in "
                         f"the custom_config_path YAML, Relax's way); got {turns!r}")
    build_env = load_plugin(env_factory(path), key)
    return MultiTurn(build_env=build_env, args=args, max_turns=turns, max_context_len=ro.max_context_len or recipe.train.max_seq_len,
                     step_timeout_s=ro.env_step_timeout_s, chat=bool(recipe.data.apply_chat_template),
                     continue_truncated=ro.turn_truncation == "continue",
                     image_tokens=(recipe.data.image_min_token_num, recipe.data.image_max_token_num),
                     media=_data_media(recipe.data), max_image_pixels=recipe.data.max_image_pixels)


def _data_media(data: Any) -> Any:
    """The data's media rules (rollout/data.py's for a row): the data file's directory and data.media_roots."""
    from pathlib import Path

    from relax_hpc.media import MediaPolicy, data_roots

    base = Path(data.path).expanduser().resolve().parent if isinstance(data.path, str) else None
    return MediaPolicy(base_dir=base, roots=data_roots(data.media_roots), allow_urls=data.allow_media_urls)


def check_generated(s: Sample, path: str) -> None:
    """What the exchange and the loss need of a sample a custom generate function filled in, checked here, so
    a mistake names the function instead of failing in the actor (relax_hpc is stricter than Relax here)."""
    where = f"{path} returned sample index={s.index}"
    if not isinstance(s.tokens, list) or not all(isinstance(t, int) for t in s.tokens):
        raise RolloutError(f"{where} with tokens that are not a list of ints")
    if not 1 <= s.response_length < len(s.tokens):
        raise RolloutError(f"{where} with response_length = {s.response_length} for {len(s.tokens)} tokens: it must "
                           "be at least 1 and leave at least one prompt token (tokens = prompt + response ids)")
    for name in ("loss_mask", "rollout_log_probs"):
        v = getattr(s, name)
        if v is not None and len(v) != s.response_length:
            raise RolloutError(f"{where} with {len(v)} {name} values for a response of {s.response_length} tokens")


@dataclass
class _TurnSession:
    """The driver as a multi-turn rollout sees it (:class:`~relax_hpc.rollout.multiturn.EngineSession`): requests
    of one batch, on this driver's engines."""

    driver: RolloutDriver
    evaluation: bool
    batch: BatchCounters

    @property
    def tokenizer(self) -> Any:
        return self.driver.tokenizer

    @property
    def fail_on_env_error(self) -> bool:
        return self.driver.cfg.reward_error_policy == "fail"

    def prompt_ids(self, sample: Sample) -> list[int]:
        return self.driver.prompt_ids(sample)

    async def request(self, ids: list[int], sp: SamplingParams, *, who: str,
                      image_data: list | None = None) -> Generation:
        return await self.driver.request(ids, sp, evaluation=self.evaluation, batch=self.batch, who=who,
                                         image_data=image_data)

    def response_text(self, gen: Generation) -> str:
        return self.driver.response_text(gen)
