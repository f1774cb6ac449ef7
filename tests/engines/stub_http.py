"""A real HTTP/1.1 server for a test's stand-in engine: the test's handler class says what it answers, this serves it
on 127.0.0.1 from a daemon thread. The client-fault, engine-output and request-deadline tests share it."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubHandler(BaseHTTPRequestHandler):
    """Keep-alive, no per-request log lines, and :meth:`send_json`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send_json(self, status: int, body: bytes, length: int | None = None) -> None:
        """Answer ``status`` with ``body``; ``length`` claims another Content-Length (a body cut short, or one that
        trickles)."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a burst of connections at once is queued, not reset (the listen backlog is 5)


class StubServer:
    """``handler`` served at :attr:`url` until :meth:`close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
