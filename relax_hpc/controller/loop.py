"""The controller loop: start the role steps, serve the control socket, watch heartbeats and exits, keep
``state.json`` current, and finish. It never waits without a timeout, so a dead role fails the run
instead of hanging it.

With ``model.path`` set, the training loop (:class:`~relax_hpc.controller.colocate.Colocate`: generate →
train → sync, metrics, summary) rides on the same loop: it sees every message and hands out tasks;
without it the roles only bootstrap. A later issue adds real work to :func:`on_signal`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

from relax_hpc.controller.channel import Channel
from relax_hpc.controller.colocate import Colocate
from relax_hpc.controller.procs import StepProcess, stop_steps
from relax_hpc.controller.signals import Signals
from relax_hpc.controller.state import RunState
from relax_hpc.launch.steps import executor_from_env, step_commands
from relax_hpc.recipe import load_recipe, role_steps
from relax_hpc.rundir import RunDir, write_json

log = logging.getLogger("relax_hpc.controller")
TICK_S = 0.2  # how long the loop waits for messages before it checks exits, silence and signals
STOP_GRACE_S = 10.0


class RunFailed(RuntimeError):
    """The run ended FAILED or CANCELLED; the message is state.json's reason."""


def on_signal(name: str, state: RunState, steps: list[StepProcess]) -> str:
    """Hook for SIGUSR2/SIGTERM: a later issue checkpoints and requeues here. Returns the cancel reason."""
    return f"received {name}: stopping the steps (checkpoint and requeue are not implemented yet)"


def run_controller(run_dir: str | os.PathLike) -> dict:
    """Run the job's roles to the end; return the final state. Raises :class:`RunFailed` with the reason."""
    run = RunDir(Path(run_dir).resolve())
    handlers = _log_to(run.logs / "controller.log")
    try:
        return _run(run)
    finally:
        for h in handlers:
            logging.getLogger("relax_hpc").removeHandler(h)
            h.close()


def _run(run: RunDir) -> dict:
    recipe, executor = load_recipe(run.recipe), executor_from_env()
    local = executor == "local"
    host = "127.0.0.1" if local else os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    state = RunState(run, recipe, role_steps(recipe), executor)
    steps = [StepProcess(c, run.path) for c in step_commands(recipe, run.path, executor)]
    channel = Channel(run.token(), bind_host="127.0.0.1" if local else "0.0.0.0")
    write_json(run.controller_addr, {"host": host, "port": channel.port, "pid": os.getpid()})
    log.info("run %s: executor %s, control socket %s:%d", run.name, executor, host, channel.port)
    train = None
    with Signals() as sig:  # held through the cleanup too: a second Ctrl-C must not cut the stop short
        try:
            train = Colocate(recipe, run, state, channel) if recipe.model.path else None
            for s in steps:
                log.info("starting %s: %s", s.role, " ".join(s.cmd.procs[0].argv))
                s.start()
                state.step_started(s.role, time.time())
            while state.running:
                codes = {s: s.poll() for s in steps}  # polled first: a rank's last message precedes its exit
                for now, msg in channel.drain(TICK_S):
                    state.apply(now, msg)
                    if train is not None:
                        train.on_message(msg)
                for s, code in codes.items():
                    if code is not None:
                        state.step_exited(s.role, code, s.last_line() if code else "")
                state.check_silence(time.time(), recipe.logging.heartbeat_timeout_s)
                if sig.received:
                    state.cancel(on_signal(sig.name, state, steps))
                state.check_complete()
                state.write(every_s=1.0)
        except BaseException as e:
            state.fail("controller", None, host, f"{type(e).__name__}: {e}")
            raise
        finally:
            stop_steps(steps, STOP_GRACE_S)
            channel.close()
            if train is not None:
                train.finish()
            state.write()
            _report(state, steps)
    if state.doc["state"] != "COMPLETED":
        raise RunFailed(state.doc["reason"])
    return state.doc


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
