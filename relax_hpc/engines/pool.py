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


def as_client(e: Any, externals: "ExternalEngines | None" = None, **client_kwargs: Any) -> EngineClient:
    """An EngineClient is used as given; a handle or URL gets one built with the driver's settings. A URL that
    ``externals`` lists (an engine the run does not own) gets its own key and a client that checks every answer's
    weight version against the versions sent to that engine (:class:`CheckedClient`)."""
    if isinstance(e, EngineClient):
        return e
    if hasattr(e, "client") and callable(e.client):
        return e.client(**client_kwargs)
    if isinstance(e, str):
        ext = externals.get(e) if externals is not None else None
        if ext is not None:
            from relax_hpc.engines.keys import read_key_file

            key = read_key_file(ext["key_file"], f"the key file of external engine {e}")
            return CheckedClient(e, sent=lambda force=False: externals.sent(e, force),
                                 **{**client_kwargs, "api_key": key})
        return EngineClient(e, **client_kwargs)
    raise TypeError(f"not an engine: {e!r} (give EngineClient, EngineHandle or a URL)")


class ExternalEngines:
    """``RUN_DIR/external_engines.json``, written by the controller (:mod:`relax_hpc.controller.external`): for each
    external engine's URL its key file and the weight versions sent to it. Re-read when its mtime changed, and
    always when an answer's version is not among those listed (the controller lists a version before it sends it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._doc: dict[str, dict] = {}
        self._mtime: float | None = None

    def _read(self, force: bool = False) -> dict[str, dict]:
        try:
            mtime = self.path.stat().st_mtime_ns
            if force or mtime != self._mtime:
                self._doc, self._mtime = json.loads(self.path.read_text() or "{}"), mtime
        except (OSError, ValueError):
            pass  # absent (no external engine) or mid-rewrite (the next look reads it)
        return self._doc

    def get(self, url: str) -> dict | None:
        return self._read().get(url.rstrip("/"))

    def sent(self, url: str, force: bool = False) -> list[str]:
        return list((self._read(force).get(url.rstrip("/")) or {}).get("sent") or [])


class CheckedClient(EngineClient):
    """The client of an engine the run does not own: every answer's weight version must be one the controller
    sent it (``sent()``, newest last), or the answer is an :class:`~relax_hpc.engines.client.EngineOutputError`:
    the driver declares the engine dead and sends the request elsewhere, and the controller drops it with why."""

    def __init__(self, url: str, *, sent: Callable[..., list[str]], **kw: Any) -> None:
        super().__init__(url, **kw)
        self._sent = sent

    def _check(self, gens: list) -> None:
        self._check_versions([g.weight_version for g in gens])

    def _check_versions(self, versions: list) -> None:
        from relax_hpc.engines.client import EngineOutputError

        for v in versions:
            v = None if v is None else str(v)
            if v in self._sent() or v in self._sent(True):  # the second look re-reads the file: a load just sent
                continue
            raise EngineOutputError(self.url, f"weight version {v!r}, which the run never sent to this external "
                                    f"engine (sent: {', '.join(self._sent()) or 'none'})")

    def request(self, method: str, path: str, *args: Any, **kw: Any):
        """The router's path (custom generate functions): a ``/generate`` answer's versions are checked too."""
        r = super().request(method, path, *args, **kw)
        if method == "POST" and path == "/generate":
            try:
                body = r.json()
            except ValueError:
                return r  # the router's own check names a body that is not JSON
            items = body if isinstance(body, list) else [body]
            self._check_versions([(i.get("meta_info") or {}).get("weight_version") if isinstance(i, dict) else None
                                  for i in items])
        return r

    async def agenerate(self, *args: Any, **kw: Any):
        gen = await super().agenerate(*args, **kw)
        self._check([gen])
        return gen

    async def agenerate_group(self, *args: Any, **kw: Any):
        gens = await super().agenerate_group(*args, **kw)
        self._check(gens)
        return gens


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
