"""The EngineRouter (relax_hpc.engines.router) in front of stub engines, over real sockets: its key is checked before
a byte reaches an engine, a request goes to the least busy engine and through it untouched, an engine that fails
passes its requests on (one whose output is wrong is declared dead, never tried again), and a body over the cap is
refused unread; a flood of connections without the key holds no thread and every keyed request is served (issue
47). The deadline across engines and the answer checks are tests/rollout/test_request_deadline.py's and
test_engine_output.py's."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from relax_hpc.engines.client import Backoff
from relax_hpc.engines.http_server import MAX_BODY, OPEN_BODY
from relax_hpc.engines.router import EngineRouter, router_headers
from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.driver import RolloutDriver
from tests.engines.flood import Flood, fds_for, wait_for
from tests.engines.stub_http import StubHandler, StubServer

FAST = Backoff(base=0.01, factor=2.0, cap=0.05, jitter=False)
ENGINE_KEY = "the-engines-key"
BODY = {"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}, "rid": "x"}


def answer(ids: list[int], lps: tuple[float, float] = (-0.5, -1.0)) -> dict:
    return {"text": "ab", "output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)], "weight_version": "0",
        "engine_extra": {"kept": True}}}  # a field the router knows nothing of: passed through


class Gate:
    """Holds the first generate request that reaches any engine until :meth:`open`; says which engine holds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: str | None = None
        self.arrived = threading.Event()
        self.released = threading.Event()

    def hold(self, name: str) -> bool:
        with self.lock:
            if self.holder is not None:
                return False
            self.holder = name
        self.arrived.set()
        self.released.wait()
        return True


class Engine:
    """``POST /generate`` answers per ``mode``: ``ok`` (:func:`answer` with ids of its own), ``500``, or ``bad``
    (a positive log-prob: output a driver refuses). Records each generate's body and Authorization header."""

    def __init__(self, name: str, ids: list[int], mode: str = "ok", gate: Gate | None = None):
        self.name, self.ids, self.mode, self.gate = name, ids, mode, gate
        self.bodies: list[dict] = []
        self.keys: list[str | None] = []
        outer = self

        class Handler(StubHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/generate":
                    return self.send_json(200, b"{}")
                outer.bodies.append(json.loads(raw))
                outer.keys.append(self.headers.get("Authorization"))
                if outer.gate is not None:
                    outer.gate.hold(outer.name)
                if outer.mode == "500":
                    return self.send_json(500, b'{"error": "scheduler hiccup"}')
                lps = (0.5, -1.0) if outer.mode == "bad" else (-0.5, -1.0)
                return self.send_json(200, json.dumps(answer(outer.ids, lps)).encode())

            def do_GET(self):
                self.send_json(200, b"{}")

        self.http = StubServer(Handler)
        self.url = self.http.url

    @property
    def calls(self) -> int:
        return len(self.bodies)


@pytest.fixture
def make():
    made: list[tuple[EngineRouter, list[Engine]]] = []

    def router(*engines: Engine, **kw) -> EngineRouter:
        driver = RolloutDriver(Recipe(rollout=RolloutConfig(rm_type="math", max_response_len=2, max_retries=1,
                                                            request_timeout_s=30)),
                               {e.name: e.url for e in engines}, backoff=FAST, api_key=ENGINE_KEY)
        driver.router = EngineRouter(driver, **kw)
        made.append((driver.router, list(engines)))
        return driver.router

    yield router
    for r, engines in made:
        for e in engines:
            if e.gate is not None:
                e.gate.released.set()
        r.close()
        for e in engines:
            e.http.close()


def generate(router: EngineRouter, body: dict = BODY, **kw) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{router.port}/generate", json=body, timeout=30,
                      **({"headers": router_headers()} | kw))


def raw(port: int, head: str) -> tuple[int, dict]:
    """Send only ``head`` (request line and headers, no body whatever it claims); the status and JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    top, _, body = got.partition(b"\r\n\r\n")
    return int(top.split()[1]), json.loads(body)


def test_the_key_is_checked_before_a_request_reaches_an_engine(make):
    e = Engine("a", [5, 6])
    router = make(e)
    assert router._server.server_address[0] == "127.0.0.1"
    assert generate(router, headers={}).status_code == 401
    r = generate(router, headers={"Authorization": f"Bearer {ENGINE_KEY}"})  # the engines' key is not this one
    assert r.status_code == 401 and "router_headers()" in r.json()["error"]
    assert httpx.get(f"http://127.0.0.1:{router.port}/health").status_code == 200  # open, as SGLang's
    other = httpx.post(f"http://127.0.0.1:{router.port}/flush_cache", json={}, headers=router_headers())
    assert other.status_code == 404 and "POST /generate" in other.json()["error"]
    bad = httpx.post(f"http://127.0.0.1:{router.port}/generate", content=b"{not json", headers=router_headers())
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]
    assert (e.calls, router.unauthorized, router.requests) == (0, 2, 0)

    ok = generate(router)
    assert ok.status_code == 200 and ok.json() == answer([5, 6])  # the engine's answer, untouched
    assert e.bodies == [BODY] and e.keys == [f"Bearer {ENGINE_KEY}"]  # the body as sent, with the engines' key
    assert router.requests == 1


def test_a_request_goes_to_the_least_busy_engine(make):
    """The engine holding a request is passed over for as long as it holds it, even where the picker's round-robin
    turn would name it; once free it is used again."""
    gate = Gate()
    engines = {"a": Engine("a", [5, 6], gate=gate), "b": Engine("b", [7, 8], gate=gate)}
    router = make(*engines.values())
    held: list[httpx.Response] = []
    first = threading.Thread(target=lambda: held.append(generate(router)))
    first.start()
    try:
        assert gate.arrived.wait(30)
        busy, free = engines[gate.holder], engines[{"a": "b", "b": "a"}[gate.holder]]
        for _ in range(3):  # round-robin alone would send the second or third of these to the busy engine
            r = generate(router)
            assert r.status_code == 200 and r.json()["output_ids"] == free.ids
        assert (busy.calls, free.calls) == (1, 3)
    finally:
        gate.released.set()
        first.join(30)
    assert held[0].status_code == 200 and held[0].json()["output_ids"] == busy.ids
    spread = {tuple(generate(router).json()["output_ids"]) for _ in range(2)}  # both idle: both used
    assert spread == {(5, 6), (7, 8)}
    assert router._picker.busy() == {"a": 0, "b": 0}


def test_a_failing_engine_s_requests_go_to_another_and_it_stays_live(make):
    """An engine answering 500 (after its client's retry) is skipped for the request, not declared dead: a hiccup
    is not broken output."""
    a, b = Engine("a", [5, 6], mode="500"), Engine("b", [7, 8])
    router = make(a, b)
    for _ in range(2):
        r = generate(router)
        assert r.status_code == 200 and r.json()["output_ids"] == [7, 8]
    assert a.calls >= 2  # each request went to a first (its turn, both idle), then to b
    assert router.driver.live_engines == ["a", "b"] and router.driver.dead_engines == {}


def test_an_engine_with_broken_output_is_declared_dead_and_never_asked_again(make):
    a, b = Engine("a", [5, 6], mode="bad"), Engine("b", [7, 8])
    router = make(a, b)
    for _ in range(3):
        r = generate(router)
        assert r.status_code == 200 and r.json()["output_ids"] == [7, 8]
    assert a.calls == 1 and b.calls == 3
    assert router.driver.live_engines == ["b"] and "log-prob" in router.driver.dead_engines["a"]
    assert [f.name for f in router.driver.engine_failures] == ["a"]
    b.mode = "500"  # the last engine failing too: a dead one is not tried again even then
    r = generate(router)
    assert r.status_code == 503 and a.calls == 1
    assert r.json()["error"].startswith("no rollout engine answered (a: ")  # the dead engine, and why


def test_a_body_over_the_cap_is_refused_unread(make):
    e = Engine("a", [5, 6])
    router = make(e)
    key = router_headers()["Authorization"]
    status, out = raw(router.port, f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: {key}\r\n"
                                   f"Content-Length: {MAX_BODY + 1}\r\n")
    assert status == 413 and f"over this server's limit of {MAX_BODY}" in out["error"]
    status, out = raw(router.port, f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n")
    assert status == 401  # the key first: without it, not even the size is looked at
    status, out = raw(router.port, f"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: {OPEN_BODY + 1}\r\n")
    assert status == 413 and f"limit of {OPEN_BODY}" in out["error"]  # an open path takes next to nothing
    status, out = raw(router.port, f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: {key}\r\n"
                                   "Transfer-Encoding: chunked\r\n")
    assert status == 411
    status, out = raw(router.port, f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: {key}\r\n"
                                   "Content-Length: -1\r\n")
    assert status == 400
    assert e.calls == 0 and router.requests == 0
    assert generate(router).status_code == 200  # the router still serves


def test_a_flood_without_the_key_holds_no_thread_and_every_keyed_request_is_served(make):
    """Issue 47's probe against the router: 2,000 connections without its key (1,000 idle ones held open, then a
    burst of 1,000 of every kind that keeps going while the keyed requests are sent) to a router holding at most 512.
    Each of 60 keyed generates (half on fresh connections, half on a kept-alive one) gets its engine's answer, no
    keyless byte reaches the engine, and the router had at most the keyed requests' workers (before: a thread per
    idle connection, 2,000 connections gave it 2,000 threads)."""
    cap, flood_n = 512, fds_for(2000 + 512) - 512  # the router's sockets and the flood's, in this one process
    e = Engine("a", [5, 6])
    router = make(e, max_connections=cap)
    server = router._server
    gen = f"http://127.0.0.1:{router.port}/generate"
    with httpx.Client(headers=router_headers(), timeout=60) as warm:
        assert warm.post(gen, json=BODY).status_code == 200  # a kept-alive connection, made before
        base = threading.active_count()
        flood = Flood(router.port, keep=flood_n // 2)
        try:
            flood.hold(flood_n // 2)
            wait_for(lambda: server.stats()["accepted"] >= flood_n // 2 + 1, "the idle connections to be accepted")
            assert server.stats()["pushed_out"] > 0  # full: it had to make room
            flood.start()
            answers = []
            for i in range(60):
                flood.wait_made((i + 1) * (flood_n // 2) // 60)  # the keyed requests spread over the burst
                r = warm.post(gen, json=BODY) if i % 2 else generate(router)  # even: a fresh connection
                answers.append((r.status_code, r.json()))
            flood.wait_made(flood_n // 2)
        finally:
            flood.stop()
    assert answers == [(200, answer([5, 6]))] * 60
    assert e.calls == 61 and set(e.keys) == {f"Bearer {ENGINE_KEY}"}  # the keyed ones, and nothing of the flood's
    assert flood.errors == 0
    st = server.stats()
    assert router.unauthorized == st["unauthorized"] > 0 and router.requests == 61, st
    assert st["peak_workers"] <= 2, st  # threads only for keyed requests: never one for the flood
    # the burst's thread, two workers, and the stand-in engine's thread per connection of the router's (one, two
    # where the router's client opened a second): before, one per flood connection
    assert flood.max_threads <= base + 5, (base, flood.max_threads)
    assert generate(router).status_code == 200


def test_a_body_nested_200000_deep_is_a_400(make):
    e = Engine("a", [5, 6])
    router = make(e)
    deep = b"[" * 200_000 + b"]" * 200_000
    for body in (deep, b'{"input_ids": ' + deep + b"}"):
        r = httpx.post(f"http://127.0.0.1:{router.port}/generate", content=body, timeout=30, headers=router_headers())
        assert r.status_code == 400 and "nests deeper" in r.json()["error"], r.text[:300]
    r = httpx.post(f"http://127.0.0.1:{router.port}/generate", json=[BODY], timeout=30, headers=router_headers())
    assert r.status_code == 400 and "JSON object" in r.json()["error"]
    assert e.calls == 0 and generate(router).status_code == 200
