"""A running rank's context: who it is, its recipe and run directory, its line to the controller and the heartbeat
that carries its phase, and what it started that must stop with it (:class:`RoleContext`). A leaf of ``roles/``:
:mod:`~relax_hpc.roles.runtime` (the process around a role) and :mod:`~relax_hpc.roles.comm` (its communicators)
both use it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from relax_hpc.controller.protocol import PHASES, Client, ProtocolError
from relax_hpc.identity import Identity
from relax_hpc.recipe import Recipe, load_recipe
from relax_hpc.rundir import RunDir

CONTROLLER_LOST_EXIT = 75  # exit code of a rank that stopped hearing from the controller


def resolve(path: str) -> str:
    """A recipe path as an absolute one: relative paths are relative to the directory the run was submitted
    from (every role's working directory)."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (Path.cwd() / p).resolve())


def _whole(v: Any) -> bool:
    """An int the controller accepts in ``info["task"]`` (protocol.INFO_FIELDS): a heartbeat it refused
    would count as a lost one."""
    return isinstance(v, int) and not isinstance(v, bool)


class RoleContext:
    """A running rank: identity, recipe, controller client, and the phase/info its heartbeats carry."""

    def __init__(self, role: str, run_dir: str | Path):
        self.run = RunDir(Path(run_dir).resolve())
        self.recipe: Recipe = load_recipe(self.run.recipe)
        self.ident = Identity.from_env(role)
        self.launch_id = os.environ.get("RELAX_LAUNCH_ID", "")
        addr = self.run.read_json(self.run.controller_addr)
        if not addr:
            raise RuntimeError(f"{self.run.controller_addr} is missing: is the controller running?")
        self.client = Client(addr["host"], int(addr["port"]), self.run.token())
        self.phase = "starting"
        self.info: dict[str, Any] = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._cleanups: list[Callable[[], Any]] = []
        self.prepared: Any = None  # what main's ``prepare`` returned
        self.progress_count = 0  # bumped by :meth:`progress`; a task whose count stops moving is hung
        self.tasks_begun = 0  # none yet: the role is still loading its inputs (see :func:`main`)

    # -- the task in hand, as the heartbeats show it (the controller fails a role whose task stops moving)
    def begin_task(self, task: dict) -> None:
        """Heartbeats now carry ``task``: its id, kind, step (if any) and the progress counter."""
        self.tasks_begun += 1
        shown = {"id": task["id"] if _whole(task.get("id")) else -1, "kind": str(task.get("kind")),
                 "progress": self.progress_count}
        if _whole(task.get("step")):
            shown["step"] = task["step"]
        self.info["task"] = shown
        _injected_kill(self, task)

    def progress(self, n: int = 1) -> None:
        """Say the work moved on (a sample generated, a micro-batch done): without it for
        ``logging.task_timeout_s`` the controller takes the role for hung and restarts the run's steps.
        Cheap and thread-safe enough to call often: the shown dict is replaced, never changed in place."""
        self.progress_count += n
        task = self.info.get("task")
        if isinstance(task, dict):
            self.info["task"] = {**task, "progress": self.progress_count}

    def end_task(self) -> None:
        """Heartbeats now say "no task" (None, not absent: the controller merges info, so absent keeps the old)."""
        self.progress_count += 1
        self.info["task"] = None

    # -- things to undo on the way out
    def add_cleanup(self, fn: Callable[[], Any]) -> None:
        """Call ``fn`` when this rank ends, however it ends (except SIGKILL); the last added runs first.

        The first call installs a SIGTERM handler that runs the cleanups and exits at once (143). Without
        cleanups SIGTERM keeps its default action, which ends a rank even inside a collective; a Python
        handler runs only when the main thread is back in Python."""
        if not self._cleanups and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._cleanups.append(fn)

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM kills at once
        say(f"[{self.ident.role}:{self.ident.rank}] stopped by signal {signum}")
        self.run_cleanups()
        os._exit(128 + signum)

    def run_cleanups(self) -> None:
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                fn()
            except Exception as e:  # one failed cleanup must not skip the others
                say(f"[{self.ident.role}:{self.ident.rank}] cleanup {fn!r} failed: {e}")

    # -- talking to the controller
    def hello(self) -> None:
        i = self.ident
        self.client.hello(i.role, i.rank, i.world, i.node, os.getpid())

    def report(self, phase: str, **info: Any) -> None:
        """Move to ``phase`` (and merge ``info``), and tell the controller now rather than at the next beat."""
        assert phase in PHASES, phase
        self.phase = phase
        self.info.update(info)
        self.client.heartbeat(self.ident.role, self.ident.rank, self.ident.node, phase, dict(self.info))

    def report_error(self, text: str, verdict: str | None = None, reason: str | None = None) -> None:
        """``text`` (the traceback), its ``verdict`` and the run's one-line ``reason`` (see protocol's ``error``)."""
        try:
            self.client.error(self.ident.role, self.ident.rank, self.ident.node, text, verdict, reason)
        except (OSError, ProtocolError) as e:  # the log still has it; the exit code still fails the step
            say(f"[{self.ident.role}:{self.ident.rank}] could not report the error to the controller: {e}")

    # -- heartbeat
    def start_heartbeat(self) -> None:
        self._beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=15)

    def _heartbeat_loop(self) -> None:
        every = self.recipe.logging.heartbeat_s
        give_up = self.recipe.logging.heartbeat_timeout_s
        last_ok = time.monotonic()
        while not self._stop.wait(every):
            try:
                self.client.heartbeat(self.ident.role, self.ident.rank, self.ident.node, self.phase, dict(self.info))
                last_ok = time.monotonic()
            except (OSError, ProtocolError) as e:
                if time.monotonic() - last_ok > give_up:
                    say(f"[{self.ident.role}:{self.ident.rank}] no answer from the controller for "
                        f"{give_up:.0f}s ({e}); exiting")
                    self.run_cleanups()
                    os._exit(CONTROLLER_LOST_EXIT)

    def close(self) -> None:
        self.run_cleanups()
        self.stop_heartbeat()
        self.client.close()


def _injected_kill(ctx: RoleContext, task: dict) -> None:
    """Test hook: ``RELAX_TEST_KILL_TASK=<role>:<kind>:<step>`` SIGKILLs every rank of that role as it begins that
    task (of that step: the task's, or its first chunk's), holding it, in the role's first life only (not after a
    restart of any tier): a ``kill -9`` that lands at a known point of the run, without racing it."""
    spec = os.environ.get("RELAX_TEST_KILL_TASK", "")
    role, kind, step = (spec.split(":") + ["", "", ""])[:3]
    if not spec or role != ctx.ident.role or kind != task.get("kind") or os.environ.get("RELAX_RESTARTED_ALONE"):
        return
    chunks = task.get("chunks") or [{}]
    first = chunks[0] if isinstance(chunks[0], dict) else {}
    at = task.get("step") if _whole(task.get("step")) else first.get("step")
    st = ctx.run.read_json(ctx.run.state, {}) or {}
    if str(at) == step and not st.get("restarts") and not st.get("attempt"):
        say(f"RELAX_TEST_KILL_TASK={spec}: SIGKILL of this rank")
        os.kill(os.getpid(), signal.SIGKILL)


def say(text: str, stream: Any = None) -> None:
    """Print to this rank's log (stderr by default), never raising: on a full disk the log cannot take it, and
    the error being reported matters more."""
    try:
        print(text, file=stream or sys.stderr, flush=True)
    except (OSError, ValueError):  # ENOSPC; a closed stream
        pass
