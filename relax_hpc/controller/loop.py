"""The controller loop: start the role steps, serve the control socket, watch heartbeats and exits, keep
``state.json`` current, and finish. It never waits without a timeout, so a dead role fails the run
instead of hanging it.

With ``model.path`` set, the training loop (:class:`~relax_hpc.controller.training.TrainingLoop`: generate
→ train → sync in either mode, metrics, summary, resume from ``checkpoints/latest``) rides on the same loop: it sees every
message and hands out tasks; without it the roles only bootstrap.

Surviving the cluster (``docs/controller.md``, "Surviving the cluster"):

* SIGUSR2 (``--signal=B:USR2@lead``, the time limit is near) or ``relax-cancel --checkpoint/--requeue``:
  the step in flight finishes, the actor checkpoints, then the attempt ends REQUEUED (and comes back, see
  :mod:`.requeue`) or the run ends CANCELLED.
* SIGTERM (scancel, or preemption: Slurm signals the steps too and kills after KillWait): stop now; a
  preempted job is requeued by Slurm and resumes from the last checkpoint.
* A step that crashes, is killed or hangs (no heartbeat), two tiers (docs/reliability.md): a role other than
  the actor is started again alone (role tier: a new job step in the same allocation, or new local processes;
  :func:`_restart_alone`), rejoins and is given back the work it held, while the actor and the engines keep their
  processes, memory and weights, at most ``health.max_role_restarts`` times per try. The actor's failure, or a role
  failing again within ``health.window_s`` of its restart alone (global tier): every step is stopped and started
  again from the latest checkpoint, at most ``checkpoint.max_restarts`` times per attempt. A task's own verdict
  (a reward that raised, no engine alive) fails the run at once: doing it again would end the same way; so
  does a role's error that will repeat (bad data, a user function that does not load: ``relax_hpc.errors``).
* A full disk: any write that fails for want of space (the controller's, or a role's report) fails the run at
  once, naming the mount point; state.json records it in the run directory's reserve (blocks held from the
  start, so no role still writing can take them first), and what the reserve had beyond it is freed for
  summary.json and the events. Each step of the end runs whatever the one before it did, and none hides the first cause.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from relax_hpc import forkserver
from relax_hpc.controller import recipe_copy
from relax_hpc.backends import Backend, backend_from_env
from relax_hpc.controller.channel import Channel
from relax_hpc.controller.elastic import Capacity
from relax_hpc.controller.training import TrainingLoop
from relax_hpc.controller.procs import StepProcess, stop_steps
from relax_hpc.controller.requeue import RequeueJob, Resubmit, come_back
from relax_hpc.controller.signals import Signals
from relax_hpc.controller.state import COMPLETED, FAILED, REQUEUED, RunState
from relax_hpc.controller.steps import pythonpath, step_command, step_commands
from relax_hpc.errors import no_space
from relax_hpc.ops.metrics import summary_line
from relax_hpc.ops.notify import EVENTS, Notifier, notify_urls
from relax_hpc.recipe import Recipe, role_steps
from relax_hpc.rundir import RunDir, write_json

log = logging.getLogger("relax_hpc.controller")
TICK_S = 0.2  # how long the loop waits for messages before it checks exits, silence and signals
STOP_GRACE_S = 10.0
LEVELS = {"failed": "failure", "finished": "success", "preempted": "warning", "step_restarted": "warning",
          "engine_gone": "warning", "role_restarted": "warning",
          "cancelled": "warning"}


class RunFailed(RuntimeError):
    """The run ended FAILED or CANCELLED; the message is state.json's reason."""


class RunLocked(RuntimeError):
    """Another controller is running this run; this one touched nothing."""


@contextlib.contextmanager
def _only_controller(run: RunDir) -> Iterator[None]:
    """An exclusive ``flock`` on ``RUN_DIR/controller.lock`` for the life of this controller, taken before
    anything is written: a second controller of the same run (a job Slurm requeued while its continuation job
    runs, a ``--resume`` of a live run) stops at once instead of overwriting ``state.json`` and
    ``controller.json`` under the live one. Best effort where the filesystem has no flock."""
    fd = os.open(run.path / "controller.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live = run.read_json(run.controller_addr, {}) or {}
            raise RunLocked(f"another controller is running {run.path} (pid {live.get('pid')} on "
                            f"{live.get('host')}, see controller.json); this one stops without touching the run. "
                            f"Fix: relax-status {run.name}; relax-cancel it first if it should not run") from None
        except OSError:
            pass  # no flock here (some network filesystems): the journal's own lock still guards the data
        yield
    finally:
        os.close(fd)


def run_controller(run_dir: str | os.PathLike, *, requeue_job: RequeueJob | None = None,
                   resubmit: Resubmit | None = None, capacity: Capacity | None = None) -> dict:
    """Run the job's roles to the end; return the final state. Raises :class:`RunFailed` with the reason.

    ``requeue_job`` and ``resubmit``: how a REQUEUED attempt comes back under Slurm, from the launcher
    (:mod:`.requeue`). ``capacity``: how relax-scale's engines are started (``relax_hpc.launch.attach``, from the
    launcher); without it the run cannot scale out."""
    run = RunDir(Path(run_dir).resolve())
    handlers = _log_to(run.logs / "controller.log")
    try:
        with _only_controller(run):
            return _run(run, requeue_job, resubmit, capacity)
    finally:
        for h in handlers:
            logging.getLogger("relax_hpc").removeHandler(h)
            h.close()


def _run(run: RunDir, requeue_job: RequeueJob | None, resubmit: Resubmit | None, capacity: Capacity | None) -> dict:
    recipe, backend = recipe_copy.load(run), backend_from_env()  # with its secrets (RUN/secrets.json)
    if not run.ensure_reserve():  # gone after a full disk (or a run made before it existed): made again
        log.warning("could not reserve space in %s (is its filesystem full?): a full disk may end this run "
                    "without state.json saying so", run.path)
    notifier = Notifier(notify_urls(recipe.logging.notify_urls), run.name)
    restart = False
    # held through the cleanup too: a second Ctrl-C must not cut the stop short
    with Signals() as sig, _fork_server(run, recipe, backend):
        while True:
            state = RunState(run, recipe, role_steps(recipe), backend, restart=restart)
            state.on_event = lambda name, detail: name in EVENTS and notifier.send(
                name, detail, LEVELS.get(name, "info"))
            if not restart:
                state.event("started", f"attempt {state.doc['attempt']}, job {state.doc['job_id']} ({backend.name})")
            _attempt(run, recipe, backend, state, sig, capacity)
            restart = state.will_restart  # state.json said RUNNING (phase restarting) throughout: no end to watchers
            if not restart:
                break
            state.restarting_all(time.time())
            state.event("step_restarted", f"{state.doc['reason']}; restarting every step from the latest "
                        f"checkpoint ({state.doc['restarts'] + 1}/{recipe.checkpoint.max_restarts}; global tier)")
            state.write()
    doc = state.doc
    if doc["state"] == REQUEUED:
        if doc["attempt"] >= recipe.slurm.max_requeues:
            state.give_up(f"{doc['reason']}, but this was attempt {doc['attempt']} and slurm.max_requeues is "
                          f"{recipe.slurm.max_requeues}: not coming back. Fix: raise slurm.max_requeues, then "
                          f"relax-submit --resume {run.path}")
        else:
            state.event("requeued", doc["reason"])
            state.write()
            try:
                # locally, and mostly on Slurm, this does not return
                state.doc["requeue"] = come_back(run, recipe, backend, requeue_job, resubmit)
                state.write()
                return state.doc
            except Exception as e:  # neither requeue nor a continuation: say so instead of waiting for ever
                state.give_up(f"{doc['reason']}; coming back failed: {type(e).__name__}: {e}. Fix: "
                              f"relax-submit --resume {run.path}")
    if doc["state"] == COMPLETED:
        state.event("finished", _summary_line(run))
    else:
        state.event("failed" if doc["state"] == FAILED else "cancelled", doc["reason"] or "")
    state.write()
    if doc["state"] != COMPLETED:
        raise RunFailed(doc["reason"])
    return doc


@contextlib.contextmanager
def _fork_server(run: RunDir, recipe: Recipe, backend: Backend) -> Iterator[None]:
    """Where the backend allows it (locally, without a GPU), the steps and engines of the run are forked from a
    server of the run that imports torch, Megatron and transformers once (:mod:`relax_hpc.forkserver`): a role
    restarted alone or an engine added starts in a second. The server is this process's child, so the run's
    processes are still its descendants (``relax-cancel`` finds them by parent links)."""
    if not backend.forks:
        yield
        return
    env = {**os.environ, **recipe.slurm.env, "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH"))}
    with forkserver.serving(run.logs / "forkserver.log", env=env) as address:
        if address:
            log.info("fork server %s (log: %s)", address, run.logs / "forkserver.log")
        yield


def _attempt(run: RunDir, recipe: Recipe, backend: Backend, state: RunState, sig: Signals,
             capacity: Capacity | None = None) -> None:
    """Start the steps, run until the state is final, stop the steps."""
    host = backend.control_host(os.environ)
    steps = [StepProcess(c, run.path) for c in step_commands(recipe, run.path, backend)]
    channel = Channel(run.token(), bind_host=backend.bind_host)  # a new port per attempt: no stragglers
    log.info("run %s: executor %s, control socket %s:%d", run.name, backend.name, host, channel.port)
    train = None
    try:
        write_json(run.controller_addr, {"host": host, "port": channel.port, "pid": os.getpid()})
        train = TrainingLoop(recipe, run, state, channel, backend, capacity) if recipe.model.path else None
        state.recover_on_ready = train is None  # with a training loop a role has recovered when it works again
        state.write()  # this attempt (and restart count) is on disk before any role can read it
        for s in steps:
            log.info("starting %s: %s", s.role, " ".join(s.cmd.procs[0].argv))
            s.start()
            state.step_started(s.role, time.time())
        while state.running:
            codes = {s: s.poll() for s in steps}  # polled first: a rank's last message precedes its exit
            for now, msg in channel.drain(TICK_S):
                if msg["type"] == "control":
                    requeue = msg["action"] == "checkpoint_requeue"
                    _on_stop(state, train, "requeue" if requeue else "cancel",
                             "relax-cancel --requeue" if requeue else "relax-cancel --checkpoint")
                    continue
                if msg["type"] == "scale" and train is None and channel.take(msg):
                    channel.answer(msg, {"accepted": False, "message": "this run has no training loop (no "
                                         "model.path): nothing to scale"})
                state.apply(now, msg)
                if train is not None:
                    train.on_message(msg)
            for s, code in codes.items():
                if code is not None:
                    state.step_exited(s.role, code, s.last_line() if code else "")
            state.check_silence(time.time(), recipe.logging.heartbeat_timeout_s)
            # a signal first: a cancel's SIGTERM reaches the roles' process group too, and roles that died of it
            # are not failures to restart alone (a role started now would outlive the cancel)
            name = sig.take()
            if name == "SIGUSR2":
                _on_stop(state, train, "requeue", "SIGUSR2: the time limit is near")
            elif name:
                _on_interrupt(run, state, backend, name)
            alone = state.take_alone()
            if alone and state.running and _cancel_requested(run):  # the cancel's signal reached them first
                state.cancel(f"relax-cancel: {', '.join(sorted(alone))} stopped by the cancel")
            for role, failure in alone.items() if state.running else ():  # role tier: this role alone, the others go on
                _restart_alone(run, recipe, backend, state, steps, train, role, failure)
            roles_up = all(r["phase"] in ("ready", "done") for r in state.doc["roles"].values())
            if state.doc["health"]["pending"] and (train.started if train is not None else roles_up):
                state.recovered_all(time.time())  # after a global restart: working again
            if train is not None:
                train.tick()
            if train is not None and train.outcome is not None:
                why = train.stop_request[1]
                state.requeue(why) if train.outcome == "requeue" else state.cancel(f"{why}: stopped after a checkpoint")
            state.check_complete()
            state.write(every_s=1.0)
    except Exception as e:  # reported like any failure (state.json, the failed event, a notification); no restart
        log.exception("the controller failed")
        if no_space(e) is not None:  # a journal, metrics or control file write: the disk, not the controller
            state.out_of_space(e)
        else:
            state.fail("controller", None, host, f"{type(e).__name__}: {e}", kind="controller")
    except BaseException as e:
        state.fail("controller", None, host, f"{type(e).__name__}: {e}", kind="controller")
        raise
    finally:  # each step whatever the one before did; the outcome on disk first, before the steps' stop grace
        _end_step(state, "writing state.json", state.write)
        _end_step(state, "stopping the steps", lambda: stop_steps(steps, STOP_GRACE_S))
        channel.close()
        if train is not None:
            _end_step(state, "writing summary.json and reward.png", train.finish)
        _end_step(state, "writing state.json", state.write)
        _report(state, steps)


def _restart_alone(run: RunDir, recipe: Recipe, backend: Backend, state: RunState, steps: list[StepProcess],
                   train: TrainingLoop | None, role: str, failure) -> None:
    """Role tier: stop what is left of ``role``'s step (by PID), start the step again alone (under Slurm a new job
    step of the same het group in this allocation; locally new processes), and give the role back its work: the
    tasks it held go to the new ranks, its leases back to the exchange's queue (:meth:`TrainingLoop.role_restarted`).
    The new ranks bootstrap their own group, skip the cross-role check (done at the run's start) and join the
    exchange through the controller as before; no other role's process is touched."""
    i = next(k for k, s in enumerate(steps) if s.role == role)
    log.warning("%s; starting %s alone again (role tier), the other roles go on", failure.reason(), role)
    stop_steps([steps[i]], STOP_GRACE_S)
    if train is not None:
        train.role_restarted(role)  # before the new ranks can ask for a task: the queue they get is the new one
    new = StepProcess(step_command(recipe, run.path, backend, role, restarted=True), run.path)
    log.info("starting %s again: %s", role, " ".join(new.cmd.procs[0].argv))
    new.start()
    steps[i] = new
    state.restarted_alone(role, failure, time.time())


def _cancel_requested(run: RunDir) -> bool:
    """relax-cancel (or relax-submit's Ctrl-C) asked for a stop now (``cancel.json``, written before its signal;
    removed when an attempt starts): a role that dies then is not restarted alone. Local roles run in sessions of
    their own, so a role started now would be outside what the cancel stops."""
    req = run.read_json(run.path / "cancel.json", {}) or {}
    return req.get("by") == "relax-cancel"


def _end_step(state: RunState, what: str, fn) -> None:
    """One step of an attempt's end: its failure is logged and kept as an event (a full disk fails a run still
    going), never raised over the run's first cause."""
    try:
        fn()
    except Exception as e:
        log.exception("%s failed", what)
        if no_space(e) is not None:
            state.out_of_space(e)
        state.event("end_step_failed", f"{what}: {type(e).__name__}: {e}")


def _on_stop(state: RunState, train: TrainingLoop | None, outcome: str, why: str) -> None:
    """Checkpoint, then requeue or cancel; with no training loop there is nothing to save: at once."""
    if train is not None:
        train.request_stop(outcome, why)
    elif outcome == "requeue":
        state.requeue(why)
    else:
        state.cancel(why)


def _on_interrupt(run: RunDir, state: RunState, backend: Backend, name: str) -> None:
    ck = state.doc.get("last_checkpoint") or {}
    since = f"the checkpoint of step {ck['step']}" if ck else "the start (no checkpoint yet)"
    if backend.preemption_requeues and name == "SIGTERM" and not (run.path / "cancel.json").exists():
        state.event("preempted", f"SIGTERM (preemption or scancel); a requeued job resumes from {since}")
        state.cancel(f"received SIGTERM (preemption or scancel); a requeued job resumes from {since}")
    else:
        state.cancel(f"received {name}: stopped; relax-submit --resume resumes from {since}")


def _summary_line(run: RunDir) -> str:
    return summary_line(run.read_json(run.path / "summary.json", {}) or {})


def _report(state: RunState, steps: list[StepProcess]) -> None:
    doc = state.doc
    log.info("run %s: %s%s", doc["run"], doc["state"], f" ({doc['reason']})" if doc["reason"] else "")
    f = state.failure
    for s in steps:
        if f is not None and s.role == f.role:
            log.error("log of the failed role %s:\n%s", s.role, s.log_tail(f.rank, lines=30) or "(empty)")


def _log_to(path: Path) -> list[logging.Handler]:
    """Log to stderr (the batch output) and to ``logs/controller.log``, unless stderr already is that file."""
    logger = logging.getLogger("relax_hpc")
    fmt = logging.Formatter("%(asctime)s [controller] %(levelname)s %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    try:
        same = os.path.samestat(os.fstat(sys.stderr.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):
        same = False
    if not same:
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path))
    for h in handlers:
        h.setFormatter(fmt)
        logger.addHandler(h)
    logger.setLevel(logging.INFO)
    return handlers
