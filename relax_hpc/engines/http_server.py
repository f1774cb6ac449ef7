"""The HTTP listeners relax_hpc opens itself (the CPU engine, the weight follower, the EngineRouter), bounded.

Why: these listen on shared nodes, where other users' processes can connect too. The stdlib's threading server
gives every connection a thread for as long as the peer likes and reads whatever body it claims, so 300 idle
connections held 300 threads for ever, and one request claiming a 1 GB body held one too. Here:

* **Threads are capped.** At most ``max_connections`` connections are served at once, one thread each; a
  connection over the cap is answered 503 and closed at once, without a thread (:attr:`BoundedServer.refused`).
* **Peers must keep talking.** A connection owes its request line, headers and body within ``idle_s`` of the
  moment the server waits for them, and a kept-alive connection that sends nothing for ``idle_s`` is closed: a
  reaper thread shuts such sockets (a socket timeout alone would let a peer sending a byte now and then hold a
  thread for ever). While the server computes an answer nothing is owed. Writes time out after ``idle_s`` too.
* **The key comes before the body.** :meth:`BoundedHandler.read_body` checks ``Authorization: Bearer KEY``
  (constant-time) from the headers and answers 401 without reading a byte of the body; a claimed body over
  ``max_body`` bytes is answered 413 unread. Either closes the connection.

``idle_s`` must stay above the clients' keep-alive expiry (:class:`~relax_hpc.engines.client.EngineClient`: 4 s)
so that a client never reuses a connection the server is closing.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # above the driver's in-flight requests per engine (rollout.sglang_server_concurrency, 512)
IDLE_S = 15.0  # above the clients' keep-alive expiry (4 s)
MAX_BODY = 64 << 20  # bytes: a batch of long prompts as JSON token ids, or a large model's weight-update names
OPEN_BODY = 4 << 10  # bytes of body a request to an open path (health, info) may send without the key

_BUSY_BODY = b'{"error": "too many connections to this server; try again"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def key_matches(header: str | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY`` carries ``api_key`` (compared in constant time)."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {api_key}".encode())


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server with the bounds of the module docstring; handlers derive from :class:`BoundedHandler`."""

    daemon_threads = True
    block_on_close = False  # idle keep-alive connections must not hold up shutdown
    request_queue_size = 1024  # a burst of concurrent generates must not overflow the listen backlog

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS, idle_s: float = IDLE_S, max_body: int = MAX_BODY) -> None:
        if max_connections < 1 or idle_s <= 0 or max_body < 0:
            raise ValueError(f"max_connections {max_connections} must be >= 1, idle_s {idle_s} > 0, max_body "
                             f"{max_body} >= 0")
        self.max_connections, self.idle_s, self.max_body = int(max_connections), float(idle_s), int(max_body)
        self.refused = 0  # connections answered 503 because max_connections were being served
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._owed: dict[socket.socket, float] = {}  # connection -> when what it owes is due
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        super().__init__(address, handler)
        self._reaper = threading.Thread(target=self._reap, name=f"http-reaper:{self.server_address[1]}", daemon=True)
        self._reaper.start()

    # --- the thread cap ---------------------------------------------------------------------------
    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.refused += 1
            try:
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.settled(request)
            self._slots.release()

    # --- what a connection owes ---------------------------------------------------------------------
    def owes(self, conn: socket.socket) -> None:
        """``conn`` must send what the server waits for (a request, or the rest of one) within ``idle_s``."""
        with self._lock:
            self._owed[conn] = time.monotonic() + self.idle_s

    def settled(self, conn: socket.socket) -> None:
        """``conn``'s request is read: nothing is owed while the server answers it."""
        with self._lock:
            self._owed.pop(conn, None)

    def _reap(self) -> None:
        while not self._stopping.wait(min(1.0, self.idle_s / 4)):
            now = time.monotonic()
            with self._lock:  # under the lock: a connection settled meanwhile is never shut
                late = [c for c, due in self._owed.items() if due <= now]
                for c in late:
                    del self._owed[c]
                    try:
                        c.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once; the thread then ends
                    except OSError:
                        pass

    def handle_error(self, request: socket.socket, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], OSError):  # the peer went away or was too slow: nothing to report
            return
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        self._stopping.set()
        super().server_close()


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler for :class:`BoundedServer`: keep-alive, Nagle off, no per-request log lines. A ``do_*`` method
    calls :meth:`read_body` first and answers only if it returned bytes."""

    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections for many calls
    # a reply is written in pieces (status, headers, body): with Nagle on, the last piece waits for the client's
    # delayed ACK, ~40 ms per call on Linux (measured: 41 ms vs 1 ms per weight-update call)
    disable_nagle_algorithm = True
    server: BoundedServer

    def setup(self) -> None:
        self.timeout = self.server.idle_s  # bounds each read and write; the reaper bounds a whole request
        super().setup()

    def handle_one_request(self) -> None:
        self.server.owes(self.connection)  # the next request line, headers and body are due within idle_s
        super().handle_one_request()

    def log_message(self, fmt: str, *args: Any) -> None:  # per-request lines would drown the log
        pass

    def read_body(self, api_key: str | None, open_paths: tuple[str, ...] = ()) -> bytes | None:
        """The request's body, once the key in its headers is checked (unless ``api_key`` is None or the path
        starts with one of ``open_paths``); None after answering 401 (no or wrong key), 400 (a bad
        Content-Length), 411 (a chunked body) or 413 (over ``max_body``) without reading the body."""
        path = urlsplit(self.path).path
        keyed = bool(api_key) and key_matches(self.headers.get("Authorization"), api_key)
        if api_key and not keyed and not path.startswith(open_paths):
            return self.refuse(401, {"error": "Unauthorized"})
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
        except OSError:  # timed out or shut by the reaper
            body = b""
        if len(body) < n:  # the peer stopped sending (or was too slow): nothing to answer
            self.close_connection = True
            return None
        self.server.settled(self.connection)
        return body

    def refuse(self, status: int, payload: Any) -> None:
        """Answer ``status`` and close the connection, leaving the body unread."""
        self.server.settled(self.connection)
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
            until, drained = time.monotonic() + 1.0, 0
            while drained < 256 << 10 and (left := until - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(64 << 10)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass
        return None
