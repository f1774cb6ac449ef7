"""The SGLang client against the CPU engine: generation, log-prob parity, batching, pause/abort, control calls.

The same calls run against a real SGLang server in test_engines.py (GPU only); nothing here may depend on
which engine answers beyond what SGLang's API promises.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from relax_hpc.engines.client import EngineClient, EngineError, SamplingParams

PROMPT = [1, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one unpadded forward over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def wait_running(client: EngineClient, n: int = 1, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.server_info()["internal_states"][0]["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "requests never started running"
        time.sleep(0.02)


def test_generate_shapes_and_length_finish(client):
    g = client.generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True, sampling_seed=1))
    assert len(g.output_ids) == len(g.output_logprobs) == g.completion_tokens == 12
    assert g.finish_reason.type == "length" and g.finish_reason.length == 12 and g.truncated
    assert g.prompt_tokens == len(PROMPT) and g.rid and g.weight_version == "default"
    assert all(lp <= 0 for lp in g.output_logprobs)
    assert isinstance(g.text, str)
    no_lp = client.generate(PROMPT, {"max_new_tokens": 3}, return_logprob=False)
    assert no_lp.output_logprobs is None and len(no_lp.output_ids) == 3


def test_stop_token_finish(client):
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    ref = client.generate(PROMPT, greedy).output_ids
    stop = ref[4]
    k = ref.index(stop)
    g = client.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[stop]))
    assert g.output_ids == ref[:k + 1]  # the matched stop token is part of the output, as in SGLang
    assert g.finish_reason.type == "stop" and g.finish_reason.matched == stop and not g.truncated


def test_sampling_seed_determinism(client):
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, sampling_seed=1234)
    a, b = client.generate(PROMPT, sp), client.generate(PROMPT, sp)
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    c = client.generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True, sampling_seed=99))
    assert c.output_ids != a.output_ids
    # the seed decides the sample, not the batch it happened to share
    others = [[1, 7] * (i + 1) for i in range(5)]
    batch = client.generate_batch([PROMPT] + others, sp)
    assert batch[0].output_ids == a.output_ids


def test_logprobs_match_teacher_forced_forward(client, hf_model):
    """Left-padded, KV-cached, batched engine log-probs == an unpadded full forward, within 1e-4."""
    prompts = [PROMPT, [1, 40], [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59], [1, 3, 3]]
    max_new = [20, 7, 13, 1]  # rows finish at different steps: exercises dropping rows from the KV cache

    async def run():
        return await asyncio.gather(*(client.agenerate(p, SamplingParams(
            max_new_tokens=m, temperature=0.7, top_p=0.9, top_k=50, ignore_eos=True, sampling_seed=i))
            for i, (p, m) in enumerate(zip(prompts, max_new))))

    worst = 0.0
    for p, m, g in zip(prompts, max_new, asyncio.run(run())):
        assert len(g.output_ids) == m
        ref = teacher_forced_logprobs(hf_model, p, g.output_ids, 0.7)
        worst = max(worst, (ref - torch.tensor(g.output_logprobs)).abs().max().item())
    g = client.generate(PROMPT, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    ref = teacher_forced_logprobs(hf_model, PROMPT, g.output_ids, 1.0)  # greedy reports T=1 log-probs
    worst = max(worst, (ref - torch.tensor(g.output_logprobs)).abs().max().item())
    with torch.no_grad():
        full = hf_model(torch.tensor([PROMPT + g.output_ids])).logits[0, len(PROMPT) - 1:-1]
    assert full.argmax(-1).tolist() == g.output_ids
    print(f"max |engine - teacher-forced| log-prob = {worst:.3g}")
    assert worst < 1e-4


def test_concurrent_requests_are_batched_and_all_answered(client):
    before = client.server_info()["internal_states"][0]["num_batches"]
    prompts = [[1, 20 + i, 30 + i] for i in range(16)]

    async def run():
        return await asyncio.gather(*(client.agenerate(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
                                      for p in prompts))

    gens = asyncio.run(run())
    assert [len(g.output_ids) for g in gens] == [8] * 16
    assert len({g.rid for g in gens}) == 16
    state = client.server_info()["internal_states"][0]
    assert state["num_batches"] - before < 16 and state["max_batch_size"] > 1


def test_a_burst_of_requests_leaves_few_connections_open():
    """64 requests at once (the server answers none before all 64 are in: 64 connections) leave the client keeping
    KEEPALIVE_CONNECTIONS of them: httpcore's pool scans every connection for each idle one whenever a request
    starts or ends, O(N²) with all of them kept. Counted on the server's side. Negative control: a client keeping
    all of them, as before, leaves the 64 open."""
    import threading

    import httpx

    from relax_hpc.engines import client as mod
    from tests.engines.stub_http import StubHandler, StubServer

    n, open_now, lock = 64, [0], threading.Lock()
    all_in = threading.Barrier(n)

    class Handler(StubHandler):
        def setup(self):
            super().setup()
            with lock:
                open_now[0] += 1

        def finish(self):
            super().finish()
            with lock:
                open_now[0] -= 1

        def do_GET(self):
            all_in.wait(30)
            self.send_json(200, b"{}")

    server = StubServer(Handler)

    def burst(keep_all: bool) -> int:
        c = EngineClient(server.url)
        if keep_all:
            c._limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024,
                                     keepalive_expiry=mod.KEEPALIVE_S)
        kept = n if keep_all else mod.KEEPALIVE_CONNECTIONS

        async def run() -> int:
            await asyncio.gather(*(c.arequest("GET", "/health") for _ in range(n)))
            deadline = time.monotonic() + 10
            while open_now[0] > kept and time.monotonic() < deadline:  # until the server sees the closes
                await asyncio.sleep(0.01)
            held = open_now[0]
            await c._async().aclose()
            return held

        all_in.reset()
        return asyncio.run(run())

    try:
        assert mod.KEEPALIVE_CONNECTIONS == 16
        assert burst(keep_all=False) == 16
        deadline = time.monotonic() + 10
        while open_now[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert burst(keep_all=True) == n
    finally:
        server.close()


def test_pause_abort_then_continue(client):
    pool = ThreadPoolExecutor(4)
    sp = SamplingParams(max_new_tokens=400, ignore_eos=True)
    futs = [pool.submit(client.generate, [1, 60 + i], sp) for i in range(3)]
    wait_running(client)
    client.pause_generation("abort")
    try:
        gens = [f.result(timeout=30) for f in futs]  # pause(abort) returns only after in-flight ones finished
        assert all(g.aborted and len(g.output_ids) < 400 for g in gens)
        assert all(len(g.output_logprobs) == len(g.output_ids) for g in gens)
        late = pool.submit(client.generate, PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
        time.sleep(0.4)
        assert not late.done(), "a request sent while paused must wait for continue_generation"
        assert client.is_healthy()  # paused is not unhealthy
    finally:
        client.continue_generation()
    g = late.result(timeout=30)
    assert g.finish_reason.type == "length" and len(g.output_ids) == 4
    pool.shutdown()


def test_pause_in_place_keeps_requests(client):
    pool = ThreadPoolExecutor(2)
    sp = SamplingParams(max_new_tokens=200, ignore_eos=True)
    futs = [pool.submit(client.generate, [1, 70 + i], sp) for i in range(2)]
    wait_running(client)
    client.pause_generation("in_place")
    try:
        state = client.server_info()["internal_states"][0]
        assert state["paused"] == "in_place" and state["num_running_reqs"] >= 1
        assert state["num_running_reqs"] + state["num_waiting_reqs"] == 2
        with pytest.raises(EngineError) as e:  # SGLang refuses to flush while requests hold KV
            client.flush_cache()
        assert e.value.status == 400
        time.sleep(0.3)
        assert not any(f.done() for f in futs)
    finally:
        client.continue_generation()
    gens = [f.result(timeout=60) for f in futs]
    assert all(g.finish_reason.type == "length" and len(g.output_ids) == 200 for g in gens)
    pool.shutdown()


def test_pause_retract_recomputes_and_resumes(client):
    sp = SamplingParams(max_new_tokens=150, ignore_eos=True, sampling_seed=7)
    ref = client.generate([1, 80], sp)
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(client.generate, [1, 80], sp)
    wait_running(client)
    client.pause_generation("retract")
    try:
        assert "Cache flushed" in client.flush_cache()  # retracted requests hold no KV
    finally:
        client.continue_generation()
    g = fut.result(timeout=60)
    assert g.output_ids == ref.output_ids and g.finish_reason.type == "length"
    assert max(abs(a - b) for a, b in zip(g.output_logprobs, ref.output_logprobs)) < 1e-4
    pool.shutdown()


def test_abort_request_by_rid_and_all(client):
    pool = ThreadPoolExecutor(2)
    sp = SamplingParams(max_new_tokens=400, ignore_eos=True)
    mine = pool.submit(client.generate, [1, 90], sp, rid="abort-me")
    wait_running(client)
    client.abort_request(rid="abort-me")
    g = mine.result(timeout=30)
    assert g.aborted and g.rid == "abort-me" and g.finish_reason.message
    other = pool.submit(client.generate, [1, 91], sp)
    wait_running(client)
    client.abort_request(abort_all=True)
    assert other.result(timeout=30).aborted
    pool.shutdown()


def test_health_info_flush(client, cpu_engine):
    client.health_generate()
    assert client.is_healthy()
    info = client.server_info()
    assert info["tp_size"] == 1 and "internal_states" in info and info["port"] == int(cpu_engine.url.rsplit(":", 1)[1])
    mi = client.model_info()
    assert mi["weight_version"] == client.weight_version() == "default" and mi["is_generation"]
    assert "Cache flushed" in client.flush_cache()


def test_async_control_calls(client):
    async def run():
        await client.ahealth_generate()
        await client.apause_generation("abort")
        await client.acontinue_generation()
        await client.aabort_request(abort_all=True)
        g = await client.agenerate(PROMPT, {"max_new_tokens": 2})
        await client.aclose()
        return g

    assert len(asyncio.run(run()).output_ids) == 2


def test_http_400_error_names_engine_call_and_body(client):
    with pytest.raises(EngineError) as e:
        client.generate(PROMPT, {"max_new_tokens": 4, "bogus_knob": 1})
    err = e.value
    assert err.status == 400 and err.call == "/generate" and err.engine_url == client.url
    assert client.url in str(err) and "/generate" in str(err) and "HTTP 400" in str(err) and "bogus_knob" in str(err)


def test_which_engine_errors_restart_the_run():
    """A dead or failing engine is the machinery (the steps restart from the checkpoint); a refusal is the recipe."""
    assert EngineError("http://e", "/get_weights_by_name", "connection refused").restartable
    assert EngineError("http://e", "/generate", "HTTP 503", status=503).restartable
    assert not EngineError("http://e", "/generate", "HTTP 400: prompt too long", status=400).restartable
    assert not EngineError("http://e", "/generate", "HTTP 401", status=401).restartable
