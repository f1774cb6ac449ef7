"""EngineClient against a real, misbehaving HTTP server (no mocks): 5xx bursts, garbage, dropped and trickled
answers, servers that never answer. What each test waits on is an event or the client's own deadline."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import pytest

from relax_hpc.engines.client import Backoff, EngineClient, EngineError
from tests.engines.stub_http import StubHandler, StubServer

FAST = Backoff(base=0.01, factor=2.0, cap=0.05, jitter=False)  # tests stay fast; the gaps stay checkable
GEN = {"text": "ab", "output_ids": [1, 2], "meta_info": {
    "id": "r1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
    "output_token_logprobs": [[-0.1, 1, None], [-0.2, 2, None]], "weight_version": "0"}}


class FaultServer:
    """Answers each request with the next action of ``script`` (the last one repeats):
    ``ok`` (a generate answer), ``500``/``400`` (an error), ``garbage`` (200, not JSON), ``drop`` (headers and
    part of the body, then the connection is closed), ``trickle`` (a body of which one byte comes every 50 ms,
    forever), ``hang`` (never answers). Records each request's arrival time and Authorization header."""

    def __init__(self, script: list[str]):
        self.script, self.arrivals, self.auth = list(script), [], []
        self.stop = threading.Event()
        self.trickled = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(StubHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                with outer.lock:
                    outer.arrivals.append(time.monotonic())
                    outer.auth.append(self.headers.get("Authorization"))
                    action = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                getattr(self, "_" + action)()

            do_GET = do_POST

            def _ok(self):
                self.send_json(200, json.dumps(GEN).encode())

            def _500(self):
                self.send_json(500, b'{"error": {"message": "scheduler hiccup"}}')

            def _400(self):
                self.send_json(400, b'{"error": {"message": "prompt too long"}}')

            def _garbage(self):
                self.send_json(200, b"<html>502 bad gateway</html>")

            def _drop(self):
                self.send_json(200, b'{"text": "a', length=500)
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

            def _trickle(self):
                self.send_json(200, b"{", length=10**6)
                try:
                    while not outer.stop.is_set():
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        outer.trickled += 1
                        outer.stop.wait(0.05)  # pace only: the test waits on the client's deadline
                except OSError:
                    pass
                self.close_connection = True

            def _hang(self):
                outer.stop.wait()
                self.close_connection = True

        self.http = StubServer(Handler)
        self.url = self.http.url

    def close(self):
        self.stop.set()
        self.http.close()


@pytest.fixture
def serve():
    servers, clients = [], []

    def make(script, **client_kwargs):
        s = FaultServer(script)
        client_kwargs.setdefault("backoff", FAST)
        c = EngineClient(s.url, **client_kwargs)
        servers.append(s)
        clients.append(c)
        return s, c

    yield make
    for c in clients:
        c.close()
    for s in servers:
        s.close()


def test_a_burst_of_500s_is_ridden_out_with_backoff(serve):
    s, c = serve(["500", "500", "500", "ok"], retries=3, api_key="k-123")
    g = asyncio.run(c.agenerate([1, 2, 3], {"max_new_tokens": 2}))
    assert g.output_ids == [1, 2] and g.output_logprobs == [-0.1, -0.2]
    assert len(s.arrivals) == 4
    gaps = [b - a for a, b in zip(s.arrivals, s.arrivals[1:])]
    assert all(gap >= want * 0.9 for gap, want in zip(gaps, [0.01, 0.02, 0.04])), gaps  # exponential
    assert s.auth == ["Bearer k-123"] * 4  # the key on every attempt


def test_500s_beyond_max_retries_fail_with_the_status(serve):
    s, c = serve(["500"], retries=2)
    with pytest.raises(EngineError) as ei:
        c.generate([1, 2, 3], {"max_new_tokens": 2})
    assert ei.value.status == 500 and "scheduler hiccup" in str(ei.value) and s.url in str(ei.value)
    assert len(s.arrivals) == 3


def test_retries_stop_at_the_total_deadline(serve):
    """Many retries allowed, but backoff never sleeps past the call's deadline."""
    s, c = serve(["500"], retries=1000, backoff=Backoff(base=0.1, factor=1.0, jitter=False))
    t0 = time.monotonic()
    with pytest.raises(EngineError) as ei:
        c.generate([1], {"max_new_tokens": 2}, timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    # the last try either got its 500 or ran into the deadline itself (a loaded machine): both end the call in time
    assert ei.value.status == 500 or "timed out after 0.5 s in total" in str(ei.value), ei.value
    assert 1 <= len(s.arrivals) <= 6  # retried while time was left, never past it


def test_garbage_json_is_a_clear_error_and_not_retried(serve):
    s, c = serve(["garbage", "ok"], retries=3)
    with pytest.raises(EngineError, match=r"/generate failed: HTTP 200 but the answer is not valid JSON.*bad gateway"):
        c.generate([1, 2, 3], {"max_new_tokens": 2})
    assert len(s.arrivals) == 1


def test_4xx_is_not_retried(serve):
    s, c = serve(["400", "ok"], retries=3)
    with pytest.raises(EngineError) as ei:
        c.generate([1], {"max_new_tokens": 2})
    assert ei.value.status == 400 and len(s.arrivals) == 1


def test_a_dropped_connection_is_retried(serve):
    s, c = serve(["drop", "ok"], retries=3)
    assert c.generate([1], {"max_new_tokens": 2}).output_ids == [1, 2]
    assert len(s.arrivals) == 2


def test_a_weight_update_is_never_resent(serve):
    """Only calls without side effects are resent: a second broadcast would not match the trainer's."""
    s, c = serve(["500", "ok"], retries=3)
    with pytest.raises(EngineError):
        c.update_weights_from_distributed(["w"], ["float32"], [[2]])
    assert len(s.arrivals) == 1


@pytest.mark.parametrize("how", ["async", "sync"])
def test_a_trickling_answer_hits_the_total_deadline(serve, how):
    """Every read gets a byte well within any per-read timeout; the whole request still ends at 1 s."""
    s, c = serve(["trickle"], retries=3, generate_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"timed out after 1 s in total .*rollout.request_timeout_s"):
        if how == "async":
            asyncio.run(c.agenerate([1], {"max_new_tokens": 2}))
        else:
            c.generate([1], {"max_new_tokens": 2})
    assert 0.9 < time.monotonic() - t0 < 2.5
    assert s.trickled >= 5 and len(s.arrivals) == 1  # bytes kept coming; a timed-out generate is not resent


def test_a_server_that_never_answers_fails_a_control_call_at_its_timeout(serve):
    s, c = serve(["hang"], timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"/server_info failed: timed out after 0.5 s in total"):
        c.server_info()
    assert time.monotonic() - t0 < 2.0
    assert not c.is_healthy(timeout=0.3)


def test_backoff_is_exponential_capped_with_full_jitter():
    b = Backoff(base=0.5, factor=2.0, cap=10.0)
    rng = random.Random(0)
    for k, top in enumerate([0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]):
        draws = [b.delay(k, rng) for _ in range(200)]
        assert all(0.0 <= d <= top for d in draws) and max(draws) > 0.8 * top
    assert Backoff(base=0.5, jitter=False).delay(3) == 4.0
    assert EngineClient("http://x", backoff=0.3).backoff == Backoff(base=0.3)
