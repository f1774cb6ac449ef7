"""Calls on daemon threads of their own: the one helper for reward functions, environment calls and weight syncs.

Why daemon threads, and never joined: a call that hangs (a reward function past its timeout, an environment that
never answers, a collective whose peer died) is left behind where it is. ``asyncio.to_thread`` and a
``ThreadPoolExecutor`` would make the batch, or the interpreter's exit, wait for it.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Callable


def daemon_call(fn: Callable[..., Any], *args: Any, thread_name: str = "daemon-call", **kwargs: Any) -> Future:
    """``fn(*args, **kwargs)`` in a new daemon thread, as a :class:`concurrent.futures.Future` (for threads)."""
    fut: Future = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)

    threading.Thread(target=run, name=thread_name, daemon=True).start()
    return fut


def in_daemon_thread(fn: Callable[..., Any], *args: Any, thread_name: str | None = None,
                     **kwargs: Any) -> asyncio.Future:
    """``fn(*args, **kwargs)`` in a new daemon thread, as a future of the running loop (for coroutines). A future
    cancelled meanwhile (its timeout) drops the answer; a loop closed meanwhile is not told."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not fut.done():  # cancelled (timed out) meanwhile: nobody wants the answer any more
            fut.set_result(value) if ok else fut.set_exception(value)

    def run() -> None:
        try:
            out = (True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            out = (False, e)
        try:
            loop.call_soon_threadsafe(deliver, *out)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    threading.Thread(target=run, name=thread_name or getattr(fn, "__name__", "daemon-call"), daemon=True).start()
    return fut
