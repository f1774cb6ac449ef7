"""A local router in front of the rollout engines, for custom generate functions written against Relax.

Why: a Relax generate function (``--custom-generate-function-path``) talks HTTP to SGLang's router at
``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`` and never imports Relax. To run such a
function unchanged, the rollout role serves that address itself: ``POST /generate`` (SGLang's body and answer,
passed through untouched, so token ids and ``output_token_logprobs`` are the engine's) goes to the least-busy
live engine of the driver (:class:`LeastBusy`), with the run's API key and the clients' retries and total deadline; an engine that
stops answering is skipped for the next one. Each answer is checked as the driver checks its own
(:func:`~relax_hpc.rollout.client.parse_generation`: finite log-probs at most 0, token ids in the model's
vocabulary, consistent counts): an engine whose answer fails is declared dead through the driver (reported,
restarted by the controller) and the request goes to the next engine; with none left the answer is 503 naming
every dead engine and why. ``GET /health`` answers 200. It listens on 127.0.0.1 only.

The stdlib's threading HTTP server on purpose: each request blocks its own thread while the engine client
(thread-safe, on its own event loop) does the call, so a generate function awaiting the router never waits on
the event loop it runs in.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Sequence

from relax_hpc.rollout.client import EngineError, EngineOutputError, parse_generation, requested_max_new_tokens

if TYPE_CHECKING:
    from relax_hpc.rollout.driver import RolloutDriver

log = logging.getLogger(__name__)


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


class _Server(ThreadingHTTPServer):
    # a step sends every sample's request at once (128 in the quickstart): the stdlib's listen backlog of 5 let
    # connections overflow the accept queue, and their clients saw resets (ReadError) instead of answers
    request_queue_size = 4096


class EngineRouter:
    """``POST /generate`` on 127.0.0.1:``port``, spread over ``driver``'s live engines."""

    def __init__(self, driver: RolloutDriver) -> None:
        self.driver = driver
        self._picker = LeastBusy()
        self._lock = threading.Lock()
        self.requests = 0
        router = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True  # replies go out in pieces: never wait for the client's delayed ACK

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

            def do_POST(self) -> None:
                if self.path != "/generate":
                    return self._answer(404, {"error": f"this router serves POST /generate, not {self.path}"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                except ValueError as e:
                    return self._answer(400, {"error": f"the body is not JSON: {e}"})
                status, payload = router.generate(body)
                self._answer(status, payload)

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="engine-router", daemon=True)
        self._thread.start()

    def generate(self, body: dict) -> tuple[int, Any]:
        tried: set[str] = set()
        while True:
            alive = {e.name: e for e in self.driver.pool.alive() if e.name not in tried}
            name = self._picker.acquire(list(alive))
            if name is None:
                return 503, {"error": f"no rollout engine answered ({self.driver.pool.dead_report()})"}
            engine = alive[name]
            with self._lock:
                self.requests += 1
            try:
                r = engine.client.request("POST", "/generate", body, timeout=self.driver.client_kwargs["generate_timeout"])
                out = r.json()
                check_answer(engine.client.url, body, out, self.driver.vocab_size)
                return 200, out
            except EngineOutputError as e:  # a broken engine: dead, as the driver's own requests would find it
                self.driver.declare_dead_threadsafe(engine, e)
                tried.add(engine.name)
            except EngineError as e:
                if e.status is not None and e.status < 500:
                    return e.status, {"error": e.cause}
                log.warning("router: engine %s failed (%s); trying another", engine.name, e.cause)
                tried.add(engine.name)
            except ValueError as e:  # not JSON: as the driver's client treats it, this engine's fault, not fatal
                log.warning("router: engine %s answered no JSON (%s); trying another", engine.name, e)
                tried.add(engine.name)
            finally:
                self._picker.release(name)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def check_answer(url: str, body: dict, out: Any, vocab_size: int | None) -> None:
    """Check SGLang's ``/generate`` answer ``out`` to ``body`` (one prompt, or a batch: a list, with per-prompt
    ``return_logprob``/``sampling_params`` lists or one for all) as the driver checks its own; raises
    :class:`EngineOutputError`. An answer of a shape the driver's parser does not know goes through unchecked,
    as the router always passed answers through."""
    items = out if isinstance(out, list) else [out]
    batched = isinstance(out, list)
    for i, item in enumerate(items):
        def per(key: str) -> Any:
            v = body.get(key)
            return v[i] if batched and isinstance(v, list) and len(v) == len(items) else v
        try:
            parse_generation(url, item, return_logprob=bool(per("return_logprob")), vocab_size=vocab_size,
                             max_new_tokens=requested_max_new_tokens(per("sampling_params")))
        except EngineOutputError:
            raise
        except EngineError as e:
            log.warning("router: engine %s answered in a shape not checked (%s); passed through", url, e.cause)
