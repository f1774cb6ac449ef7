"""The rollout role's work, one rollout step at a time: :class:`Generator` holds the data, the eval sets, the
tokenizer, the reward and the engine client, and turns a step's prompts into written chunks.

A step (:meth:`Generator.generate`) starts from the rollout state after the step before
(:class:`~relax_hpc.rollout.state.DataState`: the data cursor and partial rollout's buffer, always together; a step
generated again, e.g. after a damaged chunk, gets the same prompts), generates and scores the next
``rollout_batch_size`` prompt groups (:func:`~relax_hpc.rollout.dynamic.generate_step`, dynamic sampling and partial
rollout included), lets the OPD teacher score them (:mod:`relax_hpc.rollout.teacher`), fills MoE routing replay's
rows (:func:`routed_rows`), and writes them as one chunk, or, streaming within a step, as chunks of
``rollout.stream_groups`` groups announced as they are done (:class:`Streamer`). After the step it saves the
buffer and deletes the saved buffers nothing can name any more.

The generator imports neither ``train`` nor ``controller`` (docs/architecture.md): what it hands its results to, the
chunk writer, the ``chunk_ready`` announcement and the list of complete checkpoints, comes in as :class:`Outlets`
from the role (:mod:`relax_hpc.roles.rollout`), which also turns the tasks into calls and the results into replies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from relax_hpc.rollout.state import BufferRef, DataState, buffer_files

if TYPE_CHECKING:
    from relax_hpc.rundir import RunDir

log = logging.getLogger("relax_hpc.rollout")
MAX_PROMPT_ATTRS = 32 << 10  # bytes of JSON naming a chunk's prompt groups (a chunk's attrs hold at most 64 KiB)


@dataclass(frozen=True)
class Outlets:
    """Where the generator's results go, given by the role: ``write_step(run_path, step, result, *, seq, attrs,
    model_dir)`` writes scored samples as one chunk and returns its ref (:func:`relax_hpc.rollout.write.write_step`);
    ``announce(task_id, ref)`` tells the controller a streamed chunk is ready (``chunk_ready``); ``complete(root)``
    lists the complete checkpoints under ``root``, oldest first (:func:`relax_hpc.train.latest.complete`)."""

    write_step: Callable[..., Any]
    announce: Callable[[int, Any], None]
    complete: Callable[[Path], list[Path]]


@dataclass
class Generated:
    """One generated step: its chunks, metrics, samples, the weight versions they carry, the rollout state after
    it, reward failures (the first ones, shortened), engine failures and deaths, and the requests sent per engine."""

    chunks: list
    metrics: dict[str, Any]
    n: int
    weight_versions: list[str]
    state: DataState
    reward_failures: list[dict] = field(default_factory=list)
    engine_failures: list[dict] = field(default_factory=list)
    dead_engines: dict[str, str] = field(default_factory=dict)
    engine_requests: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Made:
    """Partial rollout: a step generated here, kept while the controller may generate it again: the state it started
    from, the state after it, and the prompt groups it trained."""

    start: DataState
    after: DataState
    groups: list[int]


class Generator:
    """The driver's state: data, eval sets, tokenizer, reward, engine client; one :meth:`generate` per rollout step,
    one :meth:`evaluate` per scheduled eval. ``resolve`` makes a recipe path absolute (relative: to the directory
    the run was submitted from); ``progress`` is told as the work moves on (the role's heartbeats)."""

    def __init__(self, recipe: Any, run: RunDir, outlets: Outlets, *, resolve: Callable[[str], str],
                 progress: Callable[..., None]):
        from relax_hpc.engines.pool import ExternalEngines, NamesFile
        from relax_hpc.plugins import load_plugin
        from relax_hpc.rollout.data import (data_source_from_config, dataset_from_config, eval_datasets_from_config,
                                            load_tokenizer, prompt_room)
        from relax_hpc.rollout.driver import RolloutDriver
        from relax_hpc.rollout.dynamic import PartialRollout

        r = recipe
        self.recipe, self.run, self.outlets, self.resolve = r, run, outlets, resolve
        self.tokenizer = load_tokenizer(resolve(r.model.path))
        if r.data.path is None:
            raise ValueError("data.path is not set: the rollout role needs prompts (a JSONL or Parquet file)")
        dataset = dataset_from_config(r.data, r.rollout, tokenizer=self.tokenizer, path=resolve(r.data.path))
        self.data = data_source_from_config(dataset, r.data, r.rollout, run_seed=r.run.seed)
        # the eval sets, loaded once (only when an eval is scheduled: the controller sends none otherwise)
        self.eval_sets: dict[str, Any] = {}
        if r.rollout.eval_interval is not None:
            eval_data = dataclasses.replace(r.data, eval_prompt_data={name: resolve(path) for name, path
                                                                      in r.data.eval_prompt_data.items()})
            self.eval_sets = eval_datasets_from_config(eval_data, r.rollout, tokenizer=self.tokenizer)
            log.info("eval sets: %s", ", ".join(f"{n} ({len(ds)} prompts)" for n, ds in self.eval_sets.items()))
        # loads the reward function (fails early); its engine clients send the run's API key
        self.driver = RolloutDriver(r, {}, tokenizer=self.tokenizer, api_key=run.api_key())
        # a row whose images make its prompt too long for train.max_seq_len fails its sample (rollout/data.py)
        dataset.prompt_room = prompt_room(r.rollout, r.train.max_seq_len, self.driver.multiturn is not None)
        self.driver.on_progress = progress
        self.driver.leaving = NamesFile(run.draining)  # engines the controller drains: no new requests
        # engines the run does not own: each its own key, every answer's weight version checked (engines/pool.py)
        self.driver.client_kwargs["externals"] = ExternalEngines(run.path / "external_engines.json")
        ro = r.rollout  # DAPO dynamic sampling and the per-step sample filter (relax_hpc.rollout.dynamic)
        self.group_filter = (load_plugin(ro.dynamic_sampling_filter_path, "rollout.dynamic_sampling_filter_path")
                             if ro.dynamic_sampling_filter_path else None)
        self.sample_filter = (load_plugin(ro.sample_filter_path, "rollout.sample_filter_path")
                              if ro.sample_filter_path else None)
        # partial rollout's buffer: rollout state like the data cursor, saved with it after every step (state())
        self.partial = (PartialRollout(mask_offpolicy=ro.mask_offpolicy_in_partial_rollout,
                                       max_aborted=ro.partial_rollout_max_aborted_count) if ro.partial_rollout else None)
        self.current: DataState | None = None  # the state this role's cursor and buffer are at (None: not saved)
        self.made: dict[int, Made] = {}  # partial rollout: the steps generated here
        self.engines: dict[str, str] = {}
        self.teacher: tuple[list[str], Any] | None = None  # OPD: (teacher URLs, their TeacherClient)
        self.routed_width: int | None = None  # routing replay: expert ids a token (layers × top_k), once seen

    def close(self) -> None:
        if self.teacher is not None:  # OPD's teacher client: its connections
            self.teacher[1].close()

    # -- rollout state: the data cursor and partial rollout's buffer, always together
    def state(self, step: int) -> DataState:
        """The state after step ``step``: the cursor, and with partial rollout the reference of the buffer, written
        to ``RUN_DIR/partial_rollout/`` now (:meth:`~relax_hpc.rollout.dynamic.PartialRollout.save`)."""
        ref = None
        if self.partial is not None:
            ref = BufferRef.from_dict(self.partial.save(self.run.path, step))
            self._forget_buffers(step)
        self.current = DataState.of(self.data.state_dict(), ref)
        return self.current

    def restore(self, state: DataState) -> None:
        """Cursor and buffer as ``state`` has them (the task's state wins over this role's memory): a step
        generated again, the first step of a restarted role or of a resumed run start where ``state`` says."""
        if state == self.current:  # where this role stands already (the usual case: the step after its last)
            return
        self.data.load_state_dict(state.cursor())
        ref = state.partial
        if self.partial is not None:
            self.partial.load(self.run.path, ref.to_dict() if ref is not None else None)
            if self.partial.buffer:
                log.info("data cursor at epoch %s, offset %s; partial rollout's buffer restored from %s: %d prompt "
                         "groups, %d samples", state.epoch, state.offset, ref.file, ref.groups, ref.samples)
        elif ref is not None and ref.groups:
            log.warning("rollout.partial_rollout is off: the %d prompt groups of the buffer saved with the data "
                        "cursor (%s) are dropped, never trained", ref.groups, ref.file)
        self.current = state

    def _forget_buffers(self, step: int) -> None:
        """Delete the saved buffers nothing can name any more. Kept: those a checkpoint names, and those of steps
        the controller may still generate from: the staleness gate let ``step`` start with every step below
        ``step - max_staleness`` cleared, and a cleared step is never generated again, so no cursor older than
        ``step - 1 - max_staleness`` is sent again; one step more is kept, as a margin. Nothing is deleted while a
        checkpoint is being written or one cannot be read here (its directory is named by optimizer steps, not
        rollout steps: which buffer it names is known only once its meta.json is)."""
        from relax_hpc.rollout.dynamic import PartialRollout

        root = self.run.path / PartialRollout.DIR
        ckpts = self.run.path / "checkpoints"
        done = self.outlets.complete(ckpts)
        if any(d not in done for d in ckpts.glob("step_*")):  # a checkpoint being written (or left half-written)
            return
        named: set[str] = set()
        for d in done:
            try:
                extra = json.loads((d / "meta.json").read_text()).get("extra_state")
            except (OSError, ValueError):
                extra = None
            if not isinstance(extra, dict):  # unreadable here (or pickled): keep everything
                return
            named |= set(buffer_files(extra))
        keep_from = step - 2 - self.recipe.max_staleness
        for f in root.glob("after_*.json"):
            n = PartialRollout.file_step(f.name)
            if n is not None and n < keep_from and f"{PartialRollout.DIR}/{f.name}" not in named:
                f.unlink(missing_ok=True)
        for old in [n for n in self.made if n < keep_from]:
            del self.made[old]

    def _use(self, engines: dict[str, str] | None) -> None:
        """The engines a task names (the controller's registry wins: engines dead, restarted under a new URL, or
        not yet synced are left out); a task that names none keeps the last ones."""
        live = dict(engines or self.engines)
        mine = {e.name: e.client.url for e in self.driver.pool.alive()}
        if live != mine:
            self.driver.set_engines(live)
        self.engines = live

    def write(self, step: int, result: Any, seq: int) -> Any:
        """Scored samples as one chunk of step ``step`` named by ``seq``, its attrs naming its prompt groups."""
        return self.outlets.write_step(self.run.path, step, result, seq=seq, attrs=self._prompt_attrs(result.samples),
                                       model_dir=str(self.tokenizer.name_or_path))  # a VLM: its image processor

    def generate(self, step: int, *, seq: int, engines: dict[str, str] | None, start: DataState | None,
                 judges: dict[str, str] | None = None, teachers: dict[str, str] | None = None,
                 streamed: list[int] | None = None, task_id: int = 0) -> Generated:
        """Step ``step`` on ``engines`` from ``start`` (the state after step−1; None: where this role stands),
        written as chunks named from ``seq``. ``streamed``: the places an earlier attempt of task ``task_id``
        announced already (streaming within a step)."""
        self._judges(judges)
        self._use(engines)
        if start is not None:  # the cursor (and buffer) after step-1: a step generated again gets the same prompts
            self.restore(start)
        before, self.current = self.current, None  # until the step's state is saved (a failed step left it moved)
        again = self.made.get(step) if self.partial is not None else None
        if again is not None and again.start != before:
            again = None
        sent = {n: st["requests"] for n, st in self.driver.engine_stats().items()}
        pool = self.driver.pool
        q0, live0 = pool.queue_clock(), len(pool.alive())
        t0 = time.monotonic()
        stream = (Streamer(self, step=step, seq=seq, task_id=task_id, streamed=streamed)
                  if self.recipe.rollout.stream_groups and again is None else None)
        try:
            result = self._samples(step, again, stream)
        finally:
            if stream is not None:
                stream.close()
        t_gen = time.monotonic() - t0
        taught = self._teach(step, result.samples, teachers or {})  # OPD: before the chunk is written
        if self.recipe.train.routing_replay:  # MoE routing replay: -1 rows where no engine ran a token
            self.routed_width = routed_rows(result.samples, self.routed_width or self._moe_width())
        q1 = pool.queue_clock()
        t1 = time.monotonic()
        if stream is None:
            refs = [self.write(step, result, seq)]
        else:  # the chunks streamed (announced already), then the groups left, as the step's last chunk
            refs = stream.finish(result)
        if again is not None:  # the steps after it went on from the buffer it left then: so does this role
            self.restore(again.after)
            after = again.after
        else:
            after = self.state(step)
            if self.partial is not None and before is not None:
                self.made[step] = Made(start=before, after=after,
                                       groups=sorted({s.group_index for s in result.samples}))
        metrics = dict(result.metrics)
        # requests waiting for a free engine (every engine at sglang_server_concurrency), on average over the
        # generate, per engine live at its start: the autoscaler's queue signal. (Requests a custom generate
        # function sends through the EngineRouter do not wait in this pool and are not counted.)
        metrics["rollout/queue_per_engine"] = (q1[0] - q0[0]) / max(q1[1] - q0[1], 1e-9) / max(1, live0)
        metrics["perf/exchange_write_time"] = time.monotonic() - t1
        metrics["perf/rollout_time"] = metrics.get("perf/rollout_time", t_gen)
        metrics.update(self.data.metrics())  # rows reading data.path dropped: too long, blank
        metrics.update(taught)  # opd/*: this step's teacher calls
        if judges:
            from relax_hpc.rollout import genrm

            metrics.update(genrm.take_metrics())  # this step's judge calls
        return Generated(
            chunks=refs,
            metrics=metrics,
            n=len(result.samples),
            weight_versions=sorted({str(s.weight_version) for s in result.samples}),
            state=after,
            reward_failures=[short_failure(f) for f in result.reward_failures[:20]],
            engine_failures=[{"name": f.name, "url": f.url, "error": f.error} for f in result.engine_failures],
            dead_engines=self.driver.dead_engines,
            engine_requests={n: st["requests"] - sent.get(n, 0) for n, st in self.driver.engine_stats().items()
                             if st["requests"] > sent.get(n, 0)},
        )

    def _samples(self, step: int, again: Made | None, stream: Streamer | None = None) -> Any:
        """Step ``step``'s scored samples: anew, or (``again``: its chunk was damaged) the same groups, finished.
        ``stream``: streaming within the step (no group or sample filter, no partial rollout: validated)."""
        from relax_hpc.rollout.dynamic import generate_step
        from relax_hpc.rollout.rewards import RewardError

        ro = self.recipe.rollout
        seed = self.recipe.run.seed * 1_000_003 + step  # a resumed run samples what the uninterrupted one would have
        try:
            if again is not None:  # generated here before (its chunk was damaged): the same groups, finished
                return self._again(step, again, seed)
            elif stream is not None:
                return self.driver.generate_rollout_sync(self.data.get_samples(ro.rollout_batch_size), seed=seed,
                                                         on_group=stream.on_group)
            else:
                return generate_step(self.driver, self.data, target=ro.rollout_batch_size, seed=seed,
                                     group_filter=self.group_filter, args=self.driver.reward.args,
                                     over_sampling=ro.over_sampling_batch_size,
                                     max_rounds=ro.dynamic_sampling_max_rounds, sample_filter=self.sample_filter,
                                     partial=self.partial)
        except RewardError as e:  # the full report (tracebacks too) goes to this log; the run's reason gets
            log.error("step %d: %s", step, e)  # the samples and the errors, without the tracebacks
            e.report = f"{type(e).__name__}: {str(e).split(chr(10) + 'Traceback of the first failure:')[0]}"
            raise

    def _again(self, step: int, made: Made, seed: int) -> Any:
        """Step ``step`` generated again from the state it was first generated from (its chunk was damaged),
        with partial rollout: the groups it trained then, no other, each finished (none aborted). Which groups
        finish first depends on timing, so generating it afresh could train prompts the steps after it took
        from its buffer, and leave others untrained; this keeps every later step's cursor and buffer valid."""
        from relax_hpc.rollout.dynamic import PartialRollout, generate_step

        want = set(made.groups)
        drawn = made.after.sample_group_index - made.start.sample_group_index
        groups = [g for g in self.partial.buffer + self.data.get_samples(drawn) if g[0].group_index in want]
        log.info("step %d: generated again (damaged chunk): its %d prompt groups, finished", step, len(groups))
        redo = PartialRollout(buffer=groups, mask_offpolicy=self.partial.mask_offpolicy)
        # one round, from these groups only: a group that cannot finish fails the step (DynamicSamplingError)
        # rather than drawing prompts past the cursor, which the steps after it drew and trained already
        result = generate_step(self.driver, NoMorePrompts(), target=len(groups), seed=seed, group_filter=None,
                               args=self.driver.reward.args, over_sampling=len(groups), max_rounds=1,
                               sample_filter=self.sample_filter, partial=redo)
        result.metrics["rollout/partial_buffer_groups"] = float(made.after.partial.groups)
        return result

    def _moe_width(self) -> int | None:
        """Routing replay's expert ids a token as the model's config.json says (num_hidden_layers ×
        num_experts_per_tok, SGLang's [layers, top_k]): for a step in which no sample reached an engine."""
        try:
            cfg = json.loads((Path(str(self.tokenizer.name_or_path)) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(cfg, dict):
            return None
        cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg  # a VLM's text model
        layers, k = cfg.get("num_hidden_layers"), cfg.get("num_experts_per_tok")
        return layers * k if isinstance(layers, int) and isinstance(k, int) and layers > 0 and k > 0 else None

    def _prompt_attrs(self, samples: list) -> dict:
        """The chunk attrs naming its prompt groups, unless they would not fit the chunk's attrs (then the audit
        cannot count this step's prompts, and says so)."""
        from relax_hpc.exchange.audit import prompt_attrs

        attrs = prompt_attrs((s.group_index for s in samples), len(self.data))
        if len(json.dumps(attrs)) > MAX_PROMPT_ATTRS:
            log.warning("the prompt groups of this step take more than %d bytes of chunk attrs: not recorded; "
                        "relax-status --audit cannot count its prompts", MAX_PROMPT_ATTRS)
            return {}
        return attrs

    def _teach(self, step: int, samples: list, teachers: dict[str, str]) -> dict[str, float]:
        """OPD: the teacher's log-prob of every response token onto each sample (``teacher_log_probs``), and the
        client's ``opd/*`` metrics of the step; nothing without ``opd:``. Raises the teacher's error when it gave
        no answer (:class:`~relax_hpc.rollout.teacher.TeacherError`) or no good numbers for a sample
        (:class:`~relax_hpc.rollout.teacher.TeacherBadValues`, permanent)."""
        opd = self.recipe.opd
        if opd is None or not opd.enabled:
            return {}
        from relax_hpc.rollout.teacher import TeacherBadValues, TeacherClient, TeacherClientConfig

        if not teachers:
            raise ValueError(f"step {step}: opd is on but the generate task names no teacher (the controller sends "
                             "roles.teacher's engines or opd.teacher_url). Fix: enable roles.teacher or set "
                             "opd.teacher_url")
        urls = sorted(set(teachers.values()))
        if self.teacher is None or self.teacher[0] != urls:
            if self.teacher is not None:
                self.teacher[1].close()
            own = "opd.teacher_url" not in teachers  # the run's own engines want its key; an outside server is not
            cfg = TeacherClientConfig(urls=urls, timeout_s=opd.teacher_timeout_s, top_k=opd.log_prob_top_k)
            self.teacher = (urls, TeacherClient(cfg, api_key=self.run.api_key() if own else None))
        client = self.teacher[1]
        scores = client.score(samples)
        bad = [(x, sc) for x, sc in zip(samples, scores) if not sc.ok]
        if bad:
            x, sc = bad[0]
            raise TeacherBadValues(f"step {step}: the OPD teacher gave {len(bad)} of {len(samples)} samples no usable "
                                   f"log-probs; the first, index {x.index}: {sc.error}. Fix: check the teacher "
                                   "engines (their logs), and that the teacher uses the student's tokenizer")
        for x, sc in zip(samples, scores):
            x.teacher_log_probs = sc.log_probs
        return client.take_metrics()

    def _judges(self, judges: dict[str, str] | None) -> None:
        """Point the GenRM client (reward functions' ``relax_hpc.rollout.genrm.generate``) at the run's judges."""
        if judges:
            from relax_hpc.rollout import genrm

            genrm.configure(judges, self.recipe.genrm, api_key=self.run.api_key(),
                            model_path=self.resolve(self.recipe.genrm.model_path))

    def evaluate(self, step: int, *, engines: dict[str, str] | None,
                 judges: dict[str, str] | None = None) -> dict[str, float]:
        """Every eval set on ``engines`` with their current weights: ``eval/*`` and ``perf/eval_time``."""
        from relax_hpc.rollout.eval import run_eval
        from relax_hpc.rollout.rewards import RewardError
        from relax_hpc.rollout.sample import sample_seed

        if not self.eval_sets:
            raise ValueError(f"step {step}: an eval task came, but there is no eval set (data.eval_prompt_data is "
                             f"empty or rollout.eval_interval is null)")
        # seeded by (run.seed, step), so a re-run eval (a resume) samples alike, from a seed of its own (the hash
        # of key -1, which no training sample has): no request seed in common with training; the data cursor is
        # untouched
        seed = sample_seed(self.recipe.run.seed * 1_000_003 + step, -1)
        self._judges(judges)
        self._use(engines)
        try:
            metrics, _ = asyncio.run(run_eval(self.driver, self.eval_sets, step=step, seed=seed))
        except RewardError as e:  # as in generate: the full report to this log, the short one to the run's reason
            log.error("step %d eval: %s", step, e)
            e.report = f"{type(e).__name__}: {str(e).split(chr(10) + 'Traceback of the first failure:')[0]}"
            raise
        if judges:  # the eval's judge calls, apart from the training steps'
            from relax_hpc.rollout import genrm

            metrics.update({f"eval/{k.replace('/', '_')}": v for k, v in genrm.take_metrics().items()})
        scores = ", ".join(f"{n} {metrics[f'eval/{n}']:.3f}" for n in self.eval_sets)
        log.info("step %d eval: %s (%.1f s)", step, scores, metrics.get("perf/eval_time", 0.0))
        return {k: float(v) for k, v in metrics.items()}  # NaN too: never hidden


class Streamer:
    """Streaming within a step (``rollout.stream_groups: G``): chunk k holds the step's groups kG..(k+1)G−1 (the
    groups past the last whole G: one last chunk at the step's end) and is named by its place, seq ``seq + k``.
    It is written and announced (``chunk_ready``) as soon as its own groups are generated and scored, whichever
    chunks are still waiting for a long response. A chunk's content and name are the same whatever the timing, so
    the forward roles' per-chunk passes, the actor's sample order (chunks by seq) and ``staleness_mode: fixed`` stay
    bit for bit; a generate given again (the role started again alone) skips the places ``streamed`` names,
    announced by the attempt before (seeded sampling: the same groups). The writes go on a thread of their own, off
    the event loop that drives the requests. ``gen`` gives the recipe, the driver, :meth:`Generator.write` and
    the outlets' ``announce``."""

    def __init__(self, gen: Generator, *, step: int, seq: int, task_id: int, streamed: list[int] | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.gen, self.step, self.seq, self.task_id = gen, step, seq, task_id
        self.size = gen.recipe.rollout.stream_groups
        self.total = gen.recipe.rollout.rollout_batch_size
        self.whole = self.total // self.size  # chunks of G groups; the groups after them go at the step's end
        self.done: dict[int, tuple[list, list]] = {}  # group position -> (its samples, its reward failures)
        self.skip = set(streamed or ())  # places an earlier attempt announced
        self.futures: list = []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="stream-writer")
        self.failed = False  # a reward failed under reward_error_policy fail: the step fails, nothing more streams

    def on_group(self, i: int, group: list, failures: list) -> None:
        self.done[i] = (list(group), list(failures))
        k = i // self.size
        span = range(k * self.size, (k + 1) * self.size)
        if self.failed or k >= self.whole or k in self.skip or not all(j in self.done for j in span):
            return
        if any(self.done[j][1] for j in span) and self.gen.recipe.rollout.reward_error_policy == "fail":
            self.failed = True  # the step's end raises the RewardError
            return
        self.futures.append((k, self.pool.submit(self._write, k, [self.done[j] for j in span])))

    def _samples_of(self, parts: list) -> tuple[list, list]:
        from relax_hpc.rollout.sample import SampleStatus

        key = self.gen.driver.reward.reward_key(False)
        samples = [s for g, _ in parts for s in g]
        for _, failures in parts:  # reward_error_policy skip, as apply_policy does at the step's end
            for f in failures:
                f.sample.reward, f.sample.status = 0.0, SampleStatus.FAILED
                f.sample.metadata["reward_error"] = f.error_text
        return samples, [s.get_reward_value(reward_key=key) for s in samples]

    def _chunk(self, k: int, parts: list) -> Any:
        from relax_hpc.rollout.driver import RolloutResult

        samples, raw = self._samples_of(parts)
        return self.gen.write(self.step, RolloutResult(samples=samples, raw_rewards=raw, metrics={},
                                                       group_size=len(parts[0][0])), self.seq + k)

    def _write(self, k: int, parts: list) -> Any:
        ref = self._chunk(k, parts)
        self.gen.outlets.announce(self.task_id, ref)
        log.info("step %d: chunk %d (%d samples) streamed: %s", self.step, k, ref.n, ref.id)
        return ref

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def finish(self, result: Any) -> list:
        """The chunks streamed (their writes' errors raised here), then the groups after the last whole chunk as the
        step's last chunk (place ``whole``): in place order."""
        refs = [f.result() for _, f in sorted(self.futures, key=lambda kf: kf[0])]
        rest = [self.done[j] for j in range(self.whole * self.size, self.total) if j in self.done]
        if rest and self.whole not in self.skip:
            refs.append(self._chunk(self.whole, rest))
        return refs


class NoMorePrompts:
    """The data source of a step generated again: it has its groups already, and may draw none."""

    def get_samples(self, n: int) -> list:
        if n > 0:
            raise RuntimeError(f"a step generated again asked for {n} more prompt groups: it may use only its own")
        return []


def routed_rows(samples: list, width: int | None = None) -> int | None:
    """MoE routing replay: each sample's ``routed_experts`` made what the chunk's field needs, in place: a compact
    numpy array of ``len(tokens) - 1`` rows of ``width`` expert ids (layers × top_k; the writer flattens it).

    The engine's last answer covers the tokens it ran; the rows of tokens no engine ran (an observation appended
    after the last call, a failed sample's placeholder) are -1, and a sample with no ids and no loss token (failed
    before any generation: an environment error, a bad image) gets -1 rows only: "no recorded routing", the
    trainer's router chooses (:mod:`relax_hpc.train.routing`). A sample with loss tokens and no ids is left
    without: an engine that does not return them is refused downstream, not trained without replay. The width is
    the samples' own, else ``width`` (an earlier step's, or the model config's); without either nothing changes.
    Ids that fit no layout (more rows than tokens, another width) are left for the writer to refuse. Returns the
    width used."""
    import numpy as np

    arrays = {i: np.asarray(s.routed_experts) for i, s in enumerate(samples) if s.routed_experts is not None}
    widths = {a.shape[1] for a in arrays.values() if a.ndim == 2}
    if len(widths) > 1:
        return width  # the writer names the sample
    w = widths.pop() if widths else width
    if not w:  # only flat lists (a custom generate function): their width, if one covers every token of its sample
        w = next((a.size // (len(samples[i].tokens) - 1) for i, a in arrays.items()
                  if a.ndim == 1 and len(samples[i].tokens) > 1 and a.size % (len(samples[i].tokens) - 1) == 0), None)
    if not w:
        return None
    dtype = np.result_type(np.int16, *(a.dtype for a in arrays.values()))
    for i, s in enumerate(samples):
        n = len(s.tokens) - 1
        if i not in arrays and not _no_loss(s):
            continue  # trained without the engine's routing: refused downstream (the writer, the train step)
        a = arrays.get(i, np.zeros((0, w), dtype=dtype))
        if a.ndim == 1 and a.size % w == 0:
            a = a.reshape(-1, w)
        if a.ndim != 2 or n < 1 or a.shape[0] > n:
            continue  # refused by the writer, naming the sample
        if a.shape[0] < n:
            a = np.concatenate([a.astype(dtype, copy=False), np.full((n - a.shape[0], w), -1, dtype=dtype)])
        s.routed_experts = a
    return w


def _no_loss(s: Any) -> bool:
    """Whether a sample has no token the loss counts (a failed one: loss mask 0, or removed)."""
    return s.remove_sample or (not any(s.loss_mask) if s.loss_mask is not None else s.response_length == 0)


def short_failure(f: Any) -> dict:
    """A reward failure for the task's result: its traceback's end, long prompt/response/label cut."""
    d = f.to_dict()
    d["traceback"] = d["traceback"][-2000:]
    for k in ("prompt", "response", "label"):
        v = d.get(k)
        if isinstance(v, str) and len(v) > 300:
            d[k] = v[:300] + "..."
    return d
