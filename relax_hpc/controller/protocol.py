"""The control wire format: the one place that knows how roles (and tools) talk to the controller.

Newline-delimited JSON over TCP. A request is one JSON object on one line with a ``type`` and the run's
``token``; the reply is one line, ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. A client keeps
one connection open and sends requests one after another on it.

The token (``RUN_DIR/token``, mode 0600) is what proves a peer belongs to the run: the socket listens on a
port any local user can reach, and a forged ``error`` or ``heartbeat`` would kill or fake-keep-alive a
run. A request with a missing or wrong token (or malformed) is logged, answered with an error and its
connection is closed; the handler never sees it. Tokens are compared in constant time.

Request types (fields besides ``type`` and ``token``):

- ``hello``     role, rank, world, node, pid               a rank has started
- ``heartbeat`` role, rank, node, phase, info (dict)       liveness + progress; info carries check results
- ``error``     role, rank, node, traceback                a rank failed; the run fails with it
- ``publish``   key, value                                 store an address (e.g. the cross-role group's)
- ``lookup``    key                                        reply ``found`` and ``value``
- ``next_task`` role, rank, wait_s                         long poll by a role's rank 0: reply ``task`` (an
                                                           object with ``id`` and ``kind``) or null after
                                                           ``wait_s`` (at most :data:`MAX_TASK_WAIT_S`)
- ``task_done`` role, rank, task_id, result (dict)         the task's outcome; ``result["error"]`` (a string)
                                                           fails the run with that report
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import socketserver
import threading
import time
from typing import Any, Callable

log = logging.getLogger("relax_hpc.control")

MAX_LINE = 1 << 20  # one request; larger is refused (a peer cannot make the controller buffer without bound)
PHASES = ("starting", "bootstrap", "ready", "done", "failed")
MAX_TASK_WAIT_S = 5.0  # a next_task long poll: well under the client's socket timeout

# required fields and their types, per request type
FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"role": str, "rank": int, "world": int, "node": str, "pid": int},
    "heartbeat": {"role": str, "rank": int, "node": str, "phase": str, "info": dict},
    "error": {"role": str, "rank": int, "node": str, "traceback": str},
    "publish": {"key": str, "value": (str, int, float, bool, dict, list)},
    "lookup": {"key": str},
    "next_task": {"role": str, "rank": int, "wait_s": (int, float)},
    "task_done": {"role": str, "rank": int, "task_id": int, "result": dict},
    "control": {"action": str},  # from relax-cancel: see CONTROL_ACTIONS
}
# what a user may ask of a running controller: checkpoint, then end the run (cancel) or this attempt (requeue)
CONTROL_ACTIONS = ("checkpoint_cancel", "checkpoint_requeue")


class ProtocolError(Exception):
    """A request that is not well-formed, or an ``ok: false`` reply."""


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict:
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    return msg


def token_ok(given: Any, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def validate(msg: dict) -> None:
    """Raise :class:`ProtocolError` unless ``msg`` is a known type with its fields (token already checked)."""
    kind = msg.get("type")
    if kind not in FIELDS:
        raise ProtocolError(f"unknown message type {kind!r}; known: {', '.join(FIELDS)}")
    for name, tp in FIELDS[kind].items():
        value = msg.get(name)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ProtocolError(f"{kind}: field {name!r} missing or of the wrong type")
    if kind == "heartbeat" and msg["phase"] not in PHASES:
        raise ProtocolError(f"heartbeat: phase must be one of {', '.join(PHASES)}")
    if kind == "control" and msg["action"] not in CONTROL_ACTIONS:
        raise ProtocolError(f"control: action must be one of {', '.join(CONTROL_ACTIONS)}")


# ------------------------------------------------------------------------------------------ server ---

Handler = Callable[[dict], dict]


class Server:
    """Listens on ``(bind_host, 0)``: the kernel picks the port, so runs sharing a node never collide.

    Each accepted, valid request goes to ``handler`` (from the connection's thread), whose dict is the
    reply. Rejections never reach the handler.
    """

    def __init__(self, token: str, handler: Handler, bind_host: str = "127.0.0.1", idle_timeout_s: float = 600):
        outer = self

        class _Conn(socketserver.StreamRequestHandler):
            timeout = idle_timeout_s  # a silent connection is dropped; clients reconnect

            def handle(self) -> None:
                with outer._lock:
                    outer._conns.add(self.connection)
                try:
                    outer._serve_connection(self)
                finally:
                    with outer._lock:
                        outer._conns.discard(self.connection)

        class _TCP(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._token = token
        self._handler = handler
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._tcp = _TCP((bind_host, 0), _Conn)
        self.port: int = self._tcp.server_address[1]
        self._thread = threading.Thread(target=self._tcp.serve_forever, args=(0.1,), name="control-server", daemon=True)

    def start(self) -> "Server":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop listening and drop every open connection (clients see the controller gone)."""
        self._tcp.shutdown()
        self._tcp.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _serve_connection(self, conn: socketserver.StreamRequestHandler) -> None:
        peer = "%s:%s" % conn.client_address[:2]
        while True:
            try:
                line = conn.rfile.readline(MAX_LINE + 1)
            except OSError:
                return
            if not line:
                return
            reply, keep = self._answer(line, peer)
            try:
                conn.wfile.write(encode(reply))
                conn.wfile.flush()
            except OSError:
                return
            if not keep:
                return

    def _answer(self, line: bytes, peer: str) -> tuple[dict, bool]:
        """(reply, keep the connection open)."""
        if len(line) > MAX_LINE or not line.endswith(b"\n"):
            log.warning("rejected a request from %s: longer than %d bytes", peer, MAX_LINE)
            return {"ok": False, "error": "request too long"}, False
        try:
            msg = decode(line)
        except ProtocolError as e:
            log.warning("rejected a request from %s: %s", peer, e)
            return {"ok": False, "error": str(e)}, False
        if not token_ok(msg.get("token"), self._token):
            log.warning("rejected %r from %s: missing or wrong run token", msg.get("type"), peer)
            return {"ok": False, "error": "rejected: missing or wrong run token"}, False
        try:
            validate(msg)
        except ProtocolError as e:
            log.warning("rejected a request from %s: %s", peer, e)
            return {"ok": False, "error": str(e)}, False
        msg.pop("token")
        try:
            return {"ok": True, **self._handler(msg)}, True
        except Exception as e:  # a handler bug must not kill the connection thread silently
            log.exception("handler failed on %s from %s", msg.get("type"), peer)
            return {"ok": False, "error": f"controller error: {e}"}, True


# ------------------------------------------------------------------------------------------ client ---


class Client:
    """A role's (or tool's) end: one connection, one request at a time (thread-safe), reconnects once."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float = 10.0):
        self.addr = (host, port)
        self._token = token
        self._timeout = timeout_s
        self._sock: socket.socket | None = None
        self._file = None
        self._lock = threading.Lock()

    def request(self, kind: str, **fields: Any) -> dict:
        """Send one request; return the reply. Raises OSError (unreachable) or ProtocolError (refused)."""
        data = encode({"type": kind, "token": self._token, **fields})
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._connect()
                    self._sock.sendall(data)
                    line = self._file.readline(MAX_LINE + 1)
                    if not line:
                        raise ConnectionError("controller closed the connection")
                    break
                except OSError:
                    self._drop()
                    if attempt:
                        raise
        reply = decode(line)
        if not reply.get("ok"):
            if reply.get("error", "").startswith("controller error"):
                pass  # the handler failed; the connection is still good
            else:
                self.close()  # the server closed it after a refusal
            raise ProtocolError(reply.get("error", "refused"))
        return reply

    def hello(self, role: str, rank: int, world: int, node: str, pid: int) -> dict:
        return self.request("hello", role=role, rank=rank, world=world, node=node, pid=pid)

    def heartbeat(self, role: str, rank: int, node: str, phase: str, info: dict | None = None) -> dict:
        return self.request("heartbeat", role=role, rank=rank, node=node, phase=phase, info=info or {})

    def error(self, role: str, rank: int, node: str, traceback: str) -> dict:
        return self.request("error", role=role, rank=rank, node=node, traceback=traceback)

    def publish(self, key: str, value: Any) -> dict:
        return self.request("publish", key=key, value=value)

    def lookup(self, key: str, wait_s: float = 0.0, poll_s: float = 0.1) -> Any:
        """The value published under ``key``; waits up to ``wait_s``. Raises TimeoutError if never published."""
        deadline = time.monotonic() + wait_s
        while True:
            reply = self.request("lookup", key=key)
            if reply.get("found"):
                return reply["value"]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing was published under {key!r} within {wait_s:.0f}s")
            time.sleep(poll_s)

    def next_task(self, role: str, rank: int, wait_s: float = MAX_TASK_WAIT_S) -> dict | None:
        """The controller's next task for ``role`` (``{"id", "kind", ...}``), or None if none came in ``wait_s``."""
        return self.request("next_task", role=role, rank=rank, wait_s=min(float(wait_s), MAX_TASK_WAIT_S)).get("task")

    def task_done(self, role: str, rank: int, task_id: int, result: dict) -> dict:
        return self.request("task_done", role=role, rank=rank, task_id=task_id, result=result)

    def control(self, action: str) -> dict:
        return self.request("control", action=action)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _connect(self) -> None:
        self._sock = socket.create_connection(self.addr, timeout=self._timeout)
        self._file = self._sock.makefile("rb")

    def _drop(self) -> None:
        for thing in (self._file, self._sock):
            try:
                if thing is not None:
                    thing.close()
            except OSError:
                pass
        self._sock = self._file = None
