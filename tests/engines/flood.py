"""A flood of unauthenticated connections, as a hostile co-user of a node sends it (issue 47): idle sockets held
open, then a burst that connects and sends nothing, garbage, requests without the key or with a wrong one. Shared by
the engine-server and router tests."""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections import deque
from typing import Callable

KINDS = (
    b"",  # connects and says nothing
    b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n",  # a request without the key
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage",  # a TLS hello's start: never a complete head
    b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nContent-Length: 10\r\n\r\n0123456789",
)


def fds_for(n: int) -> int:
    """Make room for ``n`` more file descriptors in this process (raising the soft RLIMIT_NOFILE up to the hard
    one); returns how many it may open: ``n``, or less where the hard limit is lower (the flood is scaled to it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 512  # the server's sockets are counted by the caller; this is the rest of the process
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return n if soft == resource.RLIM_INFINITY else min(n, soft - 512)


class Flood:
    """Unauthenticated connections to 127.0.0.1:``port``. :meth:`hold` opens idle sockets and keeps them;
    :meth:`start` runs the burst in a thread (the :data:`KINDS` in turn, at most ``keep`` of its sockets open at
    once, the oldest closed first) until :meth:`stop`. ``made``: the burst's connections so far (``errors``: its
connects that failed); ``max_threads``:
    the most threads this process had while the burst ran (sampled by the burst)."""

    def __init__(self, port: int, keep: int = 1000, source: str = "127.0.0.1") -> None:
        self.port, self.keep, self.source = port, keep, source
        self.idle: list[socket.socket] = []
        self.held: deque[socket.socket] = deque()
        self.made = self.errors = self.max_threads = 0
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(30)
        s.bind((self.source, 0))
        s.connect(("127.0.0.1", self.port))
        return s

    def hold(self, n: int) -> None:
        for _ in range(n):
            self.idle.append(self._connect())

    def start(self) -> "Flood":
        self._thread = threading.Thread(target=self._burst, name="flood", daemon=True)
        self._thread.start()
        return self

    def _burst(self) -> None:
        i = 0
        while not self._stop.is_set():
            kind = KINDS[i % len(KINDS)]
            i += 1
            try:
                s = self._connect()
            except OSError:
                self.errors += 1
                continue
            try:
                if kind:
                    s.sendall(kind)
            except OSError:  # the server pushed it out before the send: that is what it does under a flood
                pass
            if kind.startswith(b"POST"):
                s.close()  # sent and gone
            else:
                self.held.append(s)
            while len(self.held) > self.keep:
                self.held.popleft().close()
            self.max_threads = max(self.max_threads, threading.active_count())
            with self._progress:
                self.made += 1
                self._progress.notify_all()

    def wait_made(self, n: int, timeout: float = 120.0) -> None:
        """Wait until the burst made ``n`` connections."""
        with self._progress:
            assert self._progress.wait_for(lambda: self.made >= n, timeout), f"the burst made {self.made} of {n}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        for s in [*self.idle, *self.held]:
            s.close()
        self.idle.clear()
        self.held.clear()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Wait for ``cond`` (a server counter reaching a value): an event, polled; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.01)
