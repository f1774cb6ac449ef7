"""The training loop: rollout step N is generated → trained on → its weights synced, in both modes.

A state machine the controller loop feeds with ``task_done`` messages. It hands out tasks through the
channel (the roles' rank 0 long-poll for them, see :mod:`relax_hpc.roles.tasks`; each task and each result
is a class of :mod:`relax_hpc.controller.messages`), at most one in flight per role, and decides what each
idle role does next in one place, :meth:`TrainingLoop._pump`:

- rollout, when idle: ``generate(N+1)`` as soon as the exchange's staleness gate lets partition N+1 start;
- reference (with ``algorithm.use_kl_loss``), when idle: ``logprobs`` of the next step's chunks
  (``ref_log_probs``: π_ref, the model on disk, refreshed from the actor's checkpoint every
  ``algorithm.ref_update_interval`` steps if set);
- actor_fwd (when enabled), once step N−1's sync is done: ``logprobs`` of step N with the weights of step N−1
  (``log_probs``: π_old, which the actor then uses instead of its own forward); it follows the actor through the
  weight-sync group like an engine (``follow`` at the start; every sync stages the new weights on it, and the
  task names the version to use), so checkpoints stay at ``checkpoint.interval``;
- streaming within a step (``rollout.stream_groups``): rollout reports each chunk of a step as it is written
  (``chunk_ready``, announced at once); the forward roles take them one by one, and the idle actor computes their
  π_old (``stage(N)``) before the step's last response (docs/controller.md, "Streaming within a step");
- actor, when idle: ``train(N)`` once step N's chunks have every field it needs, then ``sync(N)``
  (weights → engines, version ``"N"``), then ``checkpoint(N)`` every ``checkpoint.interval`` steps and
  after the last.
- genrm (``roles.genrm``): ``start_engines`` only; its judges' URLs go with every ``generate`` and ``eval``, and
  rollout starts none before they are known.
- teacher (``roles.teacher``, on-policy distillation): likewise, ``start_engines`` only; its engines' URLs (or
  ``opd.teacher_url``, an external teacher) go with every ``generate`` as ``teachers``, and with ``opd:`` the
  train task reads ``teacher_log_probs`` from every chunk (the rollout writes them).
- routing replay (``train.routing_replay``, a mixture-of-experts actor): the train task reads ``routed_experts``,
  the experts the engine chose, from every chunk.
- eval (``rollout.eval_interval``; Relax's schedule): ``eval(N)`` goes to rollout once ``sync(N)`` is done, after
  every ``eval_interval``-th step and after the last, and ``eval(0)`` before training unless
  ``rollout.skip_eval_before_train``. Rollout does it before its next ``generate`` (it is idle then in
  colocate; in fully_async it finishes the generate in flight first), so the eval runs on the weights of step
  N; the actor may train on meanwhile, but ``sync(N+1)`` waits until ``eval(N)`` is done (Relax's
  ``_wait_for_previous_eval``), and the run stops only after the last step's eval. The metrics (``eval/<name>``,
  ``eval/<name>-pass@k``, ...) join step N's row (:meth:`RunMetrics.amend`; step 0's is a row of its own).

Step N's lease of task ``train`` is acked when ``sync(N)`` is done (with ``train.overlap_sync``, when its push
landed: the actor may train step N+1 meanwhile, docs/controller.md), so with ``max_staleness: k`` rollout
starts step N+1 only while ``N+1 − (oldest step not yet synced) ≤ k``. The modes differ only in k:
``colocate`` is k = 0 (strictly on-policy: step N is generated with the weights of step N−1; on GPU nodes
the roles take turns on the same devices), ``fully_async`` lets rollout run up to k steps ahead while the
actor trains and syncs, on its own node group; samples then carry older versions, never older than
``N−1−k``. With ``staleness_mode: fixed`` they carry exactly ``N−1−k``: ``sync(M)`` is held until step M+k is
generated, and a checkpoint keeps the steps generated on older weights for the resume (``docs/controller.md``,
"Fixed staleness").

    engine steps (Elastic.start_initial) + rollout start_engines (its data cursor) → actor connect
    (→ resume sync) → pump … → stop

The exchange (:class:`~relax_hpc.exchange.broker.Broker`, journal ``RUN_DIR/exchange/journal.jsonl``):
rollout's chunks are announced when its ``generate`` reports them (over the run's token socket), so the
journal records every sample produced and consumed, across attempts (:mod:`relax_hpc.exchange.audit`).

Metrics: a step's ``rollout/*``, ``train/*``, ``perf/*``, ``weights/*`` plus ``perf/step_time`` (generate
start → sync done), ``perf/step_interval`` (sync done → sync done: the throughput) and
``perf/controller_time`` (time this loop spent on the step's reports: broker, journal, metrics) go to
:class:`~relax_hpc.ops.metrics.RunMetrics` when its sync is done; ``state.json`` gets ``step`` (synced
steps), ``generated``, ``phase``, ``reward``, ``engines``, ``last_checkpoint``. A task that reports an
error fails the run with the report as reason (kind ``task``: no restart helps). A dead engine is logged
by name, marked in ``state.json`` and left out of later steps and syncs until it is started again.

Elastic rollout (``docs/elastic.md``): ``relax-scale``'s questions, engines joining and leaving, and their drains are
:class:`~relax_hpc.controller.elastic.Elastic`'s; it shares the registry, so a joined engine (``syncing``) gets the
weights from the next sync (a catch-up one when the actor is idle) before any generate may use it, and an engine
added by scale-out that dies is ``gone``, not started again.

Damaged chunks (``docs/exchange.md``, "Damage"): a chunk of step N that the broker quarantines at hand-out
(missing, resized), or that a ``train``/``logprobs`` task could not read (``DamagedChunk``: the broker
re-verifies and quarantines), is reported (``state.json`` event ``chunk_quarantined``, metric
``exchange/quarantined``) and never trained on: step N's partition is voided (``Broker.regenerate``) and
``generate(N)`` assigned again, from the data cursor after step N−1 and with the same sampling seeds; results
of tasks on the voided partition are dropped. After :data:`MAX_REGENERATIONS` damaged lives the run fails
with the chunk's name. Test hook: ``RELAX_TEST_DAMAGE_CHUNK=<step>:truncate|flip``.

Resume: from ``checkpoints/latest`` (step K): rollout restores the data cursor saved with it, the actor
loads it in ``connect``, a sync puts it on the engines (version ``"K"``), partitions after K are voided
(``Broker.rewind``) and produced again; generation is seeded by (run seed, step), so a colocate run
resumes exactly as if never stopped. Role tier of recovery (:meth:`TrainingLoop.role_restarted`, docs/reliability.md): a role other than the actor
started again alone gets back the tasks it held, after what its fresh start needs (a frozen role's engines, actor_fwd's
follow and the actor's reconnect to it with a catch-up sync, the reference's last refresh); its leases go back to the
exchange's queue and are leased again; a rollout driver's generate goes again from the cursor and partial rollout's
buffer saved after the step before. The actor and the engines keep their processes and weights. Stop with a
checkpoint (:meth:`request_stop`): no new generation,
the actor finishes its step, checkpoints unless the last checkpoint is of this step, and ``outcome``
becomes ``"requeue"`` or ``"cancel"``. An eval is never logged twice: the checkpoint of step K may be saved
before ``eval(K)`` is done; a resume from it runs ``eval(K)`` again (the engines have K's weights after the
resume sync) only when K's row in ``metrics.jsonl`` has no ``eval/*`` yet, and adds it to that row.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from relax_hpc.controller import messages as M
from relax_hpc.backends import Backend, LocalBackend
from relax_hpc.controller.channel import Channel
from relax_hpc.controller.dispatch import Dispatcher, Task
from relax_hpc.controller.elastic import Autoscaler, Capacity, Elastic
from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.controller.eval_schedule import EvalSchedule
from relax_hpc.controller.fixed_staleness import FixedStaleness
from relax_hpc.controller.generation import Generation
from relax_hpc.controller.resume_plan import plan_resume
from relax_hpc.controller.state import RunState
from relax_hpc.controller.step_rows import StepRows
from relax_hpc.exchange.broker import Broker
from relax_hpc.exchange.chunk import ChunkRef, parse_chunk_file
from relax_hpc.exchange.fields import LOGPROB_FIELDS, PRODUCER, task_fields
from relax_hpc.ops.metrics import REWARD, RunMetrics, summary_line
from relax_hpc.ops.wandb_log import public_config
from relax_hpc.recipe import Recipe, initial_engines, recipe_to_dict
from relax_hpc.rundir import RunDir
from relax_hpc.train.config import overlap_sync

log = logging.getLogger("relax_hpc.controller")


MAX_REGENERATIONS = 3  # lives of one step voided for damaged chunks before the run fails
TEACHER_RETRIES = 2  # a step's generate given again while the teacher role lives, before it is started again alone
# the roles whose ranks each serve one frozen engine (never synced) -> the Readiness field and state.json key of
# their engines' URLs, which rollout gets with its tasks
FROZEN_ROLES = {"genrm": "judges", "teacher": "teachers"}


@dataclass
class Readiness:
    """What the loop waits for before its first step (the engines up, rollout's cursor, the judges, teachers and
    followers known, the actor connected), and the engines' last catch-up sync."""
    judges: dict[str, str] | None  # the GenRM judges (roles.genrm): rollout gets them with every generate and eval
    teachers: dict[str, str] | None  # the OPD teachers (roles.teacher or opd.teacher_url): with every generate
    followers: dict[str, str] | None  # forward roles in the weight-sync group (actor_fwd): {role: url}
    engines_started: bool = False  # the run's own engine steps (started at the first tick)
    cursor_known: bool = False  # rollout reported its data cursor (start_engines)
    connecting: bool = False  # the actor's connect went out
    catch_up: tuple | None = None  # (step, engines) of the last catch-up sync for engines started again


@dataclass
class Stop:
    request: tuple[str, str] | None = None  # (outcome, why) asked for by request_stop
    outcome: str | None = None  # "requeue" or "cancel" once a requested stop is done


class TrainingLoop:
    """The decisions: :meth:`tick` and :meth:`_pump` (who does what next), the ``_<kind>_done`` handlers (a report in).
    The bookkeeping is in objects of their own: :attr:`resume` (:mod:`~relax_hpc.controller.resume_plan`),
    :attr:`evals` (:mod:`~relax_hpc.controller.eval_schedule`), :attr:`fixed`
    (:mod:`~relax_hpc.controller.fixed_staleness`), :attr:`gen` (:mod:`~relax_hpc.controller.generation`),
    :attr:`rows` (:mod:`~relax_hpc.controller.step_rows`), :attr:`tasks` (:mod:`~relax_hpc.controller.dispatch`)."""

    def __init__(self, recipe: Recipe, run: RunDir, state: RunState, channel: Channel, backend: Backend = LocalBackend(),
                 capacity: Capacity | None = None):
        if recipe.algorithm.use_kl_loss and not recipe.roles.reference.enabled and recipe.train.lora is None:
            raise ValueError("algorithm.use_kl_loss needs reference log-probs. Fix: set roles.reference.enabled: true")
        self.recipe, self.run, self.state = recipe, run, state
        self.fwd = _forward_roles(recipe)  # the forward roles with work to do -> the step whose weights each holds
        self.old_fused = _old_fused(recipe)  # π_old is the update's own forward: nothing to stage
        self.fixed = FixedStaleness.of(recipe)  # staleness_mode fixed (None: not in effect)
        self.broker = Broker(run.path / "exchange", tasks=_consumers(self.fwd, _opd(recipe), recipe.train.routing_replay),
                             max_staleness=recipe.max_staleness if recipe.mode == "fully_async" else 0)
        self.resume = plan_resume(run.path, self.broker, state, fixed=self.fixed is not None,
                                  max_staleness=recipe.max_staleness, total=self.total)
        self.resume.rewind(self.broker)
        self.metrics = RunMetrics(run.path, recipe.logging.tensorboard, start_step=self.resume.step,
                                  started=state.doc.get("started_at"), wandb=recipe.logging.wandb, run_name=run.name,
                                  config=public_config(recipe_to_dict(recipe)) if recipe.logging.wandb else None,
                                  plot_marks=recipe.logging.plot_marks)
        if self.metrics.wandb_error:
            state.event("wandb_off", f"{self.metrics.wandb_error}; TensorBoard and metrics.jsonl have every metric")
        self.tasks, self.rows, self.gen = Dispatcher(channel), StepRows(), Generation.of(self.resume)
        self.step, self.last_ckpt_step = self.resume.step, self.resume.checkpoint  # synced steps; the last checkpoint
        self.started = False  # engines up, weights connected (and resynced on a resume)
        self.ready: dict[int, set[str]] = {}  # steps generated, not yet trained -> the forward roles that added theirs
        # streaming within a step (rollout.stream_groups): the chunks of a step being generated, announced so far
        self.streamed: dict[int, list[ChunkRef]] = {}
        self.streaming = bool(recipe.rollout.stream_groups)
        self.staged: dict[int, set[str]] = {}  # step -> its chunks whose π_old the actor computed early (stage)
        self.leases: dict[Any, Any] = {}  # step (train) or (role, step) (a forward role) -> its lease
        self.held_sync: int | None = None  # a trained step whose sync waits (an earlier step's eval; fixed: rollout)
        self.overlap = overlap_sync(recipe)  # train.overlap_sync: step N's push runs behind step N+1's train
        self.landing: int | None = None  # that step, while its push is on its way (synced once it lands)
        self.loaded: dict[str, str] = {}  # forward role -> the checkpoint its last load named (given again on a restart)
        # actor_fwd started again alone: "follow" until it serves the weight sync again, "reconnect" until the actor
        # has it in the group (syncs wait meanwhile: the group still names its old, dead, URL)
        self.refollow: str | None = None
        # a generate failed by the run's own teacher (TeacherError): (step, when, error) while its verdict is awaited
        self.teacher_wait: tuple[int, float, str] | None = None
        self.teacher_tries: dict[int, int] = {}  # step -> its generates given again while the teacher lived
        self.stop, self.paused = Stop(), False  # paused: RUN_DIR/pause seen (see _paused)
        self.boot = Readiness(judges=None if recipe.roles.genrm.enabled else {},
                              teachers=None if recipe.roles.teacher.enabled else _external_teachers(recipe),
                              followers=None if "actor_fwd" in self.fwd else {})
        self.elastic = Elastic(recipe, run, EngineRegistry(), state, channel, backend, holds=self.tasks.holds,
                               on_change=self._engines_changed, assign=channel.assign, capacity=capacity)
        self.autoscaler = Autoscaler(self.elastic)  # elastic: engines added and removed while the run goes
        self.evals = EvalSchedule(recipe.rollout.eval_interval, recipe.rollout.skip_eval_before_train, self.total)
        self._begin()

    @property
    def total(self) -> int:
        return self.recipe.run.steps

    @property
    def registry(self) -> EngineRegistry:
        """The rollout engines: state, origin, weight version, where they run (shared with :attr:`elastic`)."""
        return self.elastic.registry

    @property
    def roles(self) -> list[str]:
        """The roles told to stop at the end: enabled forward roles serve tasks until then, work or not."""
        return ["rollout", "actor"] + [r for r in ("reference", "actor_fwd", *FROZEN_ROLES)
                                       if self.recipe.role(r).enabled]

    @property
    def outcome(self) -> str | None:
        return self.stop.outcome

    @property
    def stop_request(self) -> tuple[str, str] | None:
        return self.stop.request

    def _begin(self) -> None:
        """The attempt's first tasks: the kept steps (fixed) and an owed eval taken in, rollout's (and the judges' and
        teachers') engines, the forward roles' weights."""
        k, path = self.resume.step, self.resume.path
        if self.fixed:
            self.fixed.unfixed_upto = self.resume.unfixed_upto
        if self.resume.kept:
            self._keep(k)
        self.evals.resume(k, self.metrics.evaluated)  # step 0's, or K's when its eval was cut off
        if path:
            log.info("resuming from %s (step %d of %d)", path, k, self.total)
            self.state.event("resumed", f"from the checkpoint of step {k}")
        self.state.progress(step=k, generated=self.gen.generated, phase="starting engines", reward=None, engines={},
                            mode=self.recipe.mode)
        self._assign("rollout", k, M.StartEnginesTask())  # generate(n) carries the cursor (the one after n-1)
        for role, key in FROZEN_ROLES.items():  # the judges' and teachers' engines (an external teacher: its URL)
            if getattr(self.boot, key) is None:
                self._assign(role, k, M.StartEnginesTask())
            elif getattr(self.boot, key):
                self._frozen_known(key, getattr(self.boot, key))
        for r in self.fwd:  # a resumed actor_fwd follows the checkpoint; a refreshed reference too (the latest)
            if path and (r == "actor_fwd" or self.recipe.algorithm.ref_update_interval):
                self._assign(r, k, M.LoadTask(path=path))
        if self.boot.followers is None:
            self._assign("actor_fwd", k, M.FollowTask())

    def role_restarted(self, role: str) -> None:
        """Role tier of recovery: ``role`` (not the actor) is being started again alone. The tasks it held are
        forgotten and given again to its new ranks, after what a fresh start of the role needs; its leases go back to
        the exchange's queue (released; :meth:`_pump_logprobs` leases the step again, so the journal records each
        sample consumed once). The actor and the engines are not touched."""
        dropped = self.tasks.drop(role)
        for key in [k for k in self.leases if isinstance(k, tuple) and k[0] == role]:
            self.broker.release(self.leases.pop(key).id, f"{role} restarted alone")
        self.rows.freed(role)
        kinds = {t.kind for t in dropped}
        if role in FROZEN_ROLES:  # new engines under new URLs: generates wait for them (the pump holds)
            setattr(self.boot, FROZEN_ROLES[role], None)
            if "start_engines" not in kinds:
                self._assign(role, self.step, M.StartEnginesTask())
        if role == "teacher" and self.teacher_wait is not None:  # the verdict: dead; the generate goes to the new one
            self._generate_again(self.teacher_wait[0], "the teacher is started again alone")
        if role == "actor_fwd" and role in self.fwd:  # the model on disk now; the actor pushes it the weights again
            self.fwd[role] = 0
            self.refollow = "follow"
            if "follow" not in kinds:
                self._assign(role, self.step, M.FollowTask())
        if role == "reference" and role in self.loaded and "load" not in kinds:  # its last refresh
            self._assign(role, self.step, M.LoadTask(path=self.loaded[role]))
        for t in dropped:
            if t.kind != "logprobs" and t.message is not None:  # log-probs: leased again by the pump
                message = t.message
                if t.kind == "generate" and self.streamed.get(t.step):  # the chunks it streamed stay: the new
                    message = replace(message, streamed=sorted(  # ranks write the others
                        _seq(c) - message.seq for c in self.streamed[t.step]))
                self.tasks.assign(role, t.step, message, t.life, t.versions)
        log.info("%s restarted alone: the tasks it held (%s) go to its new ranks, its leases back to the exchange",
                 role, ", ".join(f"{t.kind}({t.step})" for t in dropped) or "none")
        self._pump()

    def _pump_refollow(self) -> None:
        """actor_fwd, started again alone, serves the weight sync at a new URL: the actor rebuilds its group with it
        (the engines keep theirs), then a catch-up sync gives it the weights the actor holds (or the held sync does)."""
        if self.refollow != "reconnect" or not self._idle("actor"):
            return
        self.refollow = None
        live = self.registry.live()
        self._assign("actor", self.step, M.ConnectTask(engines=live, load=None, followers=self.boot.followers or {},
                                                       nodes=self.registry.nodes(live) or None))
        if self.held_sync is not None:
            self._release_sync()
        elif self.step > 0 or self.resume.path:  # else it holds step 0's weights already (the model on disk)
            self._sync(self.step)

    def _teacher_failed(self, task: Task, error: str) -> bool:
        """Rollout's generate got no answer from the run's own teacher (``TeacherError``; the rollout role serves on).
        Not every step restarts: the teacher's liveness verdict is awaited (:meth:`_teacher_verdict`) and the step's
        generate goes again from the same data cursor. False (every step restarts, as before) for an outside teacher
        (``opd.teacher_url``: nothing of the run's to restart) or another error."""
        if not (self.recipe.roles.teacher.enabled and error.startswith("TeacherError:")):
            return False
        n = task.step
        log.warning("step %d: generate: %s; waiting for the teacher role's verdict (dead: started again alone; "
                    "alive: the generate goes again)", n, error)
        self.teacher_wait = (n, time.time(), error)
        if getattr(task.message, "teachers", None) != self.boot.teachers:  # the teacher was started again since
            self._generate_again(n, "the teacher was started again alone")
        return True

    def _teacher_verdict(self) -> None:
        """Alive (every teacher rank spoke since the failure, none being restarted): the generate goes again, at most
        :data:`TEACHER_RETRIES` times a step; then the teacher, alive but not answering (its engine gone), is started
        again alone (the global tier where the role tier's limits say so). Dead: :meth:`role_restarted` says it."""
        if self.teacher_wait is None or not self.state.running:
            return
        n, since, error = self.teacher_wait
        ranks = self.state.ranks.get("teacher") or []
        if not ranks or "teacher" in self.state.recovering or any(r.last is None or r.last <= since for r in ranks):
            return  # no verdict yet: a dead rank is found by its exit or its silence (logging.heartbeat_timeout_s)
        tries = self.teacher_tries.get(n, 0)
        if tries < TEACHER_RETRIES:
            self.teacher_tries[n] = tries + 1
            self._generate_again(n, f"the teacher role is alive (try {tries + 1} of {TEACHER_RETRIES})")
        else:
            self.state.fail("teacher", None, self._node("teacher"), f"its engines gave rollout no answer in step "
                            f"{n}'s generate {tries + 1} times while the role lived; last: {error}")
        self._pump()

    def _generate_again(self, n: int, why: str) -> None:
        """Step ``n``'s generate, failed by the teacher, goes again (nothing of it was announced): the same prompts
        (the data cursor after step n−1) and seeds, to the teachers known when it goes."""
        self.teacher_wait = None
        log.info("step %d: the generate goes again: %s", n, why)
        self.state.event("generate_again", f"step {n}: {why}")
        self.gen.regen.add(n)

    def _keep(self, k: int) -> None:
        """Resume the steps generated before step ``k``'s checkpoint (fixed staleness): trained, not generated again;
        their generate metrics came with the checkpoint, the forward roles' fields with the exchange."""
        for n, row in self.resume.kept_rows().items():
            self.ready[n] = {r for r in self.fwd if (p := self.broker.progress(r, n)).get("samples")
                             and p["consumed"] == p["samples"]}
            self.fixed.rows[n] = row
            self.rows.kept(n, row)
        log.info("staleness_mode fixed: steps %d-%d were generated before the checkpoint of step %d; trained now, "
                 "not generated again", k + 1, self.gen.generated, k)

    def request_stop(self, outcome: str, why: str) -> None:
        """No new generation; the actor's step finishes, a checkpoint, then stop with ``outcome``."""
        if self.stop.request is None and self.stop.outcome is None:
            log.info("%s: the step in flight finishes, then a checkpoint, then %s", why, outcome)
            self.stop.request = (outcome, why)
            self.state.event("stop requested", f"{why}: checkpoint, then {outcome}")
            self._pump()

    # -- the loop: each turn of the controller, and after each report
    def tick(self) -> None:
        """Every turn of the controller loop: a pause file removed or moved on lets the next step start; drains,
        joins and attached jobs move on."""
        if not self.boot.engines_started:  # after the role steps: their start is not held up by the engines'
            self.boot.engines_started = True
            self.elastic.start_initial(initial_engines(self.recipe), fresh=self.resume.path is None)
        self.elastic.started = self.started
        before = (len(self.elastic.expected), self.registry.count("ready"))
        self.elastic.tick()
        if self.started and before != (len(self.elastic.expected), self.registry.count("ready")):
            self._pump()  # e.g. an engine given up: a generate that waited for it goes (and fails naming them)
        if not self.boot.connecting and not self.elastic.initial_pending():
            if not self.registry.live() and self.state.running:  # none of the run's engines could be started
                why = "; ".join(f"{n}: {w}" for n, w in sorted(self.elastic.failed_starts.items()))
                self.state.fail("rollout", None, self._node("rollout"),
                                f"no rollout engine could be started ({why or 'none joined'})", kind="task")
                return
            self._connect()
        if self.paused and self.started and not self._paused(self.gen.next()):
            self._pump()
        self._teacher_verdict()

    def _pump(self) -> None:
        """Give each idle role its next task (the one place that decides)."""
        if (not self.started or self.boot.judges is None or self.boot.teachers is None or self.stop.outcome is not None
                or not self.state.running):
            return
        self._pump_behind()
        if self._idle("actor") and self.held_sync is None:  # a held sync: the actor's step is not done yet
            if self.stop.request is not None:
                if self.step > (self.last_ckpt_step or 0):
                    return self._checkpoint(self.step)
                self.stop.outcome = self.stop.request[0]
                return
            if self.step >= self.total:
                if not self.evals.owed():  # the last step's eval comes first
                    return self._stop_roles()
            else:
                n = self.step + 1
                if n in self.ready and self.ready[n].issuperset(self.fwd):
                    self._train(n)
                else:
                    self._pump_stage(n)
            self._pump_catch_up()
        self._pump_refollow()
        if self.fixed and self.held_sync is not None and self._idle("actor") and self._idle("rollout"):
            self._unfix_if_stuck()
        for r in self.fwd:
            self._pump_logprobs(r)
        # a due eval before the next generate, on the weights it is due on (train.offload: after a checkpoint)
        if self._idle("rollout") and not self._saving_on_device() and (n := self.evals.take()) is not None:
            self._assign("rollout", n, M.EvalTask(step=n, judges=self.boot.judges,
                                                  engines=self.registry.routable(min_version=n)))
        self._pump_generate()
        self.state.progress(phase=self._phase(), generated=self.gen.generated)

    def _pump_behind(self) -> None:
        """train.overlap_sync: while step N's push is on its way (the actor's only task in flight its landing), the
        actor trains step N+1 once its data is there; nothing else of the actor's (a checkpoint, a catch-up sync, a
        stop) goes before the landing."""
        n = None if self.landing is None else self.landing + 1
        if (n is None or n > self.total or self.stop.request is not None or self.held_sync is not None
                or any(t.role == "actor" and t.kind != "land" for t in self.tasks.pending.values())):
            return
        if n in self.ready and self.ready[n].issuperset(self.fwd):
            self._train(n)

    def _stop_roles(self) -> None:
        self.state.progress(phase="stopping")
        for role in self.roles:
            self._assign(role, self.step, M.StopTask())
        self.started = False

    def _pump_catch_up(self) -> None:
        """An engine started again (or joined) gets the weights the actor holds (step self.step's) now, once."""
        syncing = frozenset(n for n, e in self.registry.engines.items() if e.state == "syncing")
        if self._idle("actor") and syncing and self.boot.catch_up != (self.step, syncing) and self.refollow is None:
            self.boot.catch_up = (self.step, syncing)
            self._sync(self.step)

    def _pump_logprobs(self, r: str) -> None:
        """Forward role ``r``'s field for the oldest step without it (actor_fwd: once it holds step n−1's weights)."""
        if self.streaming:
            return self._pump_stream_logprobs(r)
        n = min((s for s, done in self.ready.items() if r not in done), default=None)
        if n is not None and self._idle(r) and (r != "actor_fwd" or self.fwd[r] == n - 1):
            lease = self._lease(r, n, holder=r)
            if lease is not None:
                self.leases[(r, n)] = lease
                self._assign(r, n, M.LogprobsTask(chunks=list(lease.chunks),
                                                  version=str(n - 1) if r == "actor_fwd" else None))

    def _pump_stream_logprobs(self, r: str) -> None:
        """Streaming within a step: forward role ``r`` gets the chunks of the oldest step it has not finished that
        have landed (announced, not yet consumed by it), while rollout may still be writing that step's later
        ones. Each chunk holds whole groups, in the step's group order."""
        steps = sorted({s for s, done in self.ready.items() if r not in done} | set(self.streamed))
        if not steps or not self._idle(r):
            return
        n = steps[0]
        if r == "actor_fwd" and self.fwd[r] != n - 1:  # π_old: the weights of step n−1, once synced to it
            return
        # one chunk a task (batch_size 1: the first chunk alone): a forward pass over a fixed set of samples, so its
        # numbers do not depend on how many chunks had landed (staleness_mode fixed stays bit for bit)
        lease = self.broker.request(r, step=n, batch_size=1, holder=r)
        if self.broker.quarantined(n):  # made again once its generate is done (a step is voided whole, never mid-way)
            return None if n in self.streamed else self._regenerate(n)
        if lease is not None:
            self.leases[(r, n)] = lease
            self._assign(r, n, M.LogprobsTask(chunks=list(lease.chunks),
                                              version=str(n - 1) if r == "actor_fwd" else None))

    def _pump_stage(self, n: int) -> None:
        """Streaming within a step: the idle actor computes π_old of step ``n``'s chunks that have landed. It holds
        step n−1's weights (trained and synced, no sync held), the ones step n's first update starts from. Not where
        π_old comes from elsewhere (actor_fwd, the engine's log-probs) or is the update's own forward (one optimizer
        step: :func:`relax_hpc.train.config.old_from_train_forward`), nor where the engines or an offloaded actor
        would need the device memory back (train.offload, rollout.engine.offload)."""
        r = self.recipe
        if (not self.streaming or "actor_fwd" in self.fwd or r.algorithm.use_rollout_logprobs or r.train.offload
                or r.rollout.engine.offload or self.old_fused or not self._idle("actor")):
            return
        done = self.staged.setdefault(n, set())
        todo = [c for c in self.streamed.get(n, []) if c.id not in done]
        if todo:
            done.update(c.id for c in todo)
            self._assign("actor", n, M.StageTask(step=n, chunks=todo))

    def _pump_generate(self) -> None:
        """Rollout's next generate, if it is idle and the gate, the engines and a pause let it start."""
        n = self.gen.next()
        owed = self._owed(n)  # fixed: a held sync waits for this step, so a stop does not hold it back
        if self._saving_on_device() or self.teacher_wait is not None:  # (the teacher's verdict first)
            return
        if self._idle("rollout") and (self.stop.request is None or owed) and (self.gen.regen or
                                                                              self.gen.generated < self.total):
            # an engine to send to (none ready while the only ones left are catching up, or are being started
            # again: wait for them; none alive or starting: the generate fails naming them), then the staleness gate
            engines = self._routable(n)
            serving = bool(engines) or not (self.registry.live() or self.elastic.own_starting())
            held = self._paused(n) and not (owed and self.stop.request is not None)
            if self.state.running and serving and not held and self.broker.start_step(n):
                self.gen.started(n)
                self.rows.begin(n)
                self.rows.waited("rollout", n, "perf/rollout_wait_time")  # idle: the staleness gate, a pause
                # a rollout that died between writing a chunk and reporting it left the file: its seq is free again
                stray = self.broker.set_aside_unannounced(n, PRODUCER)
                if stray:
                    log.info("step %d: set aside %s, written by a rollout that died before announcing it",
                             n, ", ".join(stray))
                # data_state: the cursor after step n-1, so that step n (also when generated again) gets its prompts
                self._assign("rollout", n, M.GenerateTask(step=n, engines=engines,
                                                          seq=self.broker.next_seq(PRODUCER),
                                                          data_state=self.gen.cursor(n), judges=self.boot.judges,
                                                          teachers=self.boot.teachers))

    def _train(self, n: int) -> None:
        lease = self._lease("train", n, holder="actor")
        if lease is not None:
            del self.ready[n]
            self.staged.pop(n, None)
            self.leases[n] = lease
            self.rows.waited("actor", n, "perf/actor_wait_time")  # idle until step n's samples were there
            if self.landing == n - 1:  # train.overlap_sync: before step n−1's sync landed (the metric says so)
                self.rows.cur.setdefault(n, {})["perf/weight_sync_overlapped"] = 1.0
                log.info("step %d: train starts while step %d's weights are pushed", n, n - 1)
            chunks = sorted(lease.chunks, key=_seq) if self.streaming else list(lease.chunks)  # as the step's groups
            self._assign("actor", n, M.TrainTask(step=n, chunks=chunks))

    def _sync(self, n: int) -> None:
        """The actor puts step ``n``'s weights on the live engines, as version ``"n"``; with train.overlap_sync it
        may push them behind step n+1's train (:meth:`_behind`), the landing reported as task ``land``."""
        live = self.registry.live()
        snapshot = self.elastic.external.snapshot_for(n)  # external engines
        land = self.tasks.expect("actor", n, "land", live) if self._behind(n, snapshot) else None
        self._assign("actor", n, M.SyncTask(version=str(n), engines=live, nodes=self.registry.nodes(live) or None,
                                            snapshot=snapshot, land=land))

    def _behind(self, n: int, snapshot: str | None) -> bool:
        """Whether step ``n``'s push may run behind step n+1's train: train.overlap_sync, a step's own sync (not a
        resume's or a catch-up one), and nothing due on step n's weights in the actor (a checkpoint, a stop)."""
        every = self.recipe.checkpoint.interval
        save = bool(every and n % every == 0) or n == self.total
        return (self.overlap and self.started and n > self.step and not save and snapshot is None
                and self.stop.request is None)

    def _checkpoint(self, n: int) -> None:
        extra: dict[str, Any] = {"step": n, "data": self.gen.data.get(n)}
        kept = self.fixed.kept(n, self.gen.data) if self.fixed else None
        if kept:  # fixed: steps n+1..g were generated on weights a resume from this checkpoint no longer has
            extra["kept"] = kept
        self._assign("actor", n, M.CheckpointTask(extra=extra))

    # -- tasks out
    def _assign(self, role: str, at: int, task: M.TaskMessage) -> None:
        """Queue ``task`` for ``role``, as part of step ``at`` (a role does its tasks in order)."""
        engines = getattr(task, "engines", None)
        versions = ({n: self.registry.engines[n].weight_version for n in engines if n in self.registry.engines}
                    if engines else None)
        if isinstance(task, M.LoadTask):
            self.loaded[role] = task.path
        self.tasks.assign(role, at, task, self.gen.life(at), versions)

    def _idle(self, role: str) -> bool:
        return self.tasks.idle(role)

    def _saving_on_device(self) -> bool:
        """train.offload (colocate): the actor's state is back on the device while it saves a checkpoint, so the
        engines neither generate nor evaluate until it is off again (they would not have their memory)."""
        return self.recipe.train.offload and any(t.role == "actor" and t.kind == "checkpoint"
                                                 for t in self.tasks.pending.values())

    def _routable(self, n: int) -> dict[str, str]:
        """The engines generate(n) may use: ready, serving the weights of step n−1−k or newer (k: the staleness
        bound; the exchange's gate already holds n back until those are synced); exactly those with ``fixed``."""
        v = max(0, n - 1 - self.broker.max_staleness)
        exact = self.fixed is not None and self.fixed.exact(n, self.gen.regen)
        return self.registry.routable(min_version=v, max_version=v if exact else None)

    def _engines_changed(self) -> None:
        self.state.progress(engines=self.registry.to_state())

    def _phase(self) -> str:
        kinds = self.tasks.kinds()
        return "+".join(kinds) if kinds else "paused" if self.paused else "idle"

    def _paused(self, n: int) -> bool:
        """Whether ``RUN_DIR/pause`` holds step ``n`` back: an empty file holds every new step, one with a step
        number N the steps after N. The steps in flight finish; checkpoints and stops still happen. For
        operators (hold a run, e.g. while a filesystem is repaired) and for tests and tools/chaos, which
        must hit a run at a known point."""
        path = self.run.path / "pause"
        try:
            text = path.read_text().strip()
        except OSError:
            text = None
        paused = text is not None and (not text.isdigit() or n > int(text))
        if paused != self.paused:
            self.paused = paused
            self.state.event("paused" if paused else "unpaused",
                             f"{path}: step {n} {'waits' if paused else 'starts'}")
        return paused

    # -- held syncs: an earlier step's eval, and (fixed staleness) rollout
    def _sync_waits(self, n: int) -> bool:
        """Whether step ``n``'s sync must wait: the engines keep the weights an earlier step's eval runs on (fully
        async), or (fixed staleness) rollout has not yet generated step n+k, the last one on the weights before n
        (unless those steps were let go: :meth:`_unfix_if_stuck`)."""
        return (self.evals.owed(before=n) or (self.fixed is not None and self.fixed.waits(n, self.gen.done))
                or self.refollow is not None)  # actor_fwd restarted alone: the actor's group first

    def _owed(self, n: int) -> bool:
        """Fixed staleness: a held sync waits for step ``n``'s generate."""
        return self.fixed is not None and self.fixed.owed(n, self.held_sync)

    def _unfix_if_stuck(self) -> None:
        """Fixed staleness: the generate a held sync waits for has no engine with its weights (the only ones left were
        started again, or joined, and hold the model on disk; a catch-up sync would give them the held step's, too
        new). The held sync goes out, and the steps it waited for are generated on its weights: the run goes on,
        off the fixed trajectory, with an event."""
        n = self.gen.next()
        if not self._owed(n) or self._routable(n) or not self.registry.live():
            return
        m, last = self.held_sync, self.fixed.last_on_old(self.held_sync)
        self.fixed.loose.update(range(n, last + 1))
        log.warning("staleness_mode fixed: no engine holds step %d's weights for step %d any more; steps %d-%d are "
                    "generated on step %d's", n - 1 - self.broker.max_staleness, n, n, last, m)
        self.state.event("fixed_staleness_broken", f"steps {n}-{last} generated on step {m}'s weights (no engine "
                                                   f"held step {n - 1 - self.broker.max_staleness}'s any more)")
        self.held_sync = None
        self._sync(m)

    def _release_sync(self) -> None:
        if self.held_sync is not None and not self._sync_waits(self.held_sync):
            m, self.held_sync = self.held_sync, None
            self._sync(m)

    # -- damaged chunks
    def _lease(self, task: str, n: int, holder: str) -> Any:
        """Every chunk of step ``n`` for ``task``; None when the broker quarantined chunks of ``n`` at hand-out
        (a file missing or resized): then ``n`` is generated again (or the run fails), never trained on."""
        lease = self.broker.request(task, step=n, batch_size=1 << 30, holder=holder)
        if self.broker.quarantined(n):
            self._regenerate(n)
            return None
        if lease is None:
            self.state.fail("controller", None, None, f"step {n}: the exchange has no chunk of step {n} for {task}, "
                            f"though it was generated (see {self.broker.journal_path})", kind="controller")
        return lease

    def _read_failed(self, task: Task, error: str) -> bool:
        """A ``train``/``logprobs`` task could not read its chunks (``DamagedChunk``: bytes changed after the
        broker's hand-out check): the broker verifies each chunk itself and quarantines the damaged ones, and
        the step is generated again. False when the error is something else, or the broker finds the chunks
        sound (the run then fails with the error)."""
        key = task.step if task.kind == "train" else (task.role, task.step)
        lease = self.leases.get(key)
        if not error.startswith("DamagedChunk:") or lease is None:
            return False
        for c in lease.chunks:
            self.broker.report_damaged(c.id, error)
        if not self.broker.quarantined(task.step):
            return False
        self._regenerate(task.step)
        return True

    def _regenerate(self, n: int) -> None:
        """Chunks of step ``n`` were quarantined: report them (``state.json`` event ``chunk_quarantined``, metric
        ``exchange/quarantined``), void the step's partition and generate it again, with the same prompts
        (the data cursor after step n-1) and sampling seeds; at most :data:`MAX_REGENERATIONS` times."""
        bad = self.broker.quarantined(n)
        names = "; ".join(f"{d['chunk']} ({d['reason']})" for d in bad)
        log.error("step %d: quarantined %s; step %d is generated again", n, names, n)
        self.state.event("chunk_quarantined", f"step {n}: {names}")
        cur = self.rows.cur.setdefault(n, {})
        cur["exchange/quarantined"] = cur.get("exchange/quarantined", 0.0) + len(bad)
        self.broker.regenerate(n, f"quarantined: {names}")  # its leases are void; late results are dropped
        if self.fixed:  # the engines serve newer weights than step n's by now
            self.state.event("fixed_staleness_broken", f"step {n} generated again on newer weights (damaged chunks)")
        lives = self.gen.void(n)
        self.ready.pop(n, None)
        self.streamed.pop(n, None)
        self.staged.pop(n, None)
        for key in [key for key in self.leases if key == n or (isinstance(key, tuple) and key[1] == n)]:
            del self.leases[key]
        if lives > MAX_REGENERATIONS:
            self.state.fail("controller", None, None, f"step {n}: chunk {names} was quarantined; the step was generated "
                            f"{MAX_REGENERATIONS + 1} times and damaged each time. Fix: check the filesystem under "
                            f"{self.broker.root} (the damaged files are in {self.broker.root / 'quarantine'}), then "
                            f"relax-submit --resume {self.run.path}", kind="task")
            return
        self.gen.regen.add(n)

    # -- results in
    def on_message(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "scale":  # relax-scale: answered now (the connection thread waits for it)
            if Channel.take(msg):
                Channel.answer(msg, self.elastic.ask(msg))
                self._pump()  # an external engine joined (syncing): a catch-up sync writes it a snapshot
            return
        if kind == "engine_join":
            self.elastic.joined(msg)
            return self._pump()
        if kind == "engine_leave":
            self.elastic.left(msg)
            return self._pump()  # a new engine: a catch-up sync if the actor is idle
        if str(msg.get("role", "")).startswith("engine:"):  # an engine host's poll, or its stop done
            return self.elastic.on_message(msg)
        if kind == "chunk_ready":
            with self.tasks.holding(), self.broker.group():
                self._chunk_ready(msg)
            return
        if kind != "task_done":
            return
        t0 = time.perf_counter()
        try:
            # tasks go out once the report's records are durable: one fdatasync for them (announces, a lease, ...)
            with self.tasks.holding(), self.broker.group():
                self._on_task_done(msg)
        finally:
            self.rows.ctl_s += time.perf_counter() - t0

    def _on_task_done(self, msg: dict) -> None:
        task = self.tasks.done(msg["task_id"])
        if task is None or not self.state.running:
            return
        if task.role in self.state.recovering:  # restarted alone, and working again
            self.state.recovered(task.role, time.time())
        if task.kind != "land":  # a push behind the actor's train: the actor was busy all along
            self.rows.freed(task.role)
        if task.kind in ("logprobs", "train") and task.life != self.gen.life(task.step):
            return self._pump()  # its step was voided (damaged chunks) since: it is generated again, this is void
        at = f"step {task.step} {task.kind}" if task.kind not in ("start_engines", "connect") else task.kind
        try:
            res = M.decode_result("sync" if task.kind == "land" else task.kind, msg["result"])  # land: a sync's
        except M.MessageError as e:  # controller and role disagree about the protocol: no restart helps
            self.state.fail(task.role, msg["rank"], self._node(task.role), f"{at}: {e}", kind="task")
            return
        if isinstance(res, M.TaskError):
            if task.kind in ("logprobs", "train") and self._read_failed(task, res.error):
                return self._pump()
            if task.kind == "stage" and res.error.startswith("DamagedChunk:"):  # early π_old only: the train task
                return self._pump()  # reads the step again and reports the damage (the step is generated again)
            if task.kind == "generate" and res.restartable and self._teacher_failed(task, res.error):
                return self._pump()
            # the task's verdict ends the run, unless the machinery broke (a restart of every step may help: what
            # broke may be another role's, e.g. a teacher engine gone, so not the role tier)
            self.state.fail(task.role, msg["rank"], self._node(task.role), f"{at}: {res.error}",
                            kind="role" if res.restartable else "task", alone=False)
            return
        if isinstance(res, (M.GenerateResult, M.LogprobsResult, M.TrainResult, M.SyncResult)) and task.step in self.rows.cur:
            self.rows.cur[task.step].update(res.metrics)  # a step's own metrics
        if isinstance(msg.get("work_s"), (int, float)):  # the role's own time on it
            key = f"perf/task_{task.kind}_time" if task.kind != "logprobs" else f"perf/task_{task.role}_time"
            self.rows.add_time(task.step, key, float(msg["work_s"]))
        getattr(self, f"_{task.kind}_done")(task, res)
        self._pump()

    def _node(self, role: str) -> str | None:
        nodes = self.state.doc["roles"].get(role, {}).get("nodes") or [None]
        return nodes[0]

    def _start_engines_done(self, task: Task, res: M.StartEnginesResult) -> None:
        if task.role in FROZEN_ROLES:  # judges, teachers: frozen, no weight sync; rollout gets them with its tasks
            key = FROZEN_ROLES[task.role]
            setattr(self.boot, key, dict(res.engines))
            self._frozen_known(key, res.engines, res.pids, res.nodes)
            return
        if self.gen.data.get(self.step) is None and res.data_state:  # the cursor step k+1 starts from
            self.gen.data[self.step] = res.data_state
        self.boot.cursor_known = True  # the engines are the controller's steps (they join on their own)
        self._connect()

    def _frozen_known(self, key: str, engines: dict[str, str], pids: dict[str, int] | None = None,
                      nodes: dict[str, str] | None = None) -> None:
        """The judges' or teachers' engines into the log and ``state.json`` (``judges`` / ``teachers``)."""
        log.info("%s: %s", key, ", ".join(f"{n} {u}" for n, u in engines.items()))
        self.state.progress(**{key: {n: {"url": u, "pid": (pids or {}).get(n), "node": (nodes or {}).get(n)}
                                     for n, u in engines.items()}})

    def _follow_done(self, task: Task, res: M.FollowResult) -> None:
        self.boot.followers = {task.role: res.url}
        log.info("%s follows the actor's weights at %s", task.role, res.url)
        if self.refollow == "follow":  # started again alone: the actor's group names its old URL
            self.refollow = "reconnect"
            return
        self._connect()

    def _connect(self) -> None:
        """The weight-sync group, once the run's engines joined (or failed to start), the followers are known and
        rollout is up."""
        b = self.boot
        if (self.registry.live() and b.followers is not None and b.cursor_known and not b.connecting
                and not self.elastic.initial_pending()):
            b.connecting = True
            log.info("engines: %s", ", ".join(f"{n} {u}" for n, u in self.registry.live().items()))
            self.state.progress(engines=self.registry.to_state(), phase="connecting weight sync")
            live = self.registry.live()
            self._assign("actor", self.step, M.ConnectTask(engines=live, load=self.resume.path, followers=b.followers,
                                                           nodes=self.registry.nodes(live) or None))

    def _died(self, task: Task, dead: dict[str, str]) -> None:
        """Engines ``task`` found dead: gone or dead (:meth:`Elastic.lost`), and one of the run's own or a step
        engine started again while ``rollout.engine.max_restarts`` allows; a new one starts from the model on disk
        and rejoins (``ready``) once the next sync has put the weights on it. A report about an engine's earlier
        incarnation (the task had its old URL) is not about the new one."""
        for name, why in dead.items():
            e = self.registry.engines.get(name)
            # only about the engines the task was given, at the URL it was given: the driver also repeats the dead
            # marks of engines it kept from an earlier step (one since started again under a new URL)
            if e is None or (task.engines is not None and task.engines.get(name) != e.url):
                continue
            self.elastic.lost(name, f"found dead: {why}")

    def _connect_done(self, task: Task, res: M.ConnectResult) -> None:
        if self.started:  # a reconnect for a follower started again alone: its catch-up sync follows
            return
        if res.weights:
            log.info("weights: %s", res.weights)
            self.state.event("weights", res.weights)
            self.state.progress(weights=res.weights)  # relax-status and relax-submit --local say it
        if self.resume.path is None:
            self.started = True
        else:  # the engines serve the model on disk: give them the checkpoint's weights first
            self._sync(self.step)

    def _generate_done(self, task: Task, res: M.GenerateResult) -> None:
        n = task.step
        for f in res.engine_failures:
            log.error("step %d: rollout engine %s (%s) died: %s; its requests went to the other engines",
                      n, f["name"], f["url"], f["error"])
        self._died(task, dict(res.dead_engines))
        self._count_engines(task, res)
        for f in res.reward_failures:
            log.warning("step %d: reward failed for sample index=%s group_index=%s (prompt %r, response %r, label %r): "
                        "%s", n, f.get("index"), f.get("group_index"), f.get("prompt"), f.get("response"),
                        f.get("label"), f.get("error"))
        versions = [int(v) for v in res.weight_versions if str(v).isdigit()]
        if versions:
            self.rows.cur[n]["rollout/weight_version"] = float(max(versions))
            self.rows.cur[n]["rollout/weight_version_min"] = float(min(versions))
        self.gen.data[n] = res.data_state
        refs = list(res.chunks)
        for ref in refs:
            self.broker.announce(ref)
        _test_damage(self.broker, n, refs)
        self.broker.end_step(n)
        self.ready[n] = set()
        if self.streamed.pop(n, None) is not None:  # forward roles that took every streamed chunk are done already
            self.ready[n] = {r for r in self.fwd if self._took_all(r, n)}
        self.gen.finished(n)
        if self.fixed:
            self.fixed.rows[n] = dict(self.rows.cur[n])
        self._release_sync()

    def _chunk_ready(self, msg: dict) -> None:
        """Streaming within a step: a chunk of a generate still running is written. Announced now, so the forward
        roles and the actor's π_old pass (``stage``) work on it while the step's later groups are generated. A
        report of a generate no longer in flight (its role started again alone, its step voided) is dropped: the
        next attempt writes its chunks itself."""
        task = self.tasks.pending.get(msg.get("task_id"))
        if task is None or task.kind != "generate" or task.life != self.gen.life(task.step) or not self.state.running:
            return
        ref = ChunkRef.from_dict(msg["chunk"])
        if ref.step != task.step:
            raise ValueError(f"chunk_ready of generate({task.step}) names a chunk of step {ref.step}: {ref.id}")
        if self.broker.announce(ref):
            self.streamed.setdefault(task.step, []).append(ref)
        self._pump()

    def _count_engines(self, task: Task, res: M.GenerateResult) -> None:
        """Each engine's requests (and the step and version of its first), and the run's engine counts (an engine
        found dead at a sync is no longer in the driver's set) into step ``task.step``'s row."""
        n = task.step
        for name, k in res.engine_requests.items():
            e = self.registry.engines.get(name)
            if e is not None and (task.engines or {}).get(name) == e.url:
                e.requests += k
                if e.first_step is None:
                    e.first_step, e.first_version = n, (task.versions or {}).get(name)
        self.rows.cur[n]["rollout/engines_dead"] = float(self.registry.count("dead"))
        self.rows.cur[n]["rollout/engines"] = float(self.registry.count("starting", "syncing", "ready", "draining"))
        self.rows.cur[n]["rollout/engines_ready"] = float(self.registry.count("ready"))

    def _logprobs_done(self, task: Task, res: M.LogprobsResult) -> None:
        for side in res.sides:
            self.broker.add_fields(side)
        self.broker.ack(self.leases.pop((task.role, task.step)).id)
        if not self.streaming:
            self.ready[task.step].add(task.role)
        elif task.step in self.ready and self._took_all(task.role, task.step):  # the step's last chunks
            self.ready[task.step].add(task.role)

    def _took_all(self, role: str, n: int) -> bool:
        """Streaming: whether forward role ``role`` consumed every chunk of step ``n``, which rollout has ended."""
        p = self.broker.progress(role, n)
        return bool(p.get("ended") and p.get("samples") and p["consumed"] == p["samples"])

    def _load_done(self, task: Task, res: M.LoadResult) -> None:
        self.fwd[task.role] = res.step

    def _train_done(self, task: Task, res: M.TrainResult) -> None:
        for why in res.skipped or []:  # train.nonfinite = skip: not applied; train/nonfinite_skipped counts them
            log.warning("step %d: not applied: %s", task.step, why)
            self.state.event("nonfinite_skipped", f"step {task.step}: {why}")
        if self._sync_waits(task.step):  # until the eval (or, fixed, the generate) it waits for is done
            self.held_sync = task.step
            return
        self._sync(task.step)

    def _land_done(self, task: Task, res: M.SyncResult) -> None:
        """train.overlap_sync: step ``task.step``'s push landed (the engines report its version): synced now."""
        self.landing = None
        self._sync_done(task, res)

    def _eval_done(self, task: Task, res: M.EvalResult) -> None:
        n = task.step
        self.evals.done()
        vals = self.metrics.amend(n, res.metrics)  # into step n's row (step 0: a row of its own)
        names = [f"eval/{name}" for name in self.recipe.data.eval_prompt_data if f"eval/{name}" in vals]
        log.info("step %d eval: %s", n, ", ".join(f"{k} {vals[k]:.3f}" for k in names) or "no eval set")
        self._release_sync()

    def _sync_done(self, task: Task, res: M.SyncResult) -> None:
        n = task.step
        land = getattr(task.message, "land", None)
        if res.landing:  # train.overlap_sync: snapshotted; synced when its land comes (_land_done)
            self.landing = n
            return
        if land is not None:  # the actor pushed it in series after all (e.g. adapters by directory)
            self.tasks.done(land)
        self._synced_engines(task, res)
        self.elastic.external.synced(n)  # external engines load the snapshot it wrote (if any)
        if not self.started:  # the resume sync
            self.started = True
            return
        if n <= self.step:  # a catch-up sync for engines started again: the step was synced and logged already
            log.info("engines %s caught up with step %d's weights", ", ".join(sorted(task.engines or {})), n)
            return
        bad = {e: v for e, v in res.engine_versions.items() if v != str(n)}
        if bad:
            log.warning("step %d: engines report other weight versions than %d after the sync: %s", n, n, bad)
        self.broker.ack(self.leases.pop(n).id)  # consumed by every task: the step is cleared; the gate moves
        every = self.recipe.checkpoint.interval  # 0: only after the last step
        save = bool(every and n % every == 0) or n == self.total
        if not self.evals.queue and not self.evals.due(n) and self.stop.outcome is None and self.state.running \
                and not (save and self.recipe.train.offload):  # train.offload: the checkpoint first (_pump_generate)
            self._pump_generate()  # the next generate first (an eval due on these weights would go before it)
        cur = self.rows.close(n)
        cur.update(self.state.health_metrics())  # health/role_restarts, health/recovery_time
        if self.fixed:
            self.fixed.rows.pop(n, None)
        self.step = n
        vals = self.metrics.log(n, cur)
        self.autoscaler.after_step(n, cur["perf/actor_wait_ratio"], cur["perf/rollout_idle_ratio"],
                                   cur.get("rollout/queue_per_engine"))
        self.evals.synced(n)  # if due: on the weights just synced; the pump hands it to rollout before the generate
        first, _ = self.metrics.reward_ends()
        self.state.progress(step=n, reward=vals.get(REWARD), reward_first10=first)
        if save:
            self._checkpoint(n)
        self.gen.forget(n, keep=self.last_ckpt_step or 0)

    def _synced_engines(self, task: Task, res: M.SyncResult) -> None:
        """The engines and followers a sync of step ``task.step`` reached hold its weights now; the ones it found dead
        are left out until started again."""
        for name, why in res.dead_engines.items():
            if self.registry.engines.get(name) is not None and self.registry.engines[name].state != "dead":
                log.error("rollout engine %s (%s) died: %s; the sync went to the other engines", name,
                          self.registry.engines[name].url, why)
        self._died(task, dict(res.dead_engines))
        given = task.engines or {}  # versions of the engines this sync went to (not of one started again since)
        self.registry.synced({e: v for e, v in res.engine_versions.items() if e not in res.dead_engines
                              and e in self.registry.engines and given.get(e) == self.registry.engines[e].url})
        self._engines_changed()
        for role, v in res.follower_versions.items():  # a follower holds step n's weights now
            if v == str(task.step) and not (role == "actor_fwd" and self.refollow is not None):
                self.fwd[role] = task.step  # (not one started again alone since: its old ranks had them)

    def _checkpoint_done(self, task: Task, res: M.CheckpointResult) -> None:
        self.last_ckpt_step = task.step
        every = self.recipe.algorithm.ref_update_interval
        if "reference" in self.fwd and every and task.step % every == 0:  # a refreshed reference (actor_fwd follows
            self._assign("reference", task.step, M.LoadTask(path=res.path))  # the syncs)
        self.state.progress(last_checkpoint={"step": task.step, "path": res.path, "time": time.time()})
        self.state.event("checkpoint", f"step {task.step}: {res.path}")
        if res.metrics:  # perf/save_model_time, into the step's row (logged before the save ended)
            self.metrics.amend(task.step, res.metrics)

    def _stage_done(self, task: Task, res: M.StageResult) -> None:
        cur = self.rows.cur.get(task.step)
        if cur is not None:  # the step's stages, summed
            cur["perf/actor_stage_time"] = cur.get("perf/actor_stage_time", 0.0) + res.metrics.get(
                "perf/actor_stage_time", 0.0)

    def _stop_done(self, task: Task, res: M.StopResult) -> None:
        pass  # the role ends; the loop sees it done

    # -- the end
    def finish(self) -> dict:
        """summary.json and reward.png (whatever the run's outcome); returns the summary. The engines started here
        are stopped and the journal closed even where the summary cannot be written (a full disk)."""
        try:
            first, last = self.metrics.reward_ends()
            summary = self.metrics.finish(self.state.doc, {"engines": self.registry.to_state(),
                                                           "mode": self.recipe.mode})
            if first is not None:
                log.info("%s; summary %s", summary_line(summary), self.run.path / "summary.json")
            self.state.progress(reward_first10=first, reward_last10=last, phase="finished")
        finally:
            try:
                self.elastic.finish()
            finally:
                self.broker.close()
        return summary


def _forward_roles(recipe: Recipe) -> dict[str, int]:
    """The forward roles with work to do (each adds its field to every chunk), each holding the model on disk."""
    from relax_hpc.train.config import reference_from_actor  # LoRA without a reference role: the actor's own π_ref

    return {r: 0 for r, on in (("reference", recipe.algorithm.use_kl_loss and not reference_from_actor(recipe)),
                               ("actor_fwd", recipe.roles.actor_fwd.enabled)) if on}


def _old_fused(recipe: Recipe) -> bool:
    from relax_hpc.train.config import old_from_train_forward  # config only (train/ loads torch)

    return old_from_train_forward(recipe)


def _consumers(fwd: dict[str, int], opd: bool = False, replay: bool = False) -> dict[str, tuple[str, ...]]:
    """What each consuming task reads: train the rollout's fields and the enabled forward roles' side fields, with
    OPD the teacher's log-probs and with routing replay the engine's experts (so a chunk without them is never
    trained on)."""
    train = task_fields("train", (PRODUCER, *fwd)) + (("teacher_log_probs",) if opd else ()) + (
        ("routed_experts",) if replay else ())
    return {"train": train, **{r: LOGPROB_FIELDS for r in fwd}}


def _seq(c: ChunkRef) -> int:
    """A chunk's seq: streamed chunks are named by their place in the step (``rollout.stream_groups``), whatever
    order they were written in."""
    return parse_chunk_file(c.name + ".h5")[1]


def _opd(recipe: Recipe) -> bool:
    return recipe.opd is not None and recipe.opd.enabled


def _external_teachers(recipe: Recipe) -> dict[str, str]:
    """The teacher a run without teacher engines asks (``opd.teacher_url``: its ``/generate`` endpoint, given as
    the engine's URL the client calls ``/generate`` on); none without OPD."""
    url = recipe.opd.teacher_url if _opd(recipe) else None
    return {"opd.teacher_url": url.rstrip("/").removesuffix("/generate")} if url else {}


def _test_damage(broker: Broker, n: int, refs: list[ChunkRef]) -> None:
    """Test hook: ``RELAX_TEST_DAMAGE_CHUNK=<step>:truncate|flip`` damages the first chunk of that step right after
    its announce (``truncate``: half its bytes, found at hand-out; ``flip``: one byte inverted, found by the
    reader's checksum), once per run: not again once a chunk of that step was quarantined."""
    spec = os.environ.get("RELAX_TEST_DAMAGE_CHUNK", "")
    step, _, how = spec.partition(":")
    if not spec or int(step) != n or not refs or any(d["step"] == n for d in broker.damaged()):
        return
    path, size = refs[0].path, refs[0].size
    log.warning("RELAX_TEST_DAMAGE_CHUNK=%s: damaging %s", spec, path)
    if how == "truncate":
        os.truncate(path, size // 2)
    elif how == "flip":
        with open(path, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        raise ValueError(f"RELAX_TEST_DAMAGE_CHUNK={spec!r}: expected <step>:truncate or <step>:flip")
