"""The HTTP layer of relax_hpc's own engine-side servers (the CPU engine, the weight follower): routes answered
as SGLang answers them, on a bounded server (:mod:`relax_hpc.engines.http_server`), with the API key checked from
the headers before the body is read.

A route is ``path -> fn(body) -> (status, data)``; ``data`` is JSON, text, None (an empty body) or
:data:`JSON_NULL` (the body ``null``). An
:class:`HTTPError` raised by a route is answered ``{"error": {"message": ...}}`` with its status, as SGLang does.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import traceback
from pathlib import Path
from urllib.parse import urlsplit

from relax_hpc.engines.http_server import BoundedHandler, BoundedServer

log = logging.getLogger("relax_hpc.cpu_engine")

ENGINE_VERSION = "relax_hpc-cpu-engine/1"


class HTTPError(Exception):
    """An error answered as SGLang does: ``{"error": {"message": ...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message



JSON_NULL = object()  # a route's data answered as the JSON body ``null`` (what a FastAPI route returning None sends)

API_KEY_ENV = "RELAX_ENGINE_API_KEY"
_OPEN_PREFIXES = ("/health",)  # as SGLang's add_api_key_middleware: health checks need no key


def parse_json(raw: bytes):
    """``raw`` as JSON; :class:`HTTPError` 400 for a body nested deeper than the parser goes (a RecursionError
    otherwise, answered 500 as if the server were at fault)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise HTTPError(400, f"the JSON body nests deeper than this server parses (about "
                             f"{sys.getrecursionlimit()} levels)") from None


def ok(data):
    return 200, data


def route_handler(routes: dict, api_key: str | None = None):
    """An HTTP handler class answering ``routes`` (path → fn(body) → (status, data)) as SGLang answers, on a
    :class:`EngineServer`: the key is checked from the headers before the body is read, the body is bounded
    (:mod:`relax_hpc.engines.http_server`)."""

    class Handler(BoundedHandler):
        server_version = ENGINE_VERSION
        open_paths = _OPEN_PREFIXES  # what the server's door lets through without the key

        def _send(self, status: int, data) -> None:
            if data is None:
                payload, ctype = b"", "application/json"
            elif data is JSON_NULL:
                payload, ctype = b"null", "application/json"
            elif isinstance(data, str):
                payload, ctype = data.encode(), "text/plain; charset=utf-8"
            else:
                payload, ctype = json.dumps(data).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _dispatch(self) -> None:
            path = urlsplit(self.path).path
            raw = self.read_body(api_key, _OPEN_PREFIXES)
            if raw is None:  # refused (401, 413, ...) or the peer stopped sending: answered or nothing to answer
                return
            fn = routes.get(path)
            if fn is None:
                return self._send(404, {"error": {"message": f"no endpoint {path} on the CPU engine"}})
            try:
                body = parse_json(raw) if raw.strip() else {}
                if not isinstance(body, dict):
                    raise HTTPError(400, "request body must be a JSON object")
                status, data = fn(body)
            except HTTPError as e:
                status, data = e.status, {"error": {"message": e.message}}
            except json.JSONDecodeError as e:
                status, data = 400, {"error": {"message": f"invalid JSON body: {e}"}}
            except Exception as e:
                log.error("%s failed: %s", path, traceback.format_exc())
                status, data = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            try:
                self._send(status, data)
            except OSError:
                self.close_connection = True  # the client gave up (its deadline) or stopped reading

        do_GET = do_POST = do_PUT = _dispatch

    Handler.api_key = api_key
    return Handler


class EngineServer(BoundedServer):
    """The CPU engine's (and the weight follower's) HTTP server: a :class:`BoundedServer`."""


def advertised_host(host: str) -> str:
    """The host name others should use: a wildcard bind is reachable under this machine's name."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def read_api_key(path: str | None) -> str | None:
    """The key from ``--api-key-file`` or ``$RELAX_ENGINE_API_KEY`` (taken out of the environment once read)."""
    env_key = os.environ.pop(API_KEY_ENV, None)
    if path:
        key = Path(path).read_text().strip()
        if not key:
            raise SystemExit(f"--api-key-file {path} is empty")
        return key
    return env_key or None


def brief(v, limit: int = 80) -> str:
    """A value from a request body, for a message: its repr when short, else its kind and size; a message (which the
    engine logs) never carries more of a body than this."""
    text = repr(v)
    if len(text) <= limit:
        return text
    return f"a {type(v).__name__} of {len(v)}" if hasattr(v, "__len__") else f"a {type(v).__name__}"
