"""The OPD teacher client against real reference engines: this module's engine process, and a second engine served in
this process (so a test can stop its listener, pause it, or spoil its answers with the engine's own test hook). The
teacher's numbers are checked against an independent float32 forward of the same HF model."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

from relax_hpc.errors import is_permanent
from relax_hpc.rollout.sample import Sample
from relax_hpc.rollout.teacher import TeacherClient, TeacherClientConfig, TeacherError, TeacherRefused

PROMPTS = [[1, 10, 11, 12], [1, 5], [3, 90, 91, 92, 93], [7, 8, 9]]
RESPONSES = [[40, 41, 42], [50, 51, 52, 53, 54], [60], [70, 71]]


def samples() -> list[Sample]:
    return [Sample(index=i, tokens=p + r, response_length=len(r)) for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def reference(model, s: Sample, k: int = 0):
    """The response tokens' log-probs (and top-k) from a forward of the sample alone."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0].float(), -1)
    start = len(s.tokens) - s.response_length
    rows = lp[start - 1:len(s.tokens) - 1]
    got = rows.gather(1, torch.tensor(s.tokens[start:])[:, None])[:, 0].tolist()
    return got, (rows.topk(k) if k else None)


@pytest.fixture(scope="module")
def spare(tiny_llama):
    """A second reference engine, served from this process: its engine object is at hand."""
    from relax_hpc.engines.cpu_engine import CPUEngine, serve

    engine = CPUEngine(str(tiny_llama), max_batch=8, batch_wait_ms=1.0, seed=0)
    server = serve(engine)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield engine
    server.shutdown()
    server.server_close()


def client(urls, **kw) -> TeacherClient:
    return TeacherClient(TeacherClientConfig(urls=list(urls), **{"timeout_s": 60.0, "batch_size": 2, **kw}))


def first_pick(c: TeacherClient, url: str) -> None:
    """Make ``url`` the teacher each batch asks first (round-robin would alternate)."""
    c._picker._turn = iter([list(c._clients).index(url)] * 100)


def test_each_sample_gets_its_response_tokens_log_probs(cpu_engine, hf_model):
    c = client([cpu_engine.url], top_k=3)
    try:
        extra = [Sample(index=8, tokens=[1, 2, 3], response_length=0),  # nothing to score
                 Sample(index=9, tokens=[4, 5], response_length=2)]  # no prompt token
        got = c.score(samples() + extra)
        for s, g in zip(samples(), got):
            want, (top_v, top_i) = reference(hf_model, s, 3)
            assert g.ok and g.teacher == cpu_engine.url and len(g.log_probs) == s.response_length
            assert g.log_probs == pytest.approx(want, abs=1e-5)
            assert g.top_ids == top_i.tolist() and torch.allclose(torch.tensor(g.top_log_probs), top_v, atol=1e-5)
        assert got[4].log_probs == [] and got[4].ok  # nothing to score: no call
        assert got[5].log_probs is None and "no prompt token" in got[5].error  # marked, not dropped
        m = c.take_metrics()
        assert m["opd/teacher_calls"] == 2.0 and m["opd/teacher_retries"] == 0.0  # 4 samples in batches of 2
        assert m["opd/teacher_bad_samples"] == 1.0 and 0 < m["opd/teacher_latency_mean"] <= m["opd/teacher_latency_max"]
        assert c.take_metrics()["opd/teacher_calls"] == 0.0  # per step: taken means reset
    finally:
        c.close()


def test_a_stopped_teacher_is_passed_over_for_the_other(cpu_engine, spare, hf_model):
    from relax_hpc.engines.cpu_engine import EngineServer, engine_handler

    server = EngineServer(("127.0.0.1", 0), engine_handler(spare))  # a listener of its own, served, then stopped
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    server_url = f"http://127.0.0.1:{server.server_address[1]}"
    c = client([server_url])
    try:
        assert c.score(samples()[:1])[0].ok  # it did answer
    finally:
        c.close()
    server.shutdown()
    server.server_close()  # connections to it are refused now
    t.join()
    c = client([server_url, cpu_engine.url], batch_size=4)
    try:
        first_pick(c, server_url)
        got = asyncio.run(c.ascore(samples()))
        assert all(g.ok and g.teacher == cpu_engine.url for g in got)
        for s, g in zip(samples(), got):
            assert g.log_probs == pytest.approx(reference(hf_model, s)[0], abs=1e-5)
        m = c.take_metrics()
        assert m["opd/teacher_retries"] == 1.0 and m["opd/teacher_calls"] == 2.0  # refused, then answered
        assert c._down.get(server_url, 0) > 0 and cpu_engine.url not in c._down
        assert set(c._picker.busy().values()) == {0}  # every call released its teacher
    finally:
        c.close()


def test_a_teacher_answering_400_fails_the_run_naming_it_and_the_fix(cpu_engine):
    c = client([cpu_engine.url])
    try:
        too_long = Sample(index=0, tokens=[1] * 590 + [2] * 20, response_length=20)  # the context is 512
        with pytest.raises(TeacherRefused) as e:
            c.score([too_long])
        assert is_permanent(e.value) and cpu_engine.url in str(e.value) and "HTTP 400" in str(e.value)
        assert not e.value.restartable  # a restart would get the same refusal
        assert "longest sample has 610 tokens" in str(e.value) and "whose context holds it" in str(e.value)
        assert c.take_metrics()["opd/teacher_calls"] == 1.0  # not retried: every teacher would refuse it
    finally:
        c.close()


def test_a_teacher_that_does_not_answer_in_time_is_a_transient_error(spare):
    """A paused engine holds the request (as SGLang queues it until /continue_generation): the deadline ends it."""
    c = client([spare.url], timeout_s=1.0)
    spare.scheduler.pause("abort")
    try:
        with pytest.raises(TeacherError, match=r"within teacher timeout_s = 1 s .*timed out") as e:
            c.score(samples()[:2])
        assert not is_permanent(e.value) and not isinstance(e.value, TeacherRefused)
        assert e.value.restartable  # the step's failure uses a restart (tests/controller/test_loop_teacher.py)
    finally:
        spare.scheduler.resume()
        c.close()
    c = client([spare.url])
    try:
        assert c.score(samples()[:1])[0].ok  # serving again after the resume
    finally:
        c.close()


def test_a_nan_from_one_teacher_sends_the_sample_to_the_next(cpu_engine, spare, hf_model):
    from relax_hpc.engines.bad_output import BadOutput

    spare.bad_output = BadOutput("nan_logprobs:1", spare.vocab_size)  # its next scoring answer: a NaN
    c = client([spare.url, cpu_engine.url], batch_size=4)
    try:
        first_pick(c, spare.url)
        got = c.score(samples())
        assert [g.teacher for g in got] == [cpu_engine.url] + [spare.url] * 3  # only sample 0 asked again
        for s, g in zip(samples(), got):
            assert g.log_probs == pytest.approx(reference(hf_model, s)[0], abs=1e-5)
        m = c.take_metrics()
        assert (m["opd/teacher_calls"], m["opd/teacher_retries"], m["opd/teacher_bad_samples"]) == (2.0, 1.0, 0.0)
    finally:
        c.close()
    spare.bad_output = BadOutput("positive_logprobs:100", spare.vocab_size)  # every answer: a positive log-prob
    c = client([spare.url], batch_size=4, retries=2)
    try:
        got = c.score(samples())
        for s, g in zip(samples(), got):  # marked with why, none dropped
            assert g.log_probs is None and f"teacher {spare.url}" in g.error and "after 2 teacher call(s)" in g.error
            assert f"the input log-prob of position {len(s.tokens) - s.response_length} " in g.error
            assert "is 0.5 > 0" in g.error
        assert c.take_metrics()["opd/teacher_bad_samples"] == 4.0
    finally:
        spare.bad_output = None
        c.close()


def test_the_config_names_a_bad_value():
    for kw, want in [({"urls": []}, "teacher urls = []"), ({"urls": "http://x:1"}, "give a list"),
                     ({"timeout_s": 0}, "teacher timeout_s = 0"), ({"batch_size": 0}, "teacher batch_size = 0"),
                     ({"top_k": -1}, "teacher top_k = -1"), ({"retries": 0}, "teacher retries = 0")]:
        with pytest.raises(ValueError, match=re.escape(want)):
            TeacherClientConfig(**{"urls": ["http://x:1"], **kw})
