"""How a role receives its work from the controller: one task at a time, every rank of the role in step.

Rank 0 long-polls ``next_task`` on its own connection (so the heartbeat thread's connection is never held
by a poll) and passes each task to the other ranks of its role with a broadcast on the role's own
group. While no task comes it broadcasts ``None`` every poll (at most :data:`MAX_TASK_WAIT_S`), so the
other ranks never sit in a collective longer than that (the role group's timeout is the heartbeat timeout).

On the wire a task is a dict ``{"id": int, "kind": str, ...}``; the stream ends after ``kind == "stop"``.
:func:`serve` decodes each into its kind's class (:mod:`relax_hpc.controller.messages`, the one description
of every task and result) before the role's handler sees it, and sends the handler's typed result. Rank 0
answers each task with :meth:`TaskStream.done` (its result dict) or :meth:`TaskStream.failed` (the error
text, which fails the run with that report). See ``docs/controller.md`` for what each role does with its tasks.

While a task runs, every heartbeat shows it (``info["task"]``: id, kind, step, progress; see
:meth:`RoleContext.begin_task`), and the controller fails a role whose task stops progressing for
``logging.task_timeout_s``: role code calls ``ctx.progress()`` as its work moves on.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Iterator

from relax_hpc.controller.messages import ResultMessage, TaskError, TaskMessage, decode_task, encode_result
from relax_hpc.controller.protocol import MAX_TASK_WAIT_S, Client
from relax_hpc.exchange.chunk import DamagedChunk
from relax_hpc.roles.runtime import RoleContext
from relax_hpc.rundir import no_space_reason, run_disk_full

MAX_REPORT = 8000  # characters of an error report sent with task_done (the line limit is 1 MiB)


class TaskStream:
    def __init__(self, ctx: RoleContext, comm: Any):
        self.ctx, self.comm = ctx, comm
        self.rank, self.world = ctx.ident.rank, ctx.ident.world
        self._client: Client | None = None
        if self.rank == 0:
            addr = ctx.run.read_json(ctx.run.controller_addr)
            timeout = MAX_TASK_WAIT_S + 10.0
            self._client = Client(addr["host"], int(addr["port"]), ctx.run.token(), timeout_s=timeout)

    def _poll(self) -> dict | None:
        return self._client.next_task(self.ctx.ident.role, 0, MAX_TASK_WAIT_S) if self._client else None

    def _share(self, task: dict | None) -> dict | None:
        if self.world == 1:
            return task
        import torch.distributed as dist

        box = [task]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def __iter__(self) -> Iterator[dict]:
        """Each task, shown in the heartbeats from when it is handed out until the loop asks for the next."""
        while True:
            task = self._share(self._poll())
            if task is None:
                continue
            self.ctx.begin_task(task)
            try:
                yield task
            finally:
                self.ctx.end_task()
            if task.get("kind") == "stop":
                return

    @property
    def reports(self) -> bool:
        """Whether this rank reports the outcomes (rank 0)."""
        return self._client is not None

    def done(self, task: dict, result: dict, work_s: float | None = None) -> None:
        if self._client is not None:
            self._client.task_done(self.ctx.ident.role, 0, int(task["id"]), result, work_s)

    def failed(self, task: dict, error: BaseException) -> None:
        """Report ``error`` as the task's outcome (the run fails with it); never raises. An error whose class says
        ``restartable = True`` (an engine process died: the machinery, not the recipe) lets the controller
        restart the steps from the latest checkpoint instead of ending the run. A full disk never does (a
        restart would write to the same disk): the report names its mount point and the fix instead."""
        if self._client is None:
            return
        full = run_disk_full(self.ctx.run, error)  # the run's disk; a node's own full /tmp may pass with a restart
        text = (no_space_reason(self.ctx.run, error) if full else None) or getattr(error, "report", None) \
            or describe(error)
        restartable = bool(getattr(error, "restartable", False)) and not full
        result = TaskError(error=text[:MAX_REPORT], restartable=restartable).to_dict()
        try:
            self._client.task_done(self.ctx.ident.role, 0, int(task["id"]), result)
        except Exception:  # the error path in runtime.main reports it again through `error`
            pass

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def describe(error: BaseException) -> str:
    """``Type: message`` (the whole message: reports like RewardError's span lines)."""
    text = f"{type(error).__name__}: {error}".strip()
    return text or "".join(traceback.format_exception_only(type(error), error)).strip()


def serve(ctx: RoleContext, comm: Any, handlers: dict[str, Callable[[Any], ResultMessage | None]]) -> None:
    """Run tasks until ``stop``: ``handlers[kind](task)`` on every rank; rank 0 reports its result.

    The handler gets the task decoded into its kind's class (:func:`~relax_hpc.controller.messages.decode_task`;
    a malformed task fails with the :class:`~relax_hpc.controller.messages.MessageError` text) and returns
    the kind's result class (None: its empty result, for kinds whose result has no required field; ranks
    other than 0 report nothing, so what they return is not looked at).

    A handler that raises reports the error as the task's outcome and re-raises (the role then fails),
    except :class:`~relax_hpc.exchange.chunk.DamagedChunk` (a chunk that cannot be read: the controller
    quarantines it and generates the step again), after which the role serves on. Handlers raise it on every
    rank at once (:func:`relax_hpc.train.samples.read_samples` with ``agree=True``), so the ranks stay in step. An
    error whose class says ``serve_on = True`` (:class:`~relax_hpc.rollout.teacher.TeacherError`: another role's
    engine gave no answer) is reported and the role serves on too: the controller decides what comes next.
    An unknown kind is an error too: controller and role disagree about the protocol.
    """
    stream = TaskStream(ctx, comm)
    try:
        for task in stream:
            kind = task.get("kind")
            t0 = time.perf_counter()
            try:
                if kind not in handlers:
                    raise RuntimeError(f"{ctx.ident.role} got a task of unknown kind {kind!r}: {task}")
                typed: TaskMessage = decode_task(task)
                out = handlers[kind](typed)
                result = encode_result(kind, out) if stream.reports else {}
            except DamagedChunk as e:  # the controller quarantines the chunk and has the step made again
                stream.failed(task, e)
                continue
            except BaseException as e:
                stream.failed(task, e)
                if getattr(e, "serve_on", False):  # the controller decides what comes next (a TeacherError)
                    continue
                raise
            stream.done(task, result, time.perf_counter() - t0)
    finally:
        stream.close()
