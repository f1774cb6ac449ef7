"""The HTTP listeners relax_hpc opens itself (the CPU engine, the weight follower, the EngineRouter), bounded.

Why: these listen on shared nodes, where other users' processes can connect too. The stdlib's threading server
gives every connection a thread before it knows who is talking, so a local user holding 1,100 idle connections took
all 1,024 slots of an engine and its run's own requests were answered 503 until the run failed (issue 47). Here
a connection earns a thread only by showing the key:

* **A door before the threads.** One event-loop thread (the one running :meth:`BoundedServer.serve_forever`)
  accepts every connection and reads its request head (line and headers, at most :data:`MAX_HEAD` bytes) without
  a thread. A head carrying ``Authorization: Bearer KEY`` (constant-time compare) goes to a worker thread, which
  answers that one request and gives a kept-alive connection back to the door; a head without the key is answered
  401 by the door itself and closed; a keyless request to an open path (``/health``) gets one of at most
  ``max_open`` workers (:data:`MAX_OPEN_PER_PEER` per peer) and its connection is closed after the answer.
* **Slots: the key holders' first.** At most ``max_connections`` sockets are held in all, kept below the process's
  file limit (``RLIMIT_NOFILE``, with headroom: :func:`fd_budget`). A connection that has shown the key keeps its
  slot until it is idle for ``idle_s``; one that has not (no complete head yet, or a refusal being sent) holds a
  slot only while no one needs it: when the slots run out, a new connection pushes out an unauthenticated one
  (one that has sent nothing; of the peer holding the most such connections, its oldest first), answered 503. So a
  flood costs the run nothing but the door's time, and a peer's flood costs no peer holding fewer waiting
  connections one of them.
  A connection that owes its head for ``head_s`` is closed. When every slot is a key holder's, the door accepts
  nothing until one comes free: new connections wait in the listen backlog (a key holder's request waits, it is
  not refused).
* **Threads only for requests.** A worker thread lives for one request being answered: the server's threads are
  the door plus at most ``max_connections`` (one per slot), and none for a connection that has not shown the key
  (but ``max_open`` for keyless requests to open paths). The body is read by the worker under one deadline of
  ``idle_s``; writes time out after ``idle_s`` too.
* **The key comes before the body.** :meth:`BoundedHandler.read_body` checks the key again from the headers and
  answers 401 without reading a byte of the body; a claimed body over ``max_body`` bytes is answered 413 unread.
  Either closes the connection.

``idle_s`` must stay above the clients' keep-alive expiry (:class:`~relax_hpc.engines.client.EngineClient`: 4 s)
so that a client never reuses a connection the server is closing. What is left open: a key holder's new
connection whose head has not arrived while more than the free slots' worth of newer connections arrive from its
own address can be pushed out too (answered 503; the run's clients resend ``/generate`` after a 503); a server
without a key (``api_key`` None) treats every complete head as a key holder's.
"""

from __future__ import annotations

import errno
import hmac
import io
import json
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # above the driver's in-flight requests per engine (rollout.sglang_server_concurrency, 512)
IDLE_S = 15.0  # above the clients' keep-alive expiry (4 s)
HEAD_S = 5.0  # a new connection's first request head is due within this (the clients send it with the connect)
MAX_BODY = 64 << 20  # bytes: a batch of long prompts as JSON token ids, or a large model's weight-update names
OPEN_BODY = 4 << 10  # bytes of body a request to an open path (health, info) may send without the key
MAX_HEAD = 64 << 10  # bytes of request line and headers
MAX_OPEN = 4  # keyless requests to open paths served at once
MAX_OPEN_PER_PEER = 2
FD_SHARE = 0.75  # of the file descriptors free when the server starts, what its sockets may take
_DRAIN_S, _DRAIN_BYTES = 1.0, 256 << 10  # how long / how much of a refused request's body is read off before closing
_ACCEPT_BATCH = 64  # accepts per pass of the door, so heads that arrived are read between accepts
_WARN_EVERY_S = 60.0

_LISTENER, _WAKE = object(), object()


def _answer(status: int, reason: str, payload: Any) -> bytes:
    data = json.dumps(payload).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (status, reason.encode(), len(data), data))


_BUSY = _answer(503, "Service Unavailable", {"error": "too many connections to this server; try again"})
_TOO_LARGE = _answer(431, "Request Header Fields Too Large",
                     {"error": f"the request line and headers are over {MAX_HEAD} bytes"})


def key_matches(header: str | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY`` carries ``api_key`` (compared in constant time)."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {api_key}".encode())


def fd_budget(share: float = FD_SHARE) -> int | None:
    """How many sockets a server of this process may hold: ``share`` of the file descriptors free now under the soft
    ``RLIMIT_NOFILE`` (the rest stays for the process's files and its own outgoing connections); None: no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a modest process
        used = 64
    return max(8, int((soft - used) * share))


class _Conn:
    """One accepted connection and what the door knows of it."""

    __slots__ = ("sock", "address", "peer", "buf", "scanned", "authed", "open", "state", "due", "drained", "nodelay")

    def __init__(self, sock: socket.socket, address: Any) -> None:
        self.sock, self.address = sock, address
        self.peer = str(address[0]) if isinstance(address, tuple) and address else str(address)
        self.buf = bytearray()  # bytes read and not yet consumed: a head (and what followed it)
        self.scanned = 0  # bytes of buf searched for the head's end (a peer sending a byte at a time costs O(n))
        self.authed = False  # has shown the key: keeps its slot
        self.open = False  # being served a keyless request to an open path
        self.state = "pending"  # pending (no head yet, no key shown), idle (a key holder's, between requests),
        #                         busy (a worker has it), draining (answered by the door, being closed)
        self.due = 0.0
        self.drained = 0
        self.nodelay = False


class _Reader:
    """The handler's ``rfile``: the bytes the door read first, then the socket, under one deadline per read."""

    def __init__(self, conn: _Conn, idle_s: float) -> None:
        self.conn, self.idle_s, self.closed = conn, idle_s, False

    def _fill(self, deadline: float, want: int) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the peer sent too slowly (more than {self.idle_s:g} s)")
        sock = self.conn.sock
        sock.settimeout(left)
        try:
            chunk = sock.recv(max(1, min(want, 1 << 20)))
        finally:
            sock.settimeout(self.idle_s)
        if not chunk:
            return False
        self.conn.buf += chunk
        return True

    def readline(self, limit: int = -1) -> bytes:
        buf, deadline = self.conn.buf, time.monotonic() + self.idle_s
        i = buf.find(b"\n")
        while i < 0 and (limit < 0 or len(buf) < limit) and self._fill(deadline, 65536):
            i = buf.find(b"\n")
        end = len(buf) if i < 0 else i + 1
        if limit >= 0:
            end = min(end, limit)
        out = bytes(buf[:end])
        del buf[:end]
        return out

    def read(self, n: int = -1) -> bytes:
        buf, deadline = self.conn.buf, time.monotonic() + self.idle_s
        if n is None or n < 0:  # to the end of the stream
            while self._fill(deadline, 1 << 20):
                pass
            n = len(buf)
        while len(buf) < n and self._fill(deadline, n - len(buf)):
            pass
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def close(self) -> None:  # the socket is the server's, not the reader's
        self.closed = True


class _Writer(io.BufferedIOBase):
    """The handler's ``wfile``: every write sent at once (``sendall``, under the socket's timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._sock.sendall(b)
        with memoryview(b) as view:
            return view.nbytes


class BoundedServer(HTTPServer):
    """An HTTP server with the bounds of the module docstring; handlers derive from :class:`BoundedHandler`.

    ``api_key`` and ``open_paths`` default to the handler class's attributes of those names (None: no key).
    Counters (read them with :meth:`stats`): ``accepted``, ``unauthorized`` (401 from the door), ``pushed_out``
    (unauthenticated connections closed to make room), ``expired`` (closed for owing their head ``head_s``),
    ``refused`` (503: no worker free for a keyless open path, or no thread to be had), ``peak_workers``."""

    request_queue_size = 1024  # a burst of concurrent generates must not overflow the listen backlog
    fd_share = FD_SHARE

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS, idle_s: float = IDLE_S, max_body: int = MAX_BODY,
                 head_s: float | None = None, api_key: Any = ..., open_paths: tuple[str, ...] | None = None,
                 max_open: int = MAX_OPEN) -> None:
        head_s = min(HEAD_S, idle_s) if head_s is None else head_s
        if max_connections < 1 or idle_s <= 0 or head_s <= 0 or max_body < 0 or max_open < 0:
            raise ValueError(f"max_connections {max_connections} must be >= 1, idle_s {idle_s} and head_s {head_s} "
                             f"> 0, max_body {max_body} and max_open {max_open} >= 0")
        budget = fd_budget(self.fd_share)
        self.max_connections = int(max_connections) if budget is None else min(int(max_connections), budget)
        if self.max_connections < max_connections:
            log.info("%s: max_connections %d lowered to %d, what this process's file limit leaves (RLIMIT_NOFILE; "
                     "raise `ulimit -n` to hold more)", type(self).__name__, max_connections, self.max_connections)
        self.idle_s, self.head_s, self.max_body, self.max_open = float(idle_s), float(head_s), int(max_body), max_open
        self.api_key: str | None = getattr(handler, "api_key", None) if api_key is ... else api_key
        self.open_paths: tuple[str, ...] = tuple(open_paths if open_paths is not None
                                                 else getattr(handler, "open_paths", ()))
        self.accepted = self.unauthorized = self.pushed_out = self.expired = self.refused = self.peak_workers = 0
        self._lock = threading.Lock()  # guards the counters, _busy, _open_by_peer and _returned
        self._busy = 0  # connections a worker has (or that wait in _returned for the door)
        self._open_by_peer: dict[str, int] = {}
        self._returned: deque[_Conn] = deque()  # kept-alive connections the workers gave back
        # the door's own (only its thread touches these): each in order of when it is due
        self._pending: OrderedDict[_Conn, None] = OrderedDict()
        self._by_peer: dict[str, OrderedDict[_Conn, None]] = {}
        self._idle: OrderedDict[_Conn, None] = OrderedDict()
        self._draining: OrderedDict[_Conn, None] = OrderedDict()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._warned = (time.monotonic(), 0, 0, 0)  # when, and the counts then (unauthorized, pushed out, refused)
        self._fd_warned = float("-inf")
        self._full = False  # every slot a key holder's: the door accepts nothing until one comes free
        self._closes = 0  # sockets closed (the door's and the workers': a rough count, for "did one come free")
        super().__init__(address, handler)
        self.socket.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    # --- what the tests and the logs read -----------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The counters, and ``held`` (sockets now), ``workers`` (requests being answered now)."""
        with self._lock:
            return {"held": len(self._pending) + len(self._idle) + len(self._draining) + self._busy,
                    "workers": self._busy, "accepted": self.accepted, "unauthorized": self.unauthorized,
                    "pushed_out": self.pushed_out, "expired": self.expired, "refused": self.refused,
                    "peak_workers": self.peak_workers, "max_connections": self.max_connections}

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def _held(self) -> int:
        return len(self._pending) + len(self._idle) + len(self._draining) + self._busy

    # --- the door -----------------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Run the door until :meth:`shutdown` (``poll_interval`` is not needed: a shutdown wakes it)."""
        if self._stop.is_set():
            return
        self._stopped.clear()
        sel = selectors.DefaultSelector()
        self._sel = sel
        accepting, no_fd_until = False, 0.0
        try:
            sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
            while not self._stop.is_set():
                now = time.monotonic()
                # every slot a key holder's: new connections wait in the listen backlog until one comes free (a
                # worker that closes one wakes the door); no file descriptor to be had: the same, for 50 ms
                self._full = self._held() >= self.max_connections and not self._pending and not self._draining
                want = not self._full and now >= no_fd_until
                if want and not accepting:
                    sel.register(self.socket, selectors.EVENT_READ, _LISTENER)
                elif accepting and not want:
                    sel.unregister(self.socket)
                accepting = want
                fronts = [next(iter(d)).due for d in (self._pending, self._idle, self._draining) if d]
                timeout = max(0.0, min([1.0, *(due - now for due in fronts)]))
                accept = False
                for key, _ in sel.select(timeout):
                    if key.data is _LISTENER:
                        accept = True
                    elif key.data is _WAKE:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    elif key.data.state in ("pending", "idle", "draining"):  # not handed on earlier in this pass
                        self._read(key.data)
                self._take_returned()
                if accept and not self._accept_some():
                    no_fd_until = time.monotonic() + 0.05
                self._expire(time.monotonic())
                self._warn_flood()
        finally:
            for d in (self._pending, self._idle, self._draining):
                for c in list(d):
                    self._close(c)
            sel.close()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait for it; connections a worker has are closed when it is done."""
        self._stop.set()
        self._wake()
        self._stopped.wait()

    def server_close(self) -> None:
        self._stop.set()
        self._wake()
        super().server_close()
        if self._stopped.wait(5.0):
            for s in (self._wake_r, self._wake_w):
                s.close()

    def handle_request(self) -> None:
        raise NotImplementedError("a BoundedServer serves with serve_forever()")

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _accept_some(self) -> bool:
        """Accept what waits (a batch); False when no file descriptor can be had and none can be freed."""
        for _ in range(_ACCEPT_BATCH):
            if self._held() >= self.max_connections and not self._pending and not self._draining:
                return True  # every slot a key holder's: the rest wait in the backlog
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if time.monotonic() - self._fd_warned >= _WARN_EVERY_S:
                        self._fd_warned = time.monotonic()
                        log.warning("%s: no file descriptor for a new connection (%s); connections without the key "
                                    "are closed to make room, else new ones wait (raise `ulimit -n`)",
                                    type(self).__name__, e)
                    closed = self._closes
                    self._make_room()
                    if self._closes > closed:  # a descriptor came free: try again
                        continue
                    return False
                return True  # the peer went before we took it (ECONNABORTED ...)
            self._admit(sock, address)
        return True

    def _admit(self, sock: socket.socket, address: Any) -> None:
        conn = _Conn(sock, address)
        self._count("accepted")
        if self._held() >= self.max_connections and not self._make_room():
            self._count("refused")
            self._send_close(sock, _BUSY)
            return
        try:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):
            self._shut(sock)
            return
        conn.due = time.monotonic() + self.head_s
        self._pending[conn] = None
        self._by_peer.setdefault(conn.peer, OrderedDict())[conn] = None
        self._read(conn)  # the head is often there already: a client sends it right after connecting

    def _make_room(self) -> bool:
        """Close one unauthenticated connection: one being closed anyway, else of the peer holding the most, its
        oldest that has sent nothing (one whose bytes arrived is read instead). False: every slot a key holder's."""
        for _ in range(8):
            if self._draining:
                self._close(next(iter(self._draining)))
                return True
            if not self._pending:
                return self._held() < self.max_connections
            peer = max(self._by_peer, key=lambda p: len(self._by_peer[p]))
            victim = next(iter(self._by_peer[peer]))
            if self._read(victim):  # it spoke (or went): whatever it said is dealt with; look again
                if self._held() < self.max_connections:
                    return True
                continue
            self._push_out(victim)
            return True
        victim = next(iter(self._draining), None) or next(iter(self._pending), None)
        if victim is None:
            return self._held() < self.max_connections
        self._push_out(victim)
        return True

    def _push_out(self, conn: _Conn) -> None:
        self._send_close(conn.sock, _BUSY, conn)
        self._count("pushed_out")  # after: whoever reads the counter finds the answer sent

    def _read(self, conn: _Conn) -> bool:
        """Read what ``conn`` sent and act on it; False when nothing had arrived."""
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self._close(conn)
            return True
        if not data:
            self._close(conn)
            return True
        if conn.state == "draining":
            conn.drained += len(data)
            if conn.drained >= _DRAIN_BYTES:
                self._close(conn)
            return True
        conn.buf += data
        try:
            self._on_bytes(conn)
        except Exception:  # one connection's trouble must not stop the door
            log.exception("%s: dropped a connection from %s", type(self).__name__, conn.peer)
            if conn.state != "busy":
                self._close(conn)
        return True

    def _on_bytes(self, conn: _Conn) -> None:
        """A head complete in ``conn.buf``: to a worker, or answered here; too long: 431."""
        buf = conn.buf
        start = max(0, conn.scanned - 3)
        end = buf.find(b"\r\n\r\n", start)
        end = end + 4 if end >= 0 else -1
        lf = buf.find(b"\n\n", start)
        if lf >= 0 and (end < 0 or lf + 2 < end):
            end = lf + 2
        if end < 0:
            conn.scanned = len(buf)
            if len(buf) > MAX_HEAD:
                self._answer_close(conn, _TOO_LARGE)
            return
        conn.scanned = 0  # the worker takes this head; what follows it is searched afresh
        if end > MAX_HEAD:
            return self._answer_close(conn, _TOO_LARGE)
        lines = bytes(buf[:end]).split(b"\n")
        parts = lines[0].split()
        try:
            path = urlsplit(parts[1].decode("latin-1")).path if len(parts) >= 2 else ""
        except ValueError:  # not a URL: no open path
            path = ""
        auth = None
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep and name.strip().lower() == b"authorization":
                auth = value.strip().decode("latin-1")
                break
        if not self.api_key or key_matches(auth, self.api_key):
            conn.authed = True
            return self._to_worker(conn)
        if self.open_paths and path.startswith(self.open_paths):
            with self._lock:
                free = self._open_total() < self.max_open and \
                    self._open_by_peer.get(conn.peer, 0) < min(self.max_open, MAX_OPEN_PER_PEER)
                if free:
                    self._open_by_peer[conn.peer] = self._open_by_peer.get(conn.peer, 0) + 1
                else:
                    self.refused += 1
            if free:
                conn.open = True
                return self._to_worker(conn)
            return self._answer_close(conn, _BUSY)
        self._count("unauthorized")
        payload = getattr(self.RequestHandlerClass, "unauthorized_payload", {"error": "Unauthorized"})
        self._answer_close(conn, _answer(401, "Unauthorized", payload))

    def _open_total(self) -> int:
        return sum(self._open_by_peer.values())

    def _unlist(self, conn: _Conn) -> None:
        """Take ``conn`` off the door's lists (not the selector)."""
        if conn.state == "pending":
            self._pending.pop(conn, None)
            mine = self._by_peer.get(conn.peer)
            if mine is not None:
                mine.pop(conn, None)
                if not mine:
                    del self._by_peer[conn.peer]
        elif conn.state == "idle":
            self._idle.pop(conn, None)
        elif conn.state == "draining":
            self._draining.pop(conn, None)

    def _to_worker(self, conn: _Conn) -> None:
        self._unlist(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.state = "busy"
        with self._lock:
            self._busy += 1
            self.peak_workers = max(self.peak_workers, self._busy)
        try:
            conn.sock.settimeout(self.idle_s)
            threading.Thread(target=self._work, args=(conn,), name=f"http:{self.server_address[1]}",
                             daemon=True).start()
        except (RuntimeError, OSError):  # no thread to be had: this connection goes, the server goes on
            self._count("refused")
            self._send_close(conn.sock, _BUSY)
            self._finish(conn, keep=False)

    def _answer_close(self, conn: _Conn, reply: bytes) -> None:
        """Answer ``reply`` from the door, then read off what the peer still sends (a body), briefly, and close:
        closing with unread bytes makes the kernel send a reset, which can destroy the answer before it is read."""
        self._unlist(conn)
        try:
            conn.sock.send(reply)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self._close(conn, listed=False)
        conn.buf.clear()
        conn.state, conn.due = "draining", time.monotonic() + _DRAIN_S
        self._draining[conn] = None

    def _send_close(self, sock: socket.socket, reply: bytes, conn: _Conn | None = None) -> None:
        try:
            sock.setblocking(False)
            sock.send(reply)
        except OSError:
            pass
        if conn is not None:
            self._close(conn)
        else:
            self._shut(sock)

    def _close(self, conn: _Conn, listed: bool = True) -> None:
        if listed:
            self._unlist(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, AttributeError):
            pass
        conn.state = "closed"
        self._shut(conn.sock)

    def _shut(self, sock: socket.socket) -> None:
        self._closes += 1
        try:
            sock.close()
        except OSError:
            pass

    def _expire(self, now: float) -> None:
        for d, counted in ((self._pending, True), (self._idle, False), (self._draining, False)):
            while d:
                conn = next(iter(d))
                if conn.due > now:
                    break
                if counted:
                    self._count("expired")
                self._close(conn)

    def _take_returned(self) -> None:
        while True:
            with self._lock:
                if not self._returned:
                    return
                conn = self._returned.popleft()
                self._busy -= 1
            try:
                conn.sock.setblocking(False)
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError):
                self._shut(conn.sock)
                continue
            conn.state, conn.due = "idle", time.monotonic() + self.idle_s
            self._idle[conn] = None
            if conn.buf:  # the next request came with the last one
                self._on_bytes(conn)

    def _warn_flood(self) -> None:
        now = time.monotonic()
        when, *seen = self._warned
        if now - when < _WARN_EVERY_S:
            return
        counts = (self.unauthorized, self.pushed_out, self.refused)
        self._warned = (now, *counts)
        new = [c - s for c, s in zip(counts, seen)]
        if sum(new[1:]) or new[0] > 100:
            peers = sorted(self._by_peer, key=lambda p: -len(self._by_peer[p]))[:3]
            log.warning("%s on port %d, last %.0f s: %d requests without the key answered 401, %d connections that "
                        "had not shown it closed to make room, %d refused (503); most waiting connections from %s",
                        type(self).__name__, self.server_address[1], now - when, *new, ", ".join(peers) or "none")

    # --- the workers ----------------------------------------------------------------------------------
    def _work(self, conn: _Conn) -> None:
        keep = False
        try:
            handler = self.RequestHandlerClass(conn, conn.address, self)  # answers one request
            keep = conn.authed and not conn.open and not handler.close_connection
        except Exception:
            import sys

            if not isinstance(sys.exc_info()[1], OSError):  # the peer went away or was too slow: nothing to report
                self.handle_error(conn.sock, conn.address)
        finally:
            self._finish(conn, keep)

    def _finish(self, conn: _Conn, keep: bool) -> None:
        with self._lock:
            if conn.open:
                conn.open = False
                n = self._open_by_peer.get(conn.peer, 1) - 1
                if n > 0:
                    self._open_by_peer[conn.peer] = n
                else:
                    self._open_by_peer.pop(conn.peer, None)
            keep = keep and not self._stop.is_set()  # a door that stopped takes nothing back
            if keep:
                self._returned.append(conn)
            else:
                self._busy -= 1
        if keep:
            self._wake()
        else:
            conn.state = "closed"
            self._shut(conn.sock)
            if self._full:  # the door waits for a slot to come free
                self._wake()

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], OSError):  # the peer went away or was too slow: nothing to report
            return
        super().handle_error(request, client_address)


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler for :class:`BoundedServer`: one request per worker (a kept-alive connection goes back to the
    door between requests), Nagle off, no per-request log lines. A ``do_*`` method calls :meth:`read_body` first
    and answers only if it returned bytes. Class attributes the server reads: ``api_key``, ``open_paths`` and
    ``unauthorized_payload`` (the door's 401 answer)."""

    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections for many calls
    # a reply is written in pieces (status, headers, body): with Nagle on, the last piece waits for the client's
    # delayed ACK, ~40 ms per call on Linux (measured: 41 ms vs 1 ms per weight-update call)
    disable_nagle_algorithm = True
    api_key: str | None = None
    open_paths: tuple[str, ...] = ()
    unauthorized_payload: Any = {"error": "Unauthorized"}
    server: BoundedServer
    request: _Conn

    def setup(self) -> None:
        conn = self.request
        self.connection = conn.sock
        if self.disable_nagle_algorithm and not conn.nodelay:
            try:
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            except OSError:
                pass
            conn.nodelay = True
        self.rfile = _Reader(conn, self.server.idle_s)
        self.wfile = _Writer(conn.sock)

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def end_headers(self) -> None:
        if (self.request.open or not self.request.authed) and not self.close_connection:  # keyless: it goes after
            self.send_header("Connection", "close")
        super().end_headers()

    def log_message(self, fmt: str, *args: Any) -> None:  # per-request lines would drown the log
        pass

    def read_body(self, api_key: str | None, open_paths: tuple[str, ...] = ()) -> bytes | None:
        """The request's body, once the key in its headers is checked (unless ``api_key`` is None or the path
        starts with one of ``open_paths``); None after answering 401 (no or wrong key), 400 (a bad
        Content-Length), 411 (a chunked body) or 413 (over ``max_body``) without reading the body."""
        path = urlsplit(self.path).path
        keyed = bool(api_key) and key_matches(self.headers.get("Authorization"), api_key)
        if api_key and not keyed and not path.startswith(open_paths):
            return self.refuse(401, type(self).unauthorized_payload)
        limit = self.server.max_body if keyed or not api_key else OPEN_BODY  # who showed no key sends next to nothing
        if self.headers.get("Transfer-Encoding"):
            return self.refuse(411, {"error": "send the body with a Content-Length"})
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if n < 0:
                raise ValueError(n)
        except ValueError:
            return self.refuse(400, {"error": f"bad Content-Length {self.headers.get('Content-Length')!r}"})
        if n > limit:
            return self.refuse(413, {"error": f"a body of {n} bytes is over this server's limit of {limit}"})
        try:
            body = self.rfile.read(n) if n else b""
        except OSError:  # timed out, or the peer went
            body = b""
        if len(body) < n:  # the peer stopped sending (or was too slow): nothing to answer
            self.close_connection = True
            return None
        return body

    def refuse(self, status: int, payload: Any) -> None:
        """Answer ``status`` and close the connection, leaving the body unread."""
        self.close_connection = True
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
            # closing with unread bytes makes the kernel send a reset, which can destroy the answer before the
            # client read it: end our side, then read off (at most 256 KiB in 1 s) what the client is sending
            self.connection.shutdown(socket.SHUT_WR)
            until, drained = time.monotonic() + _DRAIN_S, 0
            while drained < _DRAIN_BYTES and (left := until - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(64 << 10)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass
        return None
