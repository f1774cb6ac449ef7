"""Elastic rollout: engines added while the run goes, and taken away without losing work (docs/elastic.md).

Why in the controller: it owns the engine registry (:mod:`.engines`), so it alone can say how many engines there
are, which may serve, and when one may leave. A *scale operation* comes from ``relax-scale`` over the control
socket (a ``scale`` question the loop answers at once, :meth:`Elastic.ask`), with an absolute-target meaning:

- ``+N`` / ``-N`` / ``=N``: the number of live engines (plus those asked for and not yet joined) becomes that.
- One operation at a time: a second one is refused, naming the one running, until the first is done.
- Every engine runs :mod:`relax_hpc.roles.engine` and is a unit this class starts, watches and stops. The run's
  own (origin ``initial``, ``engine0`` …, :func:`~relax_hpc.recipe.initial_engines`) are job steps started with
  the attempt (:meth:`Elastic.start_initial`); one that dies is marked ``dead`` and started again as a new step,
  ``rollout.engine.max_restarts`` times at most, and rejoins like a scaled-out one.
- Scale-out starts engines as new job steps on the spare nodes
  of rollout's component (``roles.rollout.elastic``; locally, as processes), or with ``attach`` as a separate
  Slurm job (``relax_hpc/sbatch/attach.sbatch.j2``) on any partition. Each announces itself (``engine_join``) and enters
  the registry as ``syncing``: the actor's next sync puts the current weights on it (the weight-sync group is
  rebuilt with it), and only then is it ``ready`` and given requests. The join time (asked → ready) is logged.
- Scale-in drains: only engines added by scale-out leave (the run's own are protected). A draining engine gets
  no new requests (the rollout driver reads ``RUN_DIR/draining``); once no task holds it (the generate in flight
  ends, a sync that included it is done), or after ``rollout.elastic.drain_timeout_s``, its host is told
  ``stop``. Requests still in flight then fail over to the other engines with their sampling seeds, so each
  sample is still written once. Then its step, or its attached job, ends.
- Capacity that goes away (scancel, preemption, the time limit's signal, a dead node) is not a failure: the
  engine is declared ``gone``, the driver re-issues its requests, and the run goes on.
- ``cancel``: an attached job still pending is withdrawn (``scancel``).
- External engines (origin ``external``: started by anyone, ``relax-scale --attach-url URL --key-file FILE`` or
  ``rollout.external_engines``) are :mod:`.external`'s: they get the weights from disk, not in the group, and
  are drained (``relax-scale --drain URL``, the run's end) or dropped, never stopped.

Every request and outcome is an event in ``state.json`` (``scale`` and ``scale_done``, which notify), and
``state.json``'s ``scale`` lists the operations. When the attempt ends, every engine started here is stopped and
every attached job cancelled: a requeued run comes back with its initial engines only.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

from relax_hpc.backends import Backend
from relax_hpc.controller.channel import Channel
from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.controller.external import External
from relax_hpc.controller.scheduler_polls import SchedulerPolls
from relax_hpc.rollout.external import check_url
from relax_hpc.controller.state import RunState
from relax_hpc.controller.steps import start_engine_step
from relax_hpc.recipe import Recipe
from relax_hpc.rundir import RunDir, write_json

log = logging.getLogger("relax_hpc.controller")
TARGET = re.compile(r"^([+\-=])(\d+)$")
CHECK_JOBS_S = 5.0  # how often pending attached jobs are looked up in Slurm
STOP_WAIT_S = 30.0  # after stop, how long a host may take to report before its engine counts as gone anyway
RESTART = "restart"  # the op of an engine started again after it died (no relax-scale request behind it)
INITIAL = "initial"  # the op of the engines the run starts with


class Capacity(Protocol):
    """How engines are asked of the cluster (``relax_hpc.launch.attach``, given by the launcher to
    :func:`~relax_hpc.controller.run_controller`, as the way back after a requeue is): the controller decides,
    the launcher's side talks to Slurm."""

    def submit_attached(self, recipe: Recipe, run_dir: Any, op: str, names_prefix: str, n: int,
                        attach: dict) -> tuple[str, str | None]: ...  # (job id, partition); ValueError/RuntimeError

    def attached_state(self, job_id: str) -> tuple[str, str | None, bool]: ...  # (state, reason, finished)

    def cancel_attached(self, job_id: str) -> str | None: ...  # None, or why scancel failed


@dataclass
class ScaleOp:
    id: str
    spec: str  # as asked: "+1", "-2", "=3"
    by: str
    target: int
    origin: str  # "step" | "attached" (scale-out), "drain" (scale-in)
    asked_at: float
    engines: list[str] = field(default_factory=list)  # added or drained
    state: str = "running"  # → done | failed | cancelled
    detail: str = ""
    job_id: str | None = None  # the attached job
    ready: dict[str, float] = field(default_factory=dict)  # engine → seconds from asked to ready (joins)
    gone: dict[str, float] = field(default_factory=dict)  # engine → seconds from drain start to gone (drains)
    ended_at: float | None = None


@dataclass
class _Drain:
    since: float
    deadline: float
    op: str | None
    stop_sent: float | None = None
    cut: bool = False  # the drain timed out with requests still in flight: they were re-issued


class Elastic:
    def __init__(self, recipe: Recipe, run: RunDir, registry: EngineRegistry, state: RunState, channel: Channel,
                 backend: Backend, *, holds: Callable[[str], bool], on_change: Callable[[], None],
                 assign: Callable[[str, dict], None], capacity: Capacity | None = None):
        self.recipe, self.run, self.registry, self.state, self.channel = recipe, run, registry, state, channel
        self.backend = backend  # where engine steps run (and whether jobs may be attached)
        self.cap = capacity  # None: no attached jobs (started without a launcher, e.g. a test); steps still start
        self.holds = holds  # whether a task in flight was given this engine
        self.on_change = on_change  # the registry changed (state.json)
        self.assign = assign  # queue a task for a role (the engine hosts' stop)
        self.cfg = recipe.rollout.elastic
        self.ops: list[ScaleOp] = []
        self.expected: dict[str, str] = {}  # engines asked for, not joined yet → their op
        self.procs: dict[str, Any] = {}  # engine → the Popen of its step (srun, or the local process)
        self.jobs: dict[str, str] = {}  # op → attached job id (until cancelled at the end)
        self.draining: dict[str, _Drain] = {}
        self.seen: dict[str, float] = {}  # engine host → its last long poll
        self.restarts: dict[str, int] = {}  # engine → how often it was started again after it died
        self.start_step, self.stop_steps = start_engine_step, self.backend.stop  # how engine steps start and stop (a
        #                          simulation of the loop, tests/controller/loop_sim.py, puts its own in)
        self.fresh = True  # the initial engines serve the run's weights as they start (step 0's: not a resume)
        self.failed_starts: dict[str, str] = {}  # engine of the run's allocation → why it could not be started
        #                                            (its tries used up)
        self.last_jobs_check = 0.0
        self.polls = SchedulerPolls()  # Slurm about attached jobs: every 30 s, sooner after a change
        self._stop_ids = iter(range(1, 1 << 30))
        self.started = False  # the training loop says when engines may join (the initial ones are up)
        self.external = External(run, registry, model_path=str(recipe.model.path), event=self._event,
                                 on_change=on_change,
                                 configured=[dict(x) for x in recipe.rollout.external_engines],
                                 attached=state.doc.get("attached_engines"),  # an earlier attempt's: again
                                 persist=lambda attached: state.progress(attached_engines=attached))
        state.progress(scale=[])  # an earlier attempt's operations ended with it (its engines were stopped)

    # -- questions
    def ask(self, msg: dict) -> dict:
        """A ``scale`` request: accepted (an op id) or refused, with a sentence either way."""
        if msg.get("cancel"):
            return self._cancel(msg["cancel"])
        if msg.get("external") is not None or msg.get("drain_url") is not None:
            return self._external(msg)
        m = TARGET.match(msg["target"].strip())
        if not m:
            return _no(f"target {msg['target']!r}: expected +N, -N or =N (rollout engines)")
        if not self.started or not self.state.running:
            return _no("the run is not ready for scaling yet (its engines are starting) or is ending; try again "
                       "once relax-status shows engines ready")
        busy = self.running()
        if busy is not None:
            return _no(f"scale operation {busy.id} ({busy.spec}, {busy.origin}"
                       f"{', job ' + busy.job_id if busy.job_id else ''}) is still running; wait for it"
                       f"{', or relax-scale --cancel ' + busy.id if busy.origin == 'attached' else ''}")
        sign, n = m.group(1), int(m.group(2))
        now_n = self.count()
        target = {"+": now_n + n, "-": now_n - n, "=": n}[sign]
        if target == now_n:
            return {"accepted": True, "op": None, "message": f"already {now_n} engine(s); nothing to do"}
        attach = msg.get("attach")
        if target > now_n:
            if self.cap is None and attach is not None:
                return _no("this controller was started without a way to submit attached jobs (not by relax-submit)")
            return self._out(msg, target, target - now_n, attach)
        return self._in(msg, target, now_n - target)

    def _out(self, msg: dict, target: int, n: int, attach: dict | None) -> dict:
        cap = self.cfg.max_engines
        if cap is not None and target > cap:
            return _no(f"{target} engines is more than rollout.elastic.max_engines ({cap}). Fix: raise it")
        op = self._new_op(msg, target, "attached" if attach is not None else "step")
        if attach is not None:
            if not self.backend.attaches:
                return self._refuse(op, "--attach needs Slurm (this run is local). Fix: scale without --attach")
            prefix = f"{op.id}-"
            try:
                op.job_id, partition = self.cap.submit_attached(self.recipe, self.run.path, op.id, prefix, n, attach)
            except (ValueError, RuntimeError) as e:
                return self._refuse(op, f"could not submit the attached job: {e}")
            self.polls.changed()  # a new job: worth asking Slurm about soon
            self.jobs[op.id] = op.job_id
            op.engines = [f"{prefix}{k}" for k in range(n)]
            where = f"attached job {op.job_id}" + (f" on partition {partition}" if partition else "")
        else:
            free = self._spare()
            if n > free:
                return self._refuse(op, f"{n} more engine(s) asked, room for {free} in the run's allocation. "
                                        f"Fix: {self.backend.no_room_fix}")
            taken = set(self.registry.engines) | set(self.expected)
            op.engines = []
            k = 0
            while len(op.engines) < n:
                name = f"step{k}"
                k += 1
                if name not in taken:
                    op.engines.append(name)
            for name in op.engines:
                self._start_step(name, op.id, "step")
            where = self.backend.engine_places
        for name in op.engines:
            self.expected[name] = op.id
        op.detail = f"{n} engine(s) as {where}: {', '.join(op.engines)}"
        self._event("scale", f"{op.id} {op.spec} by {op.by}: {op.detail}")
        return {"accepted": True, "op": op.id, "message": f"{op.id}: {op.detail}; they take requests once they "
                f"have the current weights (relax-status shows them)", "job_id": op.job_id}

    def _in(self, msg: dict, target: int, n: int) -> dict:
        removable = [e for e in self.registry.engines.values()
                     if e.origin != "initial" and e.state in ("starting", "syncing", "ready")]
        op = self._new_op(msg, target, "drain")
        if len(removable) < n:
            protected = self.registry.count("starting", "syncing", "ready") - len(removable)
            return self._refuse(op, f"only {len(removable)} engine(s) were added by scale-out; the run's own "
                                    f"{protected} are protected from scale-in. Fix: a target of at least {protected}")
        chosen = sorted(removable, key=lambda e: e.since, reverse=True)[:n]  # the newest first
        op.engines = [e.name for e in chosen]
        for e in chosen:
            self.drain(e.name, f"{op.id} {op.spec}", op.id)
        op.detail = f"draining {', '.join(op.engines)}"
        self._event("scale", f"{op.id} {op.spec} by {op.by}: {op.detail}")
        return {"accepted": True, "op": op.id, "message": f"{op.id}: {op.detail} (requests in flight finish "
                f"within rollout.elastic.drain_timeout_s = {self.cfg.drain_timeout_s:g} s, or are re-issued)"}

    def _external(self, msg: dict) -> dict:
        """``relax-scale --attach-url URL --key-file FILE`` (``external``: {url, key_file}) or ``--drain URL``."""
        if not self.started or not self.state.running:
            return _no("the run is not ready for scaling yet (its engines are starting) or is ending; try again "
                       "once relax-status shows engines ready")
        busy = self.running()
        if busy is not None:
            return _no(f"scale operation {busy.id} ({busy.spec}, {busy.origin}) is still running; wait for it")
        ext = msg.get("external")
        if ext is not None:
            if not isinstance(ext, dict) or not isinstance(ext.get("url"), str) or \
                    not isinstance(ext.get("key_file"), str):
                return _no("external: expected {url, key_file} (relax-scale --attach-url URL --key-file FILE)")
            op = self._new_op({**msg, "target": f"attach-url {ext['url']}"}, self.count() + 1, "external")
            name, why = self.external.add(ext["url"], ext["key_file"], op.by, keep=True)
            if name is None:
                return self._refuse(op, why)
            op.engines, op.detail = [name], f"{name} at {self.registry.engines[name].url} (external)"
            self._event("scale", f"{op.id} {op.spec} by {op.by}: {op.detail}")
            return {"accepted": True, "op": op.id, "message": f"{op.id}: {why}"}
        try:
            url = check_url(msg["drain_url"]) if isinstance(msg.get("drain_url"), str) else None
        except ValueError as e:
            return _no(str(e))
        hit = [e for e in self.registry.engines.values()
               if e.url == url and e.state in ("starting", "syncing", "ready")]
        if not hit:
            return _no(f"no engine of this run serves at {msg.get('drain_url')!r}; relax-status lists them")
        if hit[0].origin != "external":
            return _no(f"{hit[0].name} at {url} is the run's own ({hit[0].origin}). Fix: relax-scale RUN rollout=-N "
                       "drains engines added by scale-out")
        op = self._new_op({**msg, "target": f"drain {url}"}, self.count() - 1, "drain")
        op.engines = [hit[0].name]
        if hit[0].state == "ready":
            self.drain(hit[0].name, f"{op.id} {op.spec}", op.id)
            op.detail = f"draining {hit[0].name} (external: it keeps running)"
        else:  # still loading the weights from disk: no request was sent to it, so it is gone at once
            self.registry.gone(hit[0].name, f"{op.id} {op.spec}: drained before it had the weights; it keeps running")
            self.external.dropped(hit[0].name)
            self.on_change()
            op.detail = f"{hit[0].name} left before it had the weights (external: it keeps running)"
        self._event("scale", f"{op.id} {op.spec} by {op.by}: {op.detail}")
        return {"accepted": True, "op": op.id, "message": f"{op.id}: {op.detail}"}

    def _cancel(self, op_id: str) -> dict:
        op = next((o for o in self.ops if o.id == op_id), None)
        if op is None:
            return _no(f"no scale operation {op_id!r}; relax-status --json lists them under 'scale'")
        if op.state != "running" or op.origin != "attached":
            return _no(f"{op_id} is {op.state}, {op.origin}: only a running attached request can be cancelled")
        joined = [n for n in op.engines if n in self.registry.engines]
        if joined:
            return _no(f"{op_id}'s engines {', '.join(joined)} have joined already. Fix: relax-scale RUN "
                       f"rollout=-{len(joined)} drains them")
        err = self.cap.cancel_attached(op.job_id) if op.job_id and self.cap is not None else None
        for n in op.engines:
            self.expected.pop(n, None)
        self._end(op, "cancelled", f"withdrawn (scancel {op.job_id}{': ' + err if err else ''})")
        return {"accepted": True, "op": op.id, "message": f"{op.id} cancelled: attached job {op.job_id} withdrawn"}

    # -- engines arriving and leaving
    def joined(self, msg: dict) -> None:
        name, op_id = msg["name"], msg["op"]
        op = next((o for o in self.ops if o.id == op_id), None)
        asked = self.expected.pop(name, None)
        if asked is None or (op is None and asked not in (RESTART, INITIAL)) or not self.state.running:
            log.warning("engine %s (op %s) joined, but it was not asked for (or was given up): told to stop", name,
                        op_id)
            self._stop(name, "not expected")
            return
        job, _, step = msg["slurm_step"].partition(".")
        before = self.registry.engines.get(name)  # its earlier life, when started again: keep its counts
        ready = asked == INITIAL and self.fresh  # the model on disk is step 0's weights: what step 1 needs
        e = self.registry.add(name, msg["url"], origin=msg["origin"], node=msg["node"], pid=msg["pid"],
                              job_id=job or "local", step_id=step or None, state="ready" if ready else "syncing",
                              weight_version="0")
        e.restarts = self.restarts.get(name, 0)
        if before is not None and asked == RESTART:
            e.requests, e.first_step, e.first_version = before.requests, before.first_step, before.first_version
        self.seen[name] = time.time()
        log.info("engine %s joined (%s, %s, op %s) at %s%s", name, msg["origin"], msg["slurm_step"] or "local",
                 op_id, msg["url"], "" if ready else "; it takes requests after the next sync")
        self.on_change()

    def left(self, msg: dict) -> None:
        """Its host was signalled: the time limit is near (drain), or it is going now (gone at once)."""
        name, why = msg["name"], msg["why"]
        e = self.registry.engines.get(name)
        if e is None or e.state in ("gone", "dead"):
            return
        if msg["now"]:
            self.lost(name, f"left: {why}")
        elif e.state != "draining":
            self.drain(name, f"its host asked: {why}", None)

    def lost(self, name: str, why: str) -> None:
        """An engine that went away. Capacity taken back (scancel, preemption, a dead node, an attached or step
        engine that died): gone, not a failure. One of the run's own (initial): dead, with why. A step or initial
        engine is then started again (not an attached one: its job's capacity went away)."""
        if name in self.draining and self.draining[name].stop_sent is not None:  # stopped by its drain: expected
            return self._gone_drained(name)
        e = self.registry.engines.get(name)
        own = e is not None and e.origin == "initial" and name not in self.draining
        if self.registry.mark_dead(name, why) if own else self.registry.gone(name, why):
            self.draining.pop(name, None)
            if own:
                log.error("rollout engine %s (%s) died: %s", name, e.url, why)
            else:
                self._event("engine_gone", f"{name}: {why}; its requests in flight go to the other engines")
            if e is not None and e.origin == "external":
                self.external.dropped(name)
            self._write_draining()
            self.on_change()
            if e.origin in ("initial", "step"):
                self._restart_step(name, e.restarts, why)

    def _restart_step(self, name: str, restarts: int, why: str) -> bool:
        """A step or initial engine that died (not drained) is started again as a new step,
        ``rollout.engine.max_restarts`` times at most; it joins like a scaled-out engine (syncing until a sync
        reaches it)."""
        limit = self.recipe.rollout.engine.max_restarts
        if not self.state.running or restarts >= limit:
            if restarts >= limit:
                log.error("rollout engine %s stays dead: started again %d times already (rollout.engine.max_restarts)",
                          name, limit)
            return False
        old = self.procs.pop(name, None)  # (already ended, when its start failed)
        if old is not None:
            self.stop_steps([old], grace_s=2.0)
        origin = self.registry.engines[name].origin if name in self.registry.engines else INITIAL
        self._start_step(name, RESTART, origin)
        self.expected[name] = RESTART
        self.restarts[name] = restarts + 1
        self._event("engine_restart", f"{name} dead ({why}); starting it again as a new step ({restarts + 1}/{limit})")
        return True

    def start_initial(self, names: list[str], fresh: bool) -> None:
        """The run's own engines, each a step of its own; ``fresh``: a new run's (ready as they join: the model
        on disk is step 0's weights), else a resumed one's (syncing until the resume sync)."""
        self.fresh = fresh
        for name in names:
            self._start_step(name, INITIAL, INITIAL)
            self.expected[name] = INITIAL
        log.info("rollout engines: starting %s as step(s) of their own", ", ".join(names))

    def own_starting(self) -> bool:
        """Whether an engine of the run's allocation is being started (again): a generate with no engine ready
        waits for it instead of failing."""
        return any(op in (INITIAL, RESTART) for op in self.expected.values())

    def initial_pending(self) -> bool:
        """Whether an engine the run starts with has neither joined nor failed to start (tries used up)."""
        return any(op in (INITIAL, RESTART) and n not in self.registry.engines for n, op in self.expected.items())

    def drain(self, name: str, why: str, op: str | None) -> None:
        now = time.time()
        self.registry.move(name, "draining")
        self.draining[name] = _Drain(now, now + self.cfg.drain_timeout_s, op)
        log.info("engine %s drains (%s): no new requests", name, why)
        self._write_draining()
        self.on_change()

    def on_message(self, msg: dict) -> None:
        """A message of an engine host (role ``engine:<name>``): its long polls (signs of life), its stop done."""
        name = msg["role"].split(":", 1)[1]
        self.seen[name] = time.time()
        if msg["type"] == "task_done" and name in self.draining:
            self._gone_drained(name)

    # -- every turn of the loop
    def tick(self) -> None:
        now = time.time()
        for name, d in list(self.draining.items()):
            ext = name in self.registry.engines and self.registry.engines[name].origin == "external"
            if ext and (not self.holds(name) or now >= d.deadline):  # no stop: the run does not own it
                d.cut = self.holds(name)
                self._gone_drained(name, "; it keeps running (an external engine is never stopped)")
                continue
            if d.stop_sent is None:
                held = self.holds(name)
                if held and now < d.deadline:
                    continue
                d.cut = held
                self._stop(name, "drained" if not held else "drain timeout")
                d.stop_sent = now
            elif self._host_ended(name) or now - d.stop_sent > STOP_WAIT_S:
                self._gone_drained(name)
        for name, p in list(self.procs.items()):  # a step engine whose host exited
            if p.poll() is not None:
                del self.procs[name]
                why = f"its step exited with code {p.returncode} before it joined (see " \
                      f"{self.run.logs / (name + '.host.log')} and {self.run.logs / (name + '.log')})"
                if self.expected.get(name) in (INITIAL, RESTART):  # one of the run's own, or one started again
                    self.expected.pop(name)
                    n = self.restarts.get(name, 0)
                    if not self._restart_step(name, n, why):
                        self.failed_starts[name] = why
                        log.error("rollout engine %s: %s", name, why)
                elif name in self.expected:
                    self._join_failed(name, why)
                elif name in self.registry.engines and name not in self.draining:
                    self.lost(name, f"its step exited with code {p.returncode}")
        silent = self.recipe.logging.heartbeat_timeout_s
        for name, t in list(self.seen.items()):
            e = self.registry.engines.get(name)
            if e is not None and e.state not in ("gone", "dead") and now - t > silent:
                self.lost(name, f"its host is silent for {now - t:.0f} s (a dead node?)")
        if self.started and self.state.running and self.external.configured:
            self.external.join_configured()
        self.external.tick(self.lost)
        if now - self.last_jobs_check > CHECK_JOBS_S:
            self.last_jobs_check = now
            self._check_pending(now)
        self._progress(now)

    def _check_pending(self, now: float) -> None:
        ask, t0 = self.polls.due(now), time.monotonic()  # Slurm is asked when polls allow, once per job
        states: dict[str, tuple[str, str | None, bool]] = {}
        for name, op_id in list(self.expected.items()):
            op = next((o for o in self.ops if o.id == op_id), None)
            if op is None:  # a step engine started again: its step's exit is watched in tick
                continue
            if now - op.asked_at > self.cfg.join_timeout_s:
                if op.job_id:
                    self.cap.cancel_attached(op.job_id)
                self._join_failed(name, f"did not join within rollout.elastic.join_timeout_s = "
                                        f"{self.cfg.join_timeout_s:g} s")
            elif op.job_id and ask:
                if op.job_id not in states:
                    states[op.job_id] = self.cap.attached_state(op.job_id)
                st, reason, finished = states[op.job_id]
                if finished:
                    self._join_failed(name, f"attached job {op.job_id} ended {st}{' (' + reason + ')' if reason else ''}"
                                            f" before its engine joined (see {self.run.logs}/attach-{op.id}-*.out)")
        if states:
            self.polls.done(now, time.monotonic() - t0)

    def _progress(self, now: float) -> None:
        """Ops whose engines all arrived (ready) or left (gone) are done; join and drain times recorded."""
        for op in self.ops:
            if op.state != "running":
                continue
            if op.origin == "drain":
                if all(n not in self.draining for n in op.engines):
                    self._end(op, "done", "drained: " + ", ".join(f"{n} in {op.gone.get(n, 0):.1f} s"
                                                                   for n in op.engines))
                continue
            for n in op.engines:
                e = self.registry.engines.get(n)
                if e is not None and e.state == "ready" and n not in op.ready:
                    op.ready[n] = now - op.asked_at
                    log.info("engine %s is ready with weights of step %s, %.1f s after %s was asked", n,
                             e.weight_version, op.ready[n], op.id)
            waiting = [n for n in op.engines if n in self.expected or (n in self.registry.engines and n not in
                       op.ready and self.registry.engines[n].state in ("starting", "syncing"))]
            if not waiting:
                ok = [n for n in op.engines if n in op.ready]
                self._end(op, "done" if ok else "failed",
                          (f"ready: {', '.join(f'{n} in {op.ready[n]:.1f} s' for n in ok)}" if ok else "no engine joined")
                          + (f"; {op.detail}" if op.detail and not ok else ""))

    # -- the end of the attempt
    def finish(self) -> None:
        """Stop every engine started here, cancel every attached job: they belong to this attempt. External engines
        are drained (the run is over: nothing is sent to them any more), never stopped."""
        for name in self.external.finish():
            self.draining.pop(name, None)
            self.registry.gone(name, "drained at the end of the run; it keeps running (an external engine is never "
                                     "stopped)")
            self.external.dropped(name)
            self._event("engine_gone", f"{name} ({self.registry.engines[name].url}): drained at the end of the run, "
                                       "still running")
            self.on_change()
        self.stop_steps(list(self.procs.values()), grace_s=5.0)
        for op_id, job in self.jobs.items():
            err = self.cap.cancel_attached(job)
            if err:
                log.warning("could not cancel attached job %s of %s: %s", job, op_id, err)
        self.procs.clear()
        self.jobs.clear()

    # -- helpers
    def running(self) -> ScaleOp | None:
        return next((o for o in self.ops if o.state == "running"), None)

    def count(self) -> int:
        """Engines that serve or will: live in the registry, plus those asked for and not yet joined."""
        return self.registry.count("starting", "syncing", "ready") + len(self.expected)

    def _spare(self) -> int:
        """Room for more step engines: the spare nodes' engines under Slurm (``roles.rollout.elastic``); locally
        ``rollout.elastic.max_engines`` in all, or a few step engines
        (:meth:`~relax_hpc.backends.Backend.spare_engines`)."""
        steps = [n for n, e in self.registry.engines.items() if e.origin == "step" and e.state not in ("gone", "dead")]
        used = len(steps) + sum(1 for n in self.expected if n.startswith("step"))
        return self.backend.spare_engines(self.recipe, used, self.count())

    def _start_step(self, name: str, op: str, origin: str) -> None:
        """Engine ``name`` as a new step on rollout's component; one added by scale-out goes off the nodes of the
        run's own engines (onto the spare ones ``roles.rollout.elastic`` reserved)."""
        spare = self.backend.spares_apart(self.recipe)
        exclude = sorted({e.node for e in self.registry.engines.values()
                          if e.origin == "initial" and e.node}) if origin == "step" and spare else []
        self.procs[name] = self.start_step(self.recipe, self.run.path, self.backend, name, origin, op, exclude)

    def _new_op(self, msg: dict, target: int, origin: str) -> ScaleOp:
        by = msg.get("by") or "relax-scale"
        op = ScaleOp(id=f"s{len(self.ops) + 1}", spec=msg["target"].strip(),
                     by=f"{by} ({msg['why']})" if msg.get("why") else by,  # the autoscaler says why
                     target=target, origin=origin, asked_at=time.time())
        self.ops.append(op)
        return op

    def _refuse(self, op: ScaleOp, why: str) -> dict:
        self._end(op, "failed", why, quiet=True)
        self._event("scale", f"{op.id} {op.spec} by {op.by} refused: {why}")
        return _no(why)

    def _end(self, op: ScaleOp, state: str, detail: str, quiet: bool = False) -> None:
        op.state, op.detail, op.ended_at = state, detail, time.time()
        if not quiet:
            self._event("scale_done", f"{op.id} {op.spec} {state}: {detail}")
        self._save()

    def _join_failed(self, name: str, why: str) -> None:
        op_id = self.expected.pop(name, None)
        log.error("engine %s (%s) will not join: %s", name, op_id, why)
        op = next((o for o in self.ops if o.id == op_id), None)
        if op is not None:
            op.detail = f"{name}: {why}"

    def _stop(self, name: str, why: str) -> None:
        self.assign(f"engine:{name}", {"id": next(self._stop_ids), "kind": "stop", "why": why})

    def _host_ended(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is not None

    def _gone_drained(self, name: str, more: str = "") -> None:
        d = self.draining.pop(name, None)
        if d is None:
            return
        took = time.time() - d.since
        why = f"drained in {took:.1f} s" + ("; requests still in flight at the timeout were re-issued" if d.cut else "")
        self.registry.gone(name, why + more)
        self.external.dropped(name)
        op = next((o for o in self.ops if o.id == d.op), None)
        if op is not None:
            op.gone[name] = took
        log.info("engine %s is gone: %s", name, why)
        self._write_draining()
        self.on_change()

    def _write_draining(self) -> None:
        """``RUN_DIR/draining``: the engines the driver must send no new request to (it re-reads it when it
        changes)."""
        write_json(self.run.draining, sorted(self.draining))

    def _event(self, name: str, detail: str) -> None:
        log.info("%s: %s", name, detail)
        self.state.event(name, detail)
        self._save()

    def _save(self) -> None:
        self.state.progress(scale=[asdict(o) for o in self.ops[-20:]])


def _no(why: str) -> dict:
    return {"accepted": False, "op": None, "message": why}


class Autoscaler:
    """``rollout.elastic.autoscale``: scale operations decided on the run's own signals, after every synced step,
    through the same :meth:`Elastic.ask` as ``relax-scale`` (attached jobs too, with ``attach: true``).

    - **Scale out** when the trainer waited for samples (train(N) handed out only after its samples existed) more
      than ``scale_out_wait_ratio`` of the step interval, ``window`` steps in a row: rollout is the bottleneck. Or,
      with ``scale_out_queue_per_engine`` set, when more requests than that waited per engine for a free slot
      (``rollout/queue_per_engine``, the mean over the step's generate), ``window`` steps in a row, while rollout
      did not sit idle at the staleness gate (then the trainer is the bottleneck, however long the queue).
    - **Scale in** when rollout sat idle at the staleness gate (it could not start the next step: the trainer is
      the bottleneck) more than ``scale_in_idle_ratio`` of the step interval, ``window`` steps in a row.
    - Never beyond ``max`` or below ``min``, ``step`` engines at a time, not while another operation runs, and not
      within the cooldown after the last one. Each decision is a ``scale`` event whose ``by`` carries the reason.
    """

    def __init__(self, elastic: Elastic) -> None:
        self.el = elastic
        self.cfg = elastic.cfg.autoscale
        self.out_streak = self.in_streak = 0
        self.last_action = 0.0  # time.time() of the last operation it asked for
        self.low: int | None = self.cfg.min  # null: the engines the run starts with (known once they are up)

    def after_step(self, n: int, actor_wait: float, rollout_idle: float, queue: float | None = None) -> dict | None:
        """Step ``n``'s signals: the waits as shares of its step interval, ``queue`` as requests per engine (None:
        not measured); the operation asked for, if any."""
        c = self.cfg
        if not c.enabled or not self.el.started:
            return None
        if self.low is None:
            self.low = max(1, self.el.count())
        waited = actor_wait > c.scale_out_wait_ratio
        # a queue says the engines are busy, not that rollout is the bottleneck: not while rollout waits at the gate
        queued = (c.scale_out_queue_per_engine is not None and queue is not None
                  and queue > c.scale_out_queue_per_engine and rollout_idle <= c.scale_in_idle_ratio)
        self.out_streak = self.out_streak + 1 if waited or queued else 0
        self.in_streak = self.in_streak + 1 if rollout_idle > c.scale_in_idle_ratio else 0
        ops = self.el.ops
        if ops and ops[-1].state == "running":
            return None
        since = time.time() - max(self.last_action, ops[-1].asked_at if ops else 0.0)  # relax-scale's count too
        have = self.el.count()
        if self.out_streak >= c.window and have < c.max and since >= c.scale_out_cooldown_s:
            k = min(c.step, c.max - have)
            why = (f"step {n}: the trainer waited for samples {actor_wait:.0%} of the step interval, over "
                   f"{c.scale_out_wait_ratio:.0%}" if waited else
                   f"step {n}: {queue:.1f} requests per engine waited for a free slot, over "
                   f"{c.scale_out_queue_per_engine:g}") + f", for {self.out_streak} step(s)"
            return self._ask(f"+{k}", why)
        if self.in_streak >= c.window and have > self.low and since >= c.scale_in_cooldown_s:
            k = min(c.step, have - self.low)
            why = (f"step {n}: rollout sat idle at the staleness gate {rollout_idle:.0%} of the step interval, over "
                   f"{c.scale_in_idle_ratio:.0%} for {self.in_streak} step(s)")
            return self._ask(f"-{k}", why)
        return None

    def _ask(self, target: str, why: str) -> dict:
        self.out_streak = self.in_streak = 0
        self.last_action = time.time()
        attach = {} if self.cfg.attach and target.startswith("+") else None
        reply = self.el.ask({"type": "scale", "target": target, "attach": attach, "cancel": None, "by": "autoscaler",
                             "why": why})
        log.info("autoscaler: %s: %s: %s", target, why, reply["message"])
        return reply

