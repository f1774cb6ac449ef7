"""What every role process shares: who it is, its line to the controller, its heartbeat, and how it ends.

A role module is ``main(ROLE, work)``: the same code under Slurm (``srun`` gives ``SLURM_PROCID``...) and
locally (the controller's launcher gives ``RELAX_RANK``...). Any exception is reported to the controller
as an ``error`` (so the run fails with this rank's traceback instead of hanging) and printed to this
rank's log; the process then exits 1, and ``srun --kill-on-bad-exit`` takes the rest of the step down.
The report carries the error's verdict (:func:`relax_hpc.errors.verdict`): a full disk (the run fails at once,
naming it) or an error that will repeat (a :class:`~relax_hpc.errors.PermanentError`, or an input error while the
role loads its inputs, before its first task: the run fails at once); anything else lets the controller restart
the steps.
A rank that loses the controller for longer than the heartbeat timeout exits too: no role outlives its run.
What a role started outside its own process (the rollout role's engines) is registered with
:meth:`RoleContext.add_cleanup` and stopped on every way out: a normal end, an exception, SIGTERM (the
controller stopping the steps), and the lost-controller exit.

Who a rank is (:class:`~relax_hpc.identity.Identity`) and the cross-role group's members live in the leaf
:mod:`relax_hpc.identity`, which the controller reads too; they are re-exported here.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from relax_hpc.controller.protocol import PHASES, Client, ProtocolError
from relax_hpc.errors import LOADING_ERRORS, NO_SPACE, PERMANENT, verdict
from relax_hpc.identity import Identity
from relax_hpc.recipe import Recipe, load_recipe
from relax_hpc.rundir import RunDir, no_space_reason, run_disk_full

CONTROLLER_LOST_EXIT = 75  # exit code of a rank that stopped hearing from the controller


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


def say(text: str, stream: Any = None) -> None:
    """Print to this rank's log (stderr by default), never raising: on a full disk the log cannot take it, and
    the error being reported matters more."""
    try:
        print(text, file=stream or sys.stderr, flush=True)
    except (OSError, ValueError):  # ENOSPC; a closed stream
        pass


def classify(ctx: RoleContext, error: BaseException, loading: bool) -> tuple[str | None, str | None]:
    """The verdict on the error this rank dies of, and the run's reason where the traceback's last line is not
    it: a full disk's mount point and fix; an error that will repeat as ``Type: message`` (the traceback's line
    has the module path: ``relax_hpc.rollout.data.DataError: ...``)."""
    v = verdict(error, loading=loading)
    if v == NO_SPACE and not run_disk_full(ctx.run, error):  # a node's own disk (/dev/shm, /tmp): a restart may help
        v = PERMANENT if loading and isinstance(error, LOADING_ERRORS) else None
    if v == NO_SPACE:
        return v, no_space_reason(ctx.run, error)
    text = f"{type(error).__name__}: {error}"
    return v, (text if v == PERMANENT and "\n" not in text else None)


def _injected_failure(ctx: RoleContext) -> None:
    """Test hooks: ``RELAX_TEST_FAIL_ROLE=<role>`` makes that role fail right after its bootstrap;
    ``RELAX_TEST_HOLD_ROLE=<role>`` keeps it ready (heartbeating, never done) until the controller stops its
    step, in the run's first try only (attempt 0, no restart yet), so a test can act on a running controller
    without racing the run's end."""
    role = ctx.ident.role
    if os.environ.get("RELAX_TEST_FAIL_ROLE") == role:
        raise RuntimeError(f"RELAX_TEST_FAIL_ROLE={role}: injected failure after bootstrap")
    st = ctx.run.read_json(ctx.run.state, {}) or {}
    if os.environ.get("RELAX_TEST_HOLD_ROLE") == role and not st.get("restarts") and not st.get("attempt"):
        threading.Event().wait()


Work = Callable[[RoleContext, Any], None]


def main(role: str, work: Work | None = None, argv: list[str] | None = None,
         prepare: Callable[[RoleContext], Any] | None = None) -> int:
    """Entry point of ``python -m relax_hpc.roles.<role> RUN_DIR``: bootstrap, report ready, ``work``, done.

    ``prepare(ctx)``, if given, runs before the bootstrap (its result is ``ctx.prepared``): for slow work that
    needs no communicator, e.g. starting an engine process that loads while torch and the groups come up."""
    argv = sys.argv if argv is None else argv
    if len(argv) != 2:
        print(f"usage: python -m relax_hpc.roles.{role} RUN_DIR", file=sys.stderr)
        return 2
    ctx = RoleContext(role, argv[1])
    tag = f"[{role}:{ctx.ident.rank}@{ctx.ident.node}]"
    working = False  # in ``work``: until its first task, the role loads its inputs (data, model, user functions)
    try:
        ctx.hello()
        ctx.start_heartbeat()
        ctx.report("bootstrap")
        if prepare is not None:
            ctx.prepared = prepare(ctx)
        from relax_hpc.roles.comm import bootstrap  # torch is imported here, after hello and ``prepare``

        comm = bootstrap(ctx)
        ctx.report("ready", **comm.summary())
        say(f"{tag} ready: {comm.summary()}", sys.stdout)
        _injected_failure(ctx)
        if work is not None:
            working = True
            work(ctx, comm)
            working = False
        comm.close()
        ctx.stop_heartbeat()
        ctx.report("done")
        say(f"{tag} done", sys.stdout)
        return 0
    except BaseException as e:
        text = traceback.format_exc()
        say(f"{tag} failed:\n{text}")
        ctx.report_error(text, *classify(ctx, e, loading=working and ctx.tasks_begun == 0))
        return 1
    finally:
        ctx.close()
