"""An engine's output is checked before anyone believes it: NaN, infinite or positive log-probs, missing ones,
token ids outside the vocabulary, counts that disagree and empty outputs are refused with what was wrong; the
driver (and the EngineRouter of custom generate functions) declares such an engine dead with that reason and
the request succeeds on the other engine. Real HTTP throughout: a small canned-answer server as the bad engine,
the conftest's CPU engine as the good one, and the CPU engine's own RELAX_TEST_ENGINE_BAD_OUTPUT hook."""

from __future__ import annotations

import copy
import json
import math
import re
import threading

import pytest

from relax_hpc.recipe.schema import ModelConfig, Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.engines.client import EngineClient, EngineError, EngineOutputError
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, load_tokenizer
from relax_hpc.engines.client import vocabulary_size
from relax_hpc.rollout.driver import NoEngineError, RolloutDriver
from tests.rollout.conftest import import_source
from tests.engines.stub_http import StubHandler, StubServer

VOCAB = 128  # the tiny model's


def answer(ids=(5, 6), lps=(-0.5, -1.0), finish="length", **meta) -> dict:
    """An SGLang /generate answer; ``lps=None``: no log-prob rows."""
    m = {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 3, "completion_tokens": len(ids),
         "weight_version": "0"}
    if lps is not None:
        m["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
    m.update(meta)
    return {"text": "ab", "output_ids": list(ids), "meta_info": m}


class CannedEngine:
    """``POST /generate`` answers ``body`` (raw JSON text, so NaN and Infinity go out as an engine would send
    them); ``/health_generate`` answers 200: the engine looks healthy, only its output is wrong."""

    def __init__(self, body: dict | str):
        text = body if isinstance(body, str) else json.dumps(body)
        self.calls = 0
        outer = self

        class Handler(StubHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.calls += 1
                try:
                    self.send_json(200, text.encode() if self.path == "/generate" else b"{}")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a failed batch cancels the requests it still had in flight

            do_GET = do_POST

        self.http = StubServer(Handler)
        self.url = self.http.url

    def close(self):
        self.http.close()


@pytest.fixture
def canned():
    made = []

    def make(body):
        made.append(CannedEngine(body))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _generate(url: str, *, max_new_tokens: int = 4, return_logprob: bool = True):
    with EngineClient(url, retries=0) as c:  # ignore_eos: the CPU engine's answers have max_new_tokens tokens
        return c.generate([1, 2, 3], {"max_new_tokens": max_new_tokens, "ignore_eos": True},
                          return_logprob=return_logprob, vocab_size=VOCAB)


BAD = [
    ("nan", json.dumps(answer()).replace("-0.5", "NaN"), "log-prob of output token 0 (id 5) is nan"),
    ("null", answer(lps=(None, -1.0)), "log-prob of output token 0 (id 5) is None"),
    ("inf", json.dumps(answer()).replace("-1.0", "-Infinity"), "log-prob of output token 1 (id 6) is -inf"),
    ("past float32", answer(lps=(-0.5, -1e39)), "is -1e+39: log-probs must be finite (float32"),
    ("positive", answer(lps=(0.3, -1.0)), "is 0.3 > 0: a log-probability is never positive"),
    ("missing", answer(lps=None), "no output_token_logprobs for 2 output tokens, though return_logprob was asked"),
    ("rows for other tokens", answer() | {"output_ids": [5, 7]},
     "token ids of output_token_logprobs (2 rows) are not output_ids (2 tokens)"),
    ("past the vocabulary", answer(ids=(5, VOCAB)), f"output token 1 has id {VOCAB}, outside [0, {VOCAB})"),
    ("negative id", answer(ids=(-1, 6)), f"output token 0 has id -1, outside [0, {VOCAB})"),
    ("count", answer(completion_tokens=3), "completion_tokens = 3 for 2 output ids"),
    ("empty stop", answer(ids=(), lps=(), finish="stop"), "an empty output with finish reason 'stop'"),
    ("empty length", answer(ids=(), lps=(), finish="length"), "an empty output with finish reason 'length'"),
]


@pytest.mark.parametrize("body, want", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_output_is_refused_naming_the_engine_and_what(canned, body, want):
    e = canned(body)
    with pytest.raises(EngineOutputError) as ei:
        _generate(e.url)
    msg = str(ei.value)
    assert msg.startswith(f"engine {e.url}: /generate failed: bad output: ") and want in msg, msg
    assert ei.value.status is None and e.calls == 1  # not resent: the engine is bad, not the transport


GOOD = [
    ("rounding above 0", answer(lps=(5e-5, -1.0)), {}),
    ("no log-probs asked", answer(lps=None), {"return_logprob": False}),
    ("aborted before a token", answer(ids=(), lps=(), finish="abort"), {}),
    ("SGLang's abort before prefill", {"meta_info": {"id": "r", "finish_reason": {"type": "abort"}}}, {}),
    ("0 tokens asked", answer(ids=(), lps=(), finish="length"), {"max_new_tokens": 0}),
    ("the float32 edge", answer(lps=(-3.0e38, -1.0)), {}),
]


@pytest.mark.parametrize("body, kw", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_odd_but_right_output_is_accepted(canned, body, kw):
    g = _generate(canned(body).url, **kw)
    assert len(g.output_ids) == len((body.get("output_ids") or []))


def test_a_malformed_answer_is_not_blamed_on_the_engine(canned):
    """Garbage in the answer's shape (something in between, or a client bug) stays a plain EngineError."""
    with pytest.raises(EngineError) as ei:
        _generate(canned({"meta_info": {"finish_reason": {"type": "stop"}}}).url)
    assert not isinstance(ei.value, EngineOutputError) and "malformed response" in str(ei.value)


# --- the driver --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def _groups(tmp_path, tokenizer, prompts=3, n=2):
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n")
    ds = PromptDataset(tmp_path / "p.jsonl", keys=DataKeys("q", "a"), tokenizer=tokenizer, apply_chat_template=False)
    return RolloutDataSource(ds, rollout_batch_size=prompts, n_samples_per_prompt=n).get_samples()


def _recipe(tiny_llama, **rollout) -> Recipe:
    # the canned stand-ins answer one prompt per request: a group goes sample by sample (group requests: below)
    rollout = {"rm_type": "math", "max_response_len": 4, "n_samples_per_prompt": 2, "batch_group_requests": False,
               **rollout}
    return Recipe(model=ModelConfig(path=str(tiny_llama)), rollout=RolloutConfig(**rollout))


def test_the_vocabulary_is_the_models(tiny_llama, tokenizer, tmp_path):
    """The model's vocab_size (config.json; a multimodal model's text_config), padded past the tokenizer's length."""
    assert vocabulary_size(str(tiny_llama), tokenizer) == VOCAB == len(tokenizer)
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))
    assert vocabulary_size(str(tmp_path / "vlm"), tokenizer) == 151936
    assert vocabulary_size(None, tokenizer) == VOCAB  # the tokenizer's directory has the model's config
    assert vocabulary_size(None, None) is None


def test_a_bad_engine_is_declared_dead_and_its_request_served_elsewhere(canned, cpu_engine, tiny_llama, tokenizer,
                                                                         tmp_path, caplog):
    bad = canned(json.dumps(answer()).replace("-0.5", "NaN"))
    dead = []
    driver = RolloutDriver(_recipe(tiny_llama), {"bad": bad.url, "good": cpu_engine}, tokenizer=tokenizer,
                           on_engine_dead=lambda name, why: dead.append((name, why)))
    assert driver.vocab_size == VOCAB
    res = driver.generate_rollout_sync(_groups(tmp_path, tokenizer))
    assert bad.calls >= 1 and len(res.samples) == 6
    for s in res.samples:  # every sample from the good engine: its log-probs are real
        assert s.response_length >= 1 and len(s.rollout_log_probs) == s.response_length
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_log_probs)
    (why,) = driver.dead_engines.values()
    assert list(driver.dead_engines) == ["bad"] and "bad output: the log-prob of output token 0 (id 5) is nan" in why
    assert dead == [("bad", why)] and [f.name for f in res.engine_failures] == ["bad"]
    assert bad.url in res.engine_failures[0].error and res.metrics["rollout/engines_dead"] == 1.0
    assert "rollout engine bad is dead (bad output: the log-prob" in caplog.text


def test_with_every_engine_bad_the_batch_fails_naming_each_and_why(canned, tiny_llama, tokenizer, tmp_path):
    a = canned(answer(ids=(5, VOCAB + 7)))
    b = canned(answer(completion_tokens=9))
    driver = RolloutDriver(_recipe(tiny_llama), {"gpu-a": a.url, "gpu-b": b.url}, tokenizer=tokenizer)
    with pytest.raises(NoEngineError) as ei:
        driver.generate_rollout_sync(_groups(tmp_path, tokenizer, prompts=1))
    msg = str(ei.value)
    assert "no rollout engine left" in msg
    assert f"gpu-a: bad output: output token 1 has id {VOCAB + 7}, outside [0, {VOCAB})" in msg, msg
    assert "gpu-b: bad output: meta_info.completion_tokens = 9 for 2 output ids" in msg, msg


def test_a_group_request_answered_badly_declares_the_engine_dead(canned, cpu_engine, tiny_llama, tokenizer, tmp_path):
    """rollout.batch_group_requests: a group's answer is checked answer by answer (a NaN log-prob in any of them), and
    as a whole (one answer per prompt); either declares the engine dead, and the group is served elsewhere."""
    nan = json.loads(json.dumps(answer()).replace("-0.5", "NaN"))
    for body, why in ((json.dumps([answer(), nan]), "the log-prob of output token 0 (id 5) is nan"),
                      (json.dumps(answer()), "a batch of 2 prompts answered with dict")):
        bad = canned(body)
        driver = RolloutDriver(_recipe(tiny_llama, batch_group_requests=True), {"bad": bad.url, "good": cpu_engine},
                               tokenizer=tokenizer)
        res = driver.generate_rollout_sync(_groups(tmp_path, tokenizer))
        assert bad.calls >= 1 and len(res.samples) == 6
        assert all(s.response_length >= 1 and all(math.isfinite(lp) for lp in s.rollout_log_probs)
                   for s in res.samples)
        assert list(driver.dead_engines) == ["bad"] and why in driver.dead_engines["bad"], driver.dead_engines


RELAX_GENERATE = '''
    from relax_hpc.engines.router import post


    async def generate(args, sample, sampling_params, evaluation=False):
        """Relax's form: SGLang's /generate behind args.sglang_router_ip:port."""
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        ids = list(sample.tokens)
        out = await post(url, {"input_ids": ids, "sampling_params": sampling_params, "return_logprob": True})
        pairs = out["meta_info"]["output_token_logprobs"]
        sample.tokens = ids + [int(p[1]) for p in pairs]
        sample.response, sample.response_length = out["text"], len(pairs)
        sample.rollout_log_probs, sample.loss_mask = [float(p[0]) for p in pairs], [1] * len(pairs)
        sample.status = sample.Status.COMPLETED
        return sample
'''


def test_the_router_declares_a_bad_engine_dead_too(canned, cpu_engine, tiny_llama, tokenizer, tmp_path,
                                                   monkeypatch):
    import_source(tmp_path, monkeypatch, "bad_out_gen", RELAX_GENERATE)
    bad = canned(answer(lps=(0.7, -1.0)))
    driver = RolloutDriver(_recipe(tiny_llama, custom_generate_function_path="bad_out_gen.generate"),
                           {"bad": bad.url, "good": cpu_engine}, tokenizer=tokenizer)
    try:
        res = driver.generate_rollout_sync(_groups(tmp_path, tokenizer))
    finally:
        driver.router.close()
    # the bad answers (those sent to it before the first came back), then each of the 6 samples on the good one
    assert bad.calls >= 1 and driver.router.requests == 6 + bad.calls
    assert all(lp <= 0 for s in res.samples for lp in s.rollout_log_probs)
    assert list(driver.dead_engines) == ["bad"] and "is 0.7 > 0" in driver.dead_engines["bad"]
    assert [f.name for f in res.engine_failures] == ["bad"]  # reported with the batch it happened in


# --- the CPU engine's hook ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hooked(tiny_llama):
    """An in-process CPU engine started with RELAX_TEST_ENGINE_BAD_OUTPUT=nan_logprobs:1 (served on a thread)."""
    from relax_hpc.engines.bad_output import BAD_OUTPUT_ENV
    from relax_hpc.engines.cpu_engine import CPUEngine, serve

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BAD_OUTPUT_ENV, "nan_logprobs:1")
        engine = CPUEngine(str(tiny_llama), max_batch=4, batch_wait_ms=1.0, seed=0)
    assert engine.bad_output is not None and engine.bad_output.left == 1  # the environment armed it
    server = serve(engine)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield engine
    server.shutdown()
    server.server_close()


HOOKED = [("nan_logprobs", "is nan"), ("positive_logprobs", "is 0.5 > 0"), ("no_logprobs", "no output_token_logprobs"),
          ("token_past_vocab", f"has id {VOCAB}, outside [0, {VOCAB})"), ("empty_output", "an empty output"),
          ("wrong_count", "completion_tokens = 5 for 4 output ids")]


@pytest.mark.parametrize("kind, want", HOOKED, ids=[h[0] for h in HOOKED])
def test_the_cpu_engine_hook_spoils_its_first_answers(hooked, kind, want):
    from relax_hpc.engines.bad_output import BadOutput

    hooked.bad_output = BadOutput(f"{kind}:1", hooked.vocab_size)  # each case its own, in any order
    with pytest.raises(EngineOutputError, match=re.escape(want)):
        _generate(hooked.url)
    g = _generate(hooked.url)  # only the first answer
    assert len(g.output_ids) == 4 and all(lp <= 0 for lp in g.output_logprobs)


def test_the_hook_with_a_claim_spoils_one_engine_only(tmp_path):
    from relax_hpc.engines.bad_output import BadOutput

    first, second = (BadOutput(f"nan_logprobs:3:{tmp_path / 'claim'}", VOCAB) for _ in range(2))
    assert (first.left, second.left) == (3, 0)
    with pytest.raises(ValueError, match="RELAX_TEST_ENGINE_BAD_OUTPUT='nan:1': expected KIND:N"):
        BadOutput("nan:1", VOCAB)


def test_an_answer_is_spoiled_only_where_it_can_be(tmp_path):
    """An aborted answer or one without log-prob rows is passed on untouched: the count waits for a real one."""
    from relax_hpc.engines.bad_output import BadOutput

    hook = BadOutput("nan_logprobs:1", VOCAB)
    for body in (answer(finish="abort"), answer(lps=None), answer(ids=(), lps=())):
        before = copy.deepcopy(body)
        hook.spoil(body)
        assert body == before
    body = answer()
    hook.spoil(body)
    assert math.isnan(body["meta_info"]["output_token_logprobs"][0][0]) and hook.left == 0


def test_the_router_checks_each_answer_of_a_batch():
    """SGLang's batch form: one answer per prompt, checked with that prompt's return_logprob and max_new_tokens."""
    from relax_hpc.engines.router import check_answer

    body = {"input_ids": [[1, 2], [3, 4]], "return_logprob": [True, False],
            "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 0}]}
    check_answer("http://e", body, [answer(), answer(ids=(), lps=None)], VOCAB)  # no rows asked; 0 tokens asked
    with pytest.raises(EngineOutputError, match=r"output token 0 has id 200, outside \[0, 128\)"):
        check_answer("http://e", body, [answer(), answer(ids=(200,), lps=None)], VOCAB)
    with pytest.raises(EngineOutputError, match="no output_token_logprobs"):
        check_answer("http://e", {**body, "return_logprob": True}, [answer(), answer(lps=None)], VOCAB)
    check_answer("http://e", body, {"text": "not SGLang's shape"}, VOCAB)  # passed through unchecked, as before
