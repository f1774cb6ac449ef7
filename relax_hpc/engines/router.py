"""A local router in front of the rollout engines, for custom generate functions written against Relax.

Why: a Relax generate function (``--custom-generate-function-path``) talks HTTP to SGLang's router at
``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate``. To run such a function, the rollout role
serves that address itself: ``POST /generate`` (SGLang's body and answer, passed through untouched, so token ids
and ``output_token_logprobs`` are the engine's) goes to the least-busy live engine of the driver
(:class:`LeastBusy`), with the run's engine API key and the clients' retries, all within one total deadline
(``rollout.request_timeout_s``, across every attempt and engine: 504 when it runs out); an engine that stops
answering is skipped for the next one. Each answer is checked as the driver checks its own
(:func:`~relax_hpc.engines.client.parse_generation`: finite log-probs at most 0, token ids in the model's
vocabulary, consistent counts): an engine whose answer fails is declared dead through the driver (reported,
restarted by the controller) and the request goes to the next engine; with none left the answer is 503 naming
every dead engine and why. ``GET /health`` answers 200.

**Its key.** It listens on 127.0.0.1, where every user of the node can connect: every ``POST`` must carry
``Authorization: Bearer KEY`` with the router's key (401 otherwise, checked by the server's door before the request
gets a thread; the connections are bounded as the CPU engine's are, :mod:`relax_hpc.engines.http_server`: a flood
of keyless connections holds no thread and gives way to keyed ones). The key is a random secret of the
rollout process (:func:`router_api_key`), not the engines' key, so that code a function runs cannot reach the
engines' weight updates with it; it never leaves the process on its own, nor is it on a command line. A function
sends it without writing it: ``out = await post(url, payload)`` (this module's :func:`post`, in place of Relax's
``relax.utils.http_utils.post``), or its own HTTP client with ``headers=router_headers()``.

A thread per request on purpose (the server's workers): each request blocks its own thread while the engine client
(thread-safe, on its own event loop) does the call, so a generate function awaiting the router never waits on
the event loop it runs in.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any, Protocol

from relax_hpc.engines.client import EngineError, EngineOutputError, parse_generation, requested_max_new_tokens
from relax_hpc.engines.http_server import BoundedHandler, BoundedServer
from relax_hpc.engines.picker import LeastBusy


log = logging.getLogger(__name__)


_KEY: str | None = None
_KEY_LOCK = threading.Lock()
_DEADLINE_S = 600.0  # the request deadline of the router started last in this process (post's default bound)


def router_api_key() -> str:
    """The key every router of this process requires: 256 random bits, made on first use."""
    global _KEY
    with _KEY_LOCK:
        if _KEY is None:
            _KEY = secrets.token_urlsafe(32)
        return _KEY


def router_headers() -> dict[str, str]:
    """The header that lets a request through the router: pass it to your own HTTP client."""
    return {"Authorization": f"Bearer {router_api_key()}"}


async def post(url: str, payload: Any, *, timeout: float | None = None) -> Any:
    """``POST payload`` (JSON) to the router at ``url`` with its key; returns the JSON answer. The drop-in for
    Relax's ``relax.utils.http_utils.post``: the router already retries on other engines, so this does not.
    ``timeout``: seconds, default the router's request deadline plus a minute. Raises ``httpx.HTTPStatusError``
    on an error answer (its text: what the router said)."""
    import httpx

    bound = timeout if timeout is not None else _DEADLINE_S + 60.0
    async with httpx.AsyncClient(headers=router_headers(), timeout=bound) as client:
        r = await client.post(url, json=payload)
    if r.status_code != 200:
        raise httpx.HTTPStatusError(f"the router answered HTTP {r.status_code}: {r.text[:2000]}", request=r.request,
                                    response=r)
    return r.json()


# every sample of a step may post at once (rollout_batch_size x n_samples_per_prompt); kept below the process's
# file limit (http_server.fd_budget: half of what is free, the other half for the engine clients' own connections)
ROUTER_MAX_CONNECTIONS = 4096


class _Server(BoundedServer):
    # a step sends every sample's request at once (128 in the quickstart): the stdlib's listen backlog of 5 let
    # connections overflow the accept queue, and their clients saw resets (ReadError) instead of answers
    request_queue_size = 4096
    fd_share = 0.5


class RouterDriver(Protocol):
    """What the router needs of the rollout driver: its live engines (``.pool.alive()``, each with ``.name`` and
    ``.client``, and ``.pool.dead_report()``), a way to declare one dead, the vocabulary and the request deadline
    (``client_kwargs["generate_timeout"]``)."""

    pool: Any
    vocab_size: int | None
    client_kwargs: dict[str, Any]

    def declare_dead_threadsafe(self, engine: Any, err: EngineError) -> None: ...


class EngineRouter:
    """``POST /generate`` on 127.0.0.1:``port``, spread over ``driver``'s live engines, for requests carrying
    :attr:`api_key`. ``unauthorized`` counts the requests refused for want of it. ``max_connections``: sockets held
    at once (lowered to what the process's file limit leaves, :func:`~relax_hpc.engines.http_server.fd_budget`)."""

    def __init__(self, driver: RouterDriver, max_connections: int = ROUTER_MAX_CONNECTIONS) -> None:
        global _DEADLINE_S
        self.driver = driver
        self.api_key = router_api_key()
        self._picker = LeastBusy()
        self._lock = threading.Lock()
        self.requests = 0
        self.deadline_s = float(driver.client_kwargs["generate_timeout"])
        _DEADLINE_S = self.deadline_s
        router = self

        class Handler(BoundedHandler):
            api_key, open_paths = router.api_key, ("/health",)  # what the server's door checks
            unauthorized_payload = {
                "error": "Unauthorized: this router needs its key, Authorization: Bearer KEY. From a custom generate "
                         "function: `from relax_hpc.rollout.router import post` and `await post(url, payload)`, or "
                         "headers=router_headers() (docs/agentic.md)"}

            def _answer(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def refuse(self, status: int, payload: Any) -> None:
                if status == 401:  # the door answers these; this is its second look
                    self.server._count("unauthorized")
                return super().refuse(status, payload)

            def do_GET(self) -> None:
                if self.read_body(router.api_key, ("/health",)) is None:  # open, and so a tiny body at most
                    return
                self._answer(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

            def do_POST(self) -> None:
                raw = self.read_body(router.api_key)
                if raw is None:
                    return
                if self.path != "/generate":
                    return self._answer(404, {"error": f"this router serves POST /generate, not {self.path}"})
                try:
                    body = json.loads(raw or b"{}")
                except ValueError as e:
                    return self._answer(400, {"error": f"the body is not JSON: {e}"})
                except RecursionError:
                    return self._answer(400, {"error": "the body nests deeper than this router parses"})
                if not isinstance(body, dict):
                    return self._answer(400, {"error": f"the body must be a JSON object, not {type(body).__name__}"})
                status, payload = router.generate(body)
                try:
                    self._answer(status, payload)
                except OSError:
                    self.close_connection = True  # the function gave up on it

        # the engines' caps stay where they are: the driver's pool bounds what reaches them
        self._server = _Server(("127.0.0.1", 0), Handler, max_connections=max_connections)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="engine-router", daemon=True)
        self._thread.start()

    def generate(self, body: dict) -> tuple[int, Any]:
        """One request, on one engine after another, all within ``rollout.request_timeout_s`` in total."""
        from relax_hpc.engines.lora import generate_fields  # train.lora.mode adapter: the user's function need not

        body = {**generate_fields(getattr(self.driver, "recipe", None)), **body}  # name the adapter (SGLang)
        deadline = time.monotonic() + self.deadline_s
        tried: set[str] = set()
        last = "none tried"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return 504, {"error": f"no engine answered within rollout.request_timeout_s = {self.deadline_s:g} s "
                                      f"(every attempt and engine together; last: {last}); raise it if the engines "
                                      "are just slow"}
            alive = {e.name: e for e in self.driver.pool.alive() if e.name not in tried}
            name = self._picker.acquire(list(alive))
            if name is None:
                return 503, {"error": f"no rollout engine answered ({self.driver.pool.dead_report()})"}
            engine = alive[name]
            with self._lock:
                self.requests += 1
            try:
                r = engine.client.request("POST", "/generate", body, timeout=left)
                out = r.json()
                check_answer(engine.client.url, body, out, self.driver.vocab_size)
                return 200, out
            except EngineOutputError as e:  # a broken engine: dead, as the driver's own requests would find it
                self.driver.declare_dead_threadsafe(engine, e)
                tried.add(engine.name)
                last = f"{engine.name}: {e.cause}"
            except EngineError as e:
                if e.status is not None and e.status < 500:
                    return e.status, {"error": e.cause}
                log.warning("router: engine %s failed (%s); trying another", engine.name, e.cause)
                tried.add(engine.name)
                last = f"{engine.name}: {e.cause}"
            except ValueError as e:  # not JSON: as the driver's client treats it, this engine's fault, not fatal
                log.warning("router: engine %s answered no JSON (%s); trying another", engine.name, e)
                tried.add(engine.name)
                last = f"{engine.name}: no JSON ({e})"
            finally:
                self._picker.release(name)

    @property
    def unauthorized(self) -> int:
        """Requests refused (401) for want of the key."""
        return self._server.unauthorized

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
