"""The training loop's tasks in flight: ids, what each was given, and when they go out.

A task is queued for a role as part of a step (a role does its tasks in order) and gets the next id. While the
loop handles a report (:meth:`Dispatcher.holding`) the tasks it queues are held and go out only once the report's
journal records are durable: nothing acts on a record before it is.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from relax_hpc.controller import messages as M
from relax_hpc.controller.channel import Channel


@dataclass
class Task:
    role: str
    kind: str
    step: int
    life: int = 0  # which life of the step's partition it works on (a step voided for damage starts a new one)
    engines: dict[str, str] | None = None  # generate/sync: the engines it was given, so a death it reports is of those
    versions: dict[str, str | None] | None = None  # generate: their weight versions when it was given them
    message: M.TaskMessage | None = None  # what was sent (a role started again alone gets it again)


class Dispatcher:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._ids = itertools.count(1)
        self.pending: dict[int, Task] = {}
        self.outbox: list[tuple[str, dict]] | None = None  # tasks held until the report's journal group is durable

    def assign(self, role: str, at: int, task: M.TaskMessage, life: int = 0,
               versions: dict[str, str | None] | None = None) -> None:
        """Queue ``task`` for ``role``, as part of step ``at`` (of the partition's ``life``); gives it its id."""
        tid = next(self._ids)
        self.pending[tid] = Task(role, task.kind, at, life, getattr(task, "engines", None), versions, task)
        if self.outbox is not None:  # handling a report: sent once its journal records are durable
            self.outbox.append((role, replace(task, id=tid).to_dict()))
        else:
            self.channel.assign(role, replace(task, id=tid).to_dict())

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Tasks queued inside go out only at its end (also when it raises)."""
        self.outbox = []
        try:
            yield
        finally:
            out, self.outbox = self.outbox, None
            for role, task in out:  # only now: nothing acts on a record before it is durable
                self.channel.assign(role, task)

    def drop(self, role: str) -> list[Task]:
        """``role``'s tasks in flight, forgotten (off the channel's queue too), in the order they were given: its
        ranks were stopped to start again alone, and a late report of theirs is then of no task."""
        self.channel.drop(role)
        if self.outbox is not None:
            self.outbox = [(r, t) for r, t in self.outbox if r != role]
        ids = sorted(tid for tid, t in self.pending.items() if t.role == role)
        return [self.pending.pop(tid) for tid in ids]

    def done(self, task_id: int) -> Task | None:
        """The task a report is about (None: unknown, or reported already)."""
        return self.pending.pop(task_id, None)

    def idle(self, role: str) -> bool:
        return not any(t.role == role for t in self.pending.values())

    def expect(self, role: str, at: int, kind: str, engines: dict[str, str] | None = None) -> int:
        """An id for a report ``role`` sends of its own accord, not a task queued for it (``land``: a sync's push
        behind the next train, train.overlap_sync); it stays pending until that report comes (:meth:`idle` counts
        it: only the loop knows what may run beside it)."""
        tid = next(self._ids)
        self.pending[tid] = Task(role, kind, at, engines=engines)  # engines: a drain waits for it too
        return tid

    def holds(self, engine: str) -> bool:
        """Whether a task in flight (a generate or a sync) was given ``engine``: a drain waits for it."""
        return any(t.engines and engine in t.engines for t in self.pending.values())

    def kinds(self) -> list[str]:
        """The kinds of the tasks in flight, sorted, once each."""
        return sorted({t.kind for t in self.pending.values()})
