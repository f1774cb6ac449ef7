"""One total deadline per generate request (``rollout.request_timeout_s``) across every retry and engine, for the
driver and for the EngineRouter, and the router's door: its key (401 without it, checked before the body). Real HTTP
servers that answer, fail or never answer; no mocks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.engines.client import Backoff
from relax_hpc.rollout.driver import RequestTimeout, RolloutDriver, RolloutError
from relax_hpc.engines.router import EngineRouter, post, router_api_key, router_headers
from relax_hpc.rollout.sample import Sample
from tests.rollout.conftest import import_source
from tests.engines.stub_http import StubHandler, StubServer

FAST = Backoff(base=0.01, factor=2.0, cap=0.05, jitter=False)
ANSWER = {"text": "ab", "output_ids": [5, 6], "meta_info": {
    "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
    "output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None]], "weight_version": "0"}}


class Engine:
    """``POST /generate``: ``ok`` (a valid answer), ``500``, or ``hang`` (no answer until closed);
    ``/health_generate``: ``health`` (200: looks healthy; 503: fails its probe). Counts generate requests."""

    def __init__(self, generate: str, health: int = 200):
        self.generate, self.health, self.calls = generate, health, 0
        self.released = threading.Event()
        outer = self

        class Handler(StubHandler):
            def _send(self, status: int, data: bytes) -> None:
                try:
                    self.send_json(status, data)
                except OSError:
                    self.close_connection = True  # the client gave up: its deadline

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/generate":
                    return self._send(200, b"{}")
                outer.calls += 1
                if outer.generate == "hang":
                    outer.released.wait()
                    self.close_connection = True
                    return None
                if outer.generate == "500":
                    return self._send(500, b'{"error": "scheduler hiccup"}')
                return self._send(200, json.dumps(ANSWER).encode())

            def do_GET(self):
                self._send(outer.health if self.path.startswith("/health") else 200, b"{}")

        self.http = StubServer(Handler)
        self.url = self.http.url

    def close(self):
        self.released.set()
        self.http.close()


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(generate: str, health: int = 200) -> Engine:
        made.append(Engine(generate, health))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _recipe(**rollout) -> Recipe:
    rollout = {"rm_type": "math", "max_response_len": 2, "n_samples_per_prompt": 2, **rollout}
    return Recipe(rollout=RolloutConfig(**rollout))


def _groups(prompts: int = 2, n: int = 2) -> list[list[Sample]]:
    return [[Sample(group_index=g, index=g * n + j, prompt="1+1=", tokens=[1, 2, 3], label="2") for j in range(n)]
            for g in range(prompts)]


def test_a_request_gives_up_at_its_total_deadline_across_retries_and_engines(engines):
    """Engine a answers 500 (retried by its client with backoff, then by the driver on the other engine), engine b
    never answers and looks healthy: the request fails at request_timeout_s in total. Before, each attempt had the
    whole deadline: b's first attempt alone took all of it, and (max_retries + 1) attempts followed."""
    a, b = engines("500"), engines("hang")
    deadline = 1.5
    driver = RolloutDriver(_recipe(request_timeout_s=deadline, max_retries=3), {"a": a.url, "b": b.url},
                           backoff=FAST)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout) as ei:
        asyncio.run(driver.request([1, 2, 3], driver.sampling_params(), who="sample index=0"))
    took = time.monotonic() - t0
    assert deadline <= took < deadline + 3, took  # one deadline, not one per attempt (and b.calls below)
    msg = str(ei.value)
    assert "sample index=0" in msg and f"rollout.request_timeout_s = {deadline:g} s" in msg and "engine b" in msg
    assert ei.value.restartable  # an engine that did not answer: a restart starts the engines again
    assert a.calls == 4 and b.calls == 1  # a: the client's 3 retries; b: once, never resent past the deadline
    assert driver.live_engines == ["a", "b"]  # both answered their health probes


def test_a_hung_engine_is_given_up_in_time_for_the_request_to_finish_elsewhere(engines, monkeypatch):
    """With another live engine an attempt gets half of what is left: the request that went to the hung engine (a,
    healthy to a probe, picked first) is sent to b after half the deadline and succeeds within it; a is not declared
    dead for it (a probe could fail while SGLang is paused for a weight sync)."""
    import relax_hpc.rollout.driver as D

    monkeypatch.setattr(D, "MIN_ATTEMPT_S", 0.5)  # the floor, scaled to the test's deadline
    a, b = engines("hang"), engines("ok")
    deadline = 4.0
    driver = RolloutDriver(_recipe(request_timeout_s=deadline, max_retries=0), {"a": a.url, "b": b.url},
                           backoff=FAST)
    t0 = time.monotonic()
    gen = asyncio.run(driver.request([1, 2, 3], driver.sampling_params(), who="sample index=0"))
    took = time.monotonic() - t0
    assert gen.output_ids == [5, 6] and (a.calls, b.calls) == (1, 1)
    assert took >= deadline / 2, took  # a's share, then b's answer (an answer at all: within the one deadline)
    assert driver.live_engines == ["a", "b"]


def _router(engine_urls: dict[str, str], deadline: float = 30.0) -> tuple[RolloutDriver, EngineRouter]:
    driver = RolloutDriver(_recipe(request_timeout_s=deadline), engine_urls, backoff=FAST)
    driver.router = EngineRouter(driver)
    return driver, driver.router


def test_the_router_answers_only_requests_with_its_key(engines):
    """Issue 28's probe: any process on the node got a generation from the router. Now 401 without the key or with
    a wrong one, checked before the body is read (a body claimed at 1 GB is refused at once); 200 with it."""
    _, router = _router({"good": engines("ok").url})
    url = f"http://127.0.0.1:{router.port}/generate"
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    try:
        assert router.api_key == router_api_key() and len(router.api_key) >= 32
        with httpx.Client(timeout=10) as h:
            r = h.post(url, json=body)
            assert r.status_code == 401 and "router_headers()" in r.json()["error"]
            assert h.post(url, json=body, headers={"Authorization": "Bearer " + router.api_key[:-1]}).status_code == 401
            assert h.get(f"http://127.0.0.1:{router.port}/health").status_code == 200  # open, as SGLang's
            ok = h.post(url, json=body, headers=router_headers())
            assert ok.status_code == 200 and ok.json()["output_ids"] == [5, 6]
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as s:  # claims a body, sends none
            s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {10**9}\r\n\r\n".encode())
            got = s.recv(65536)
        assert got.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 5, got
        assert router.unauthorized == 3 and router.requests == 1
        assert asyncio.run(post(url, body))["output_ids"] == [5, 6]  # the helper a function uses sends the key
    finally:
        router.close()


def test_the_router_gives_up_at_one_deadline_across_engines(engines):
    """Two engines that never answer (and look healthy): 504 after request_timeout_s in total, not once per engine."""
    _, router = _router({"a": engines("hang").url, "b": engines("hang").url}, deadline=1.0)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{router.port}/generate", json={"input_ids": [1]}, headers=router_headers(),
                       timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 504 and "rollout.request_timeout_s = 1 s" in r.json()["error"], r.text
        assert 1.0 <= took < 4.0, took  # one deadline across both engines, not one each
    finally:
        router.close()


KEYLESS = '''
    import httpx


    async def generate(args, sample, sampling_params, evaluation=False):
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        async with httpx.AsyncClient() as client:  # no key: the router refuses it
            out = (await client.post(url, json={"input_ids": list(sample.tokens)}, timeout=30)).json()
        sample.tokens = list(sample.tokens) + out["output_ids"]
        return sample
'''


def test_a_function_that_sends_no_key_is_told_how(engines, tmp_path, monkeypatch):
    import_source(tmp_path, monkeypatch, "keyless_gen", KEYLESS)
    driver = RolloutDriver(_recipe(custom_generate_function_path="keyless_gen.generate"), {"good": engines("ok").url})
    try:
        with pytest.raises(RolloutError) as ei:
            driver.generate_rollout_sync(_groups(prompts=1))
    finally:
        driver.router.close()
    msg = str(ei.value)
    assert "keyless_gen.generate failed with KeyError" in msg and "refused" in msg and "without its key" in msg
    assert "from relax_hpc.rollout.router import post" in msg
