"""The controller's end of the control socket: answers lookups at once, queues everything else for the loop.

The loop is single-threaded and owns the run's state; connection threads only put messages on a queue,
so no lock guards the state. ``publish``/``lookup`` are answered here (a small locked dict), because a
role waiting for an address should not wait for the loop's next tick. Tasks too: the loop
:meth:`Channel.assign` queues one for a role, and the role's ``next_task`` long poll (waiting in its
connection thread) gets it the moment it is there. A task stays at the head of its role's queue until its
``task_done`` arrives, so a reply lost on the way is delivered again on the next poll (a role asks for
its next task only after it reported the last one).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from relax_hpc.controller.protocol import ASKED, MAX_TASK_WAIT_S, Server

ASK_WAIT_S = 8.0  # how long a question (ASKED) waits for the loop's answer: a few ticks, under the client's timeout


class _Slot:
    """Where the loop puts its answer to one question; the connection thread waits on it. A question the loop did
    not take up in time is dropped whole (the asker is told nothing changed, and nothing does)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: dict = {}
        self._lock = threading.Lock()
        self._state = "asked"  # → taken (the loop decides) | given_up (the asker was told no)

    def take(self) -> bool:
        with self._lock:
            if self._state == "asked":
                self._state = "taken"
            return self._state == "taken"

    def wait(self, wait_s: float) -> dict:
        if not self.done.wait(wait_s):
            with self._lock:
                if self._state == "asked":
                    self._state = "given_up"
                    return {"accepted": False, "message": f"the controller did not take the request up within "
                                                          f"{wait_s:g} s (busy, or stopping); nothing was changed"}
            self.done.wait(wait_s)  # taken: the loop answers within its turn
        return self.reply


class Channel:
    def __init__(self, token: str, bind_host: str):
        self._events: queue.Queue[tuple[float, dict]] = queue.Queue()
        self._kv: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._tasks: dict[str, list[dict]] = {}  # per role, assigned and not yet done, in order
        self._task_cond = threading.Condition(self._lock)
        self.server = Server(token, self._handle, bind_host=bind_host).start()
        self.port = self.server.port

    def _handle(self, msg: dict) -> dict:
        kind = msg["type"]
        if kind == "publish":
            with self._lock:
                self._kv[msg["key"]] = msg["value"]
        elif kind == "lookup":
            with self._lock:
                found = msg["key"] in self._kv
                return {"found": found, "value": self._kv.get(msg["key"])}
        elif kind == "next_task":
            self._events.put((time.time(), msg))  # a long poll is a sign of life too
            return {"task": self._head(msg["role"], min(float(msg["wait_s"]), MAX_TASK_WAIT_S))}
        elif kind in ASKED:  # the loop owns the state it decides on: it answers (answer()) within a tick or two
            slot = _Slot()
            self._events.put((time.time(), {**msg, "reply_to": slot}))
            return slot.wait(ASK_WAIT_S)
        elif kind == "task_done":
            with self._task_cond:
                queue_ = self._tasks.get(msg["role"], [])
                self._tasks[msg["role"]] = [t for t in queue_ if t.get("id") != msg["task_id"]]
        self._events.put((time.time(), msg))
        return {}

    @staticmethod
    def take(msg: dict) -> bool:
        """Whether the loop may act on a question (a message of an ASKED type): False once its asker gave up."""
        slot = msg.get("reply_to")
        return isinstance(slot, _Slot) and slot.take()

    @staticmethod
    def answer(msg: dict, reply: dict) -> None:
        """The loop's answer to a question it took."""
        slot = msg.get("reply_to")
        if isinstance(slot, _Slot):
            slot.reply = reply
            slot.done.set()

    def assign(self, role: str, task: dict) -> None:
        """Queue ``task`` for ``role``'s rank 0 (its next ``next_task`` gets it)."""
        with self._task_cond:
            self._tasks.setdefault(role, []).append(task)
            self._task_cond.notify_all()

    def drop(self, role: str) -> list[dict]:
        """Take ``role``'s queued tasks off its queue (its ranks were stopped to start again alone); returns them."""
        with self._task_cond:
            return self._tasks.pop(role, [])

    def _head(self, role: str, wait_s: float) -> dict | None:
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._task_cond:
            while not self._tasks.get(role):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._task_cond.wait(left)
            return self._tasks[role][0]

    def drain(self, wait_s: float) -> list[tuple[float, dict]]:
        """Messages received so far as ``(time, message)``; waits up to ``wait_s`` for the first one."""
        out = []
        try:
            out.append(self._events.get(timeout=wait_s))
            while True:
                out.append(self._events.get_nowait())
        except queue.Empty:
            return out

    def close(self) -> None:
        self.server.close()
