"""The engines a rollout driver sends to: each one's load and health (:class:`Engine`), the least-loaded choice with a
bound on requests in flight per engine (:class:`EnginePool`: the run's request queue), clients from handles or URLs
(:func:`as_client`), and the names of engines being drained (:class:`NamesFile`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from relax_hpc.engines.client import EngineClient


@dataclass
class Engine:
    name: str
    client: EngineClient
    in_flight: int = 0
    served: int = 0  # requests sent to it
    peak: int = 0  # most requests in flight at once
    dead: str | None = None
    probe: Any = None  # the health probe in flight (an asyncio task), shared by the requests that failed meanwhile


class EnginePool:
    """Least-loaded choice among live engines, with a bound on in-flight requests per engine. Requests that find
    every engine at its bound wait here: the run's request queue, which :meth:`queue_clock` integrates over time
    (the autoscaler's "requests queued per engine")."""

    def __init__(self, engines: list[Engine], per_engine: int,
                 leaving: Callable[[], frozenset[str]] = frozenset, *,
                 none_left: type[Exception]) -> None:
        self.engines = engines
        self.none_left = none_left  # raised by acquire when every engine is dead (the driver's NoEngineError)
        self.per_engine = per_engine
        self.leaving = leaving  # engines draining: no new requests (those in flight finish)
        self._cond: asyncio.Condition | None = None
        self._loop: Any = None
        self._dead_lock = threading.Lock()  # dead marks come from the loop and from the EngineRouter's threads
        self.waiting = 0  # requests queued for a free engine now
        self._area = 0.0  # ∫ waiting dt (request-seconds)
        self._since = time.monotonic()

    def _queue(self, delta: int) -> None:
        now = time.monotonic()
        self._area += self.waiting * (now - self._since)
        self._since, self.waiting = now, self.waiting + delta

    def queue_clock(self) -> tuple[float, float]:
        """(∫ queued requests dt, now): two readings give the mean queue over the time between them."""
        self._queue(0)
        return self._area, self._since

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._cond is None or self._loop is not loop:
            self._cond, self._loop = asyncio.Condition(), loop
        return self._cond

    def alive(self) -> list[Engine]:
        return [e for e in self.engines if e.dead is None]

    def dead_report(self) -> str:
        return "; ".join(f"{e.name}: {e.dead}" for e in self.engines if e.dead is not None) or "no engine was given"

    async def acquire(self, avoid: set[str] = frozenset()) -> Engine:
        cond = self._condition()
        async with cond:
            while True:
                alive = self.alive()
                if not alive:
                    raise self.none_left(f"no rollout engine left to generate with ({self.dead_report()})")
                gone = self.leaving()
                staying = [e for e in alive if e.name not in gone] or alive  # all leaving: better late than hung
                free = [e for e in staying if e.in_flight < self.per_engine]
                if free:
                    pick = min([e for e in free if e.name not in avoid] or free, key=lambda e: (e.in_flight, e.served))
                    pick.in_flight += 1
                    pick.served += 1
                    pick.peak = max(pick.peak, pick.in_flight)
                    return pick
                self._queue(+1)
                try:
                    await cond.wait()
                finally:
                    self._queue(-1)

    async def release(self, engine: Engine) -> None:
        cond = self._condition()
        async with cond:
            engine.in_flight -= 1
            cond.notify_all()

    def _set_dead(self, engine: Engine, reason: str) -> bool:
        with self._dead_lock:
            if engine.dead is not None:
                return False
            engine.dead = reason
            return True

    async def _wake(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def mark_dead(self, engine: Engine, reason: str) -> bool:
        """Declare ``engine`` dead; True if this call did it (False if it already was)."""
        if not self._set_dead(engine, reason):
            return False
        await self._wake()
        return True

    def mark_dead_threadsafe(self, engine: Engine, reason: str) -> bool:
        """:meth:`mark_dead` from another thread (the EngineRouter's): the mark holds at once; requests waiting
        on the pool's event loop are woken there."""
        if not self._set_dead(engine, reason):
            return False
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self._wake(), loop)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass
        return True


EngineLike = EngineClient | Any  # an EngineClient, or anything with .client() (EngineHandle) or .url


def as_client(e: Any, **client_kwargs: Any) -> EngineClient:
    """An EngineClient is used as given; a handle or URL gets one built with the driver's settings."""
    if isinstance(e, EngineClient):
        return e
    if hasattr(e, "client") and callable(e.client):
        return e.client(**client_kwargs)
    if isinstance(e, str):
        return EngineClient(e, **client_kwargs)
    raise TypeError(f"not an engine: {e!r} (give EngineClient, EngineHandle or a URL)")


class NamesFile:
    """A JSON list of names in a file another process rewrites (the controller's ``RUN_DIR/draining``), read again
    only when its mtime changed, and looked at no more often than every ``every_s``: cheap per request."""

    def __init__(self, path: Path, every_s: float = 0.2) -> None:
        self.path, self.every_s = Path(path), every_s
        self._names: frozenset[str] = frozenset()
        self._mtime: float | None = None
        self._checked = 0.0

    def __call__(self) -> frozenset[str]:
        now = time.monotonic()
        if now - self._checked >= self.every_s:
            self._checked = now
            try:
                mtime = self.path.stat().st_mtime
                if mtime != self._mtime:
                    self._names, self._mtime = frozenset(json.loads(self.path.read_text() or "[]")), mtime
            except (OSError, ValueError):
                pass  # absent (nothing drains) or mid-rewrite (the next look reads it)
        return self._names
