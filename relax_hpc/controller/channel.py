"""The controller's end of the control socket: answers lookups at once, queues everything else for the loop.

The loop is single-threaded and owns the run's state; connection threads only put messages on a queue,
so no lock guards the state. ``publish``/``lookup`` are answered here (a small locked dict), because a
role waiting for an address should not wait for the loop's next tick.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from relax_hpc.controller.protocol import Server


class Channel:
    def __init__(self, token: str, bind_host: str):
        self._events: queue.Queue[tuple[float, dict]] = queue.Queue()
        self._kv: dict[str, Any] = {}
        self._lock = threading.Lock()
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
        self._events.put((time.time(), msg))
        return {}

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
