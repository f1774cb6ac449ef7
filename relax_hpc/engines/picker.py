"""The least-busy engine picker for callers on threads or event loops of their own (the router's handlers, the
GenRM client)."""

from __future__ import annotations

import itertools
import threading
from typing import Sequence


class LeastBusy:
    """Thread-safe choice of the engine with the fewest calls in flight, round-robin among equals: for callers on
    threads or on event loops of their own (this router's handlers, the GenRM client), which the driver's pool,
    bound to one event loop, cannot serve."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[str, int] = {}
        self._turn = itertools.count()

    def acquire(self, names: Sequence[str]) -> str | None:
        """One of ``names`` (None if there are none), counted busy until :meth:`release`."""
        with self._lock:
            if not names:
                return None
            first = next(self._turn) % len(names)
            order = [*names[first:], *names[:first]]
            best = min(order, key=lambda n: self._busy.get(n, 0))
            self._busy[best] = self._busy.get(best, 0) + 1
            return best

    def release(self, name: str) -> None:
        with self._lock:
            self._busy[name] -= 1

    def busy(self) -> dict[str, int]:
        with self._lock:
            return dict(self._busy)
