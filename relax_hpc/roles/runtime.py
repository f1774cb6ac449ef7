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

The rank's context (:class:`RoleContext`, with ``resolve``, ``say`` and ``CONTROLLER_LOST_EXIT``) lives in the leaf
:mod:`relax_hpc.roles.context` and is re-exported here; who a rank is lives in :mod:`relax_hpc.identity`.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any, Callable

from relax_hpc.errors import LOADING_ERRORS, NO_SPACE, PERMANENT, verdict
from relax_hpc.roles.context import CONTROLLER_LOST_EXIT, RoleContext, resolve, say  # noqa: F401  (re-exported)
from relax_hpc.rundir import no_space_reason, run_disk_full


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
    step, in the run's first try only (attempt 0, no restart yet, not started again alone), so a test can act on a
    running controller without racing the run's end."""
    role = ctx.ident.role
    if os.environ.get("RELAX_TEST_FAIL_ROLE") == role:
        raise RuntimeError(f"RELAX_TEST_FAIL_ROLE={role}: injected failure after bootstrap")
    st = ctx.run.read_json(ctx.run.state, {}) or {}
    if (os.environ.get("RELAX_TEST_HOLD_ROLE") == role and not st.get("restarts") and not st.get("attempt")
            and not os.environ.get("RELAX_RESTARTED_ALONE")):
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
