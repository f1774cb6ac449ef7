"""The GenRM judge: Relax's dapo-genrm rule (pinned case by case), and the client against a real CPU engine.

The client tests use this module's CPU engine (a tiny random model) as the judge: they check the plumbing (chat
template, seeding, retries on the next judge, 4xx, metrics), not the judge's wisdom. A dead judge is a real one:
a port nobody listens on.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import GenRMConfig, GenRMSampling
from relax_hpc.rollout import genrm
from relax_hpc.rollout.rewards.builtin import (GENRM_JUDGE_PROMPT, dapo_genrm_reward, genrm_extract_answer,
                                               genrm_verdict)
from relax_hpc.rollout.genrm import GenRMClient, GenRMError


# --------------------------------------------------------------------------------------------------
# the rule (Relax's relax/engine/rewards/dapo_genrm.py, the version with the format check)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, want", [
    ("so \\boxed{42}", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),           # the last one, nested braces kept
    ("Answer: 7\nand \\boxed{  9 }", "9"),                               # boxed wins over an Answer line
    ("Answer: 3\nmore text\nanswer :  5 apples\nbye", "5 apples"),       # the last Answer line, case-insensitive
    ("\\boxed{12 unbalanced\nAnswer: 12", "12"),                         # unbalanced boxed: the Answer line
    ("\\boxed{}\nAnswer: 4", "4"),                                       # empty boxed: the Answer line
    ("the answer is 42", None),
    ("Answer:   \n", None),
    ("", None),
    (None, None),
])
def test_answer_extraction(response, want):
    assert genrm_extract_answer(response) == want


@pytest.mark.parametrize("text, score, pred", [
    ("1", 1.0, "1"),
    ("0", 0.0, "0"),
    ("  Judgement: 1 ", 1.0, "1"),
    ("Judgement: 0\nJudgement: 1", 1.0, "1"),        # after the last "Judgement:"
    ("0 or 1", 1.0, "0 or 1"),                      # a "1" anywhere in the head wins over a "0"
    ("10", 1.0, "10"),
    ("The verdict is 0.", 0.0, "The verdict is 0."),
    ("x" * 16 + "1", None, "x" * 16 + "1"),          # only the first 16 characters are read
    ("x" * 15 + "0", 0.0, "x" * 15 + "0"),
    ("yes", None, "yes"),
    ("", None, ""),
])
def test_verdict_parse(text, score, pred):
    assert genrm_verdict(text) == (score, pred)


class Judge:
    """A judge that answers ``reply`` (or raises it) and records the messages it got."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    async def __call__(self, messages):
        self.calls.append(messages)
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply


def score(response, judge, prompt="What is 2+5?", label="7", metadata=None):
    return asyncio.run(dapo_genrm_reward(prompt, response, label, metadata, judge))


def test_a_missing_answer_scores_0_without_a_judge_call():
    j = Judge("1")
    assert score("I think it is seven", j) == {"score": 0.0, "acc": 0.0, "pred": "", "judge_response": "",
                                               "format_error": "answer_missing"}
    assert j.calls == []


def test_an_answer_over_500_characters_scores_0_without_a_call_and_500_is_judged():
    j = Judge("1")
    assert score("Answer: " + "7" * 501, j)["format_error"] == "answer_too_long"
    assert j.calls == []
    assert score("Answer: " + "7" * 500, j)["score"] == 1.0
    assert len(j.calls) == 1


def test_the_judge_sees_question_standard_answer_and_extracted_answer():
    j = Judge("Judgement: 1")
    out = score("work...\n\\boxed{7}", j)
    assert out == {"score": 1.0, "acc": 1.0, "pred": "1", "judge_response": "Judgement: 1", "format_error": ""}
    [[msg]] = j.calls
    assert msg["role"] == "user"
    assert msg["content"] == GENRM_JUDGE_PROMPT.format(question="What is 2+5?", ground_truth="7", answer="7")
    assert msg["content"].endswith("[Question]: What is 2+5?\n[Standard Answer]: 7\n[Model_answer] : 7\nJudgement:")


def test_metadata_question_and_label_win_over_prompt_and_label():
    j = Judge("0")
    out = score("Answer: 8", j, prompt=[{"role": "system", "content": "s"}, {"role": "user", "content": "chat q"}],
                label="ignored", metadata={"question": "meta q", "label": "9"})
    assert out["score"] == 0.0 and out["format_error"] == ""
    assert "[Question]: meta q\n[Standard Answer]: 9\n[Model_answer] : 8" in j.calls[0][0]["content"]
    j2 = Judge("0")
    score("Answer: 8", j2, prompt=[{"role": "system", "content": "s"}, {"role": "user", "content": "chat q"}])
    assert "[Question]: chat q\n" in j2.calls[0][0]["content"]  # chat prompt: its last user turn


def test_a_transient_judge_error_scores_0_as_judge_transient_error():
    out = score("Answer: 7", Judge(GenRMError("all judges down", transient=True)))
    assert out == {"score": 0.0, "acc": 0.0, "pred": "", "judge_response": "", "format_error": "judge_transient_error"}


def test_a_judge_that_refuses_the_request_fails_the_reward():
    with pytest.raises(GenRMError, match="HTTP 400"):  # it would refuse every sample: not a silent 0
        score("Answer: 7", Judge(GenRMError("HTTP 400: too long", transient=False)))


def test_a_bug_is_not_taken_for_a_judge_error():
    with pytest.raises(ZeroDivisionError):  # only GenRMError degrades to 0; the reward failure policy sees the rest
        score("Answer: 7", Judge(ZeroDivisionError("bug")))


def test_an_unrecognized_verdict_scores_0_with_no_format_error():
    out = score("Answer: 7", Judge("maybe?"))
    assert out == {"score": 0.0, "acc": 0.0, "pred": "maybe?", "judge_response": "maybe?", "format_error": ""}


# --------------------------------------------------------------------------------------------------
# the client, on a real engine
# --------------------------------------------------------------------------------------------------

def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connect is refused
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from relax_hpc.rollout.data import load_tokenizer

    return load_tokenizer(tiny_llama)


def cfg(**kw) -> GenRMConfig:
    return GenRMConfig(model_path="unused", sampling=GenRMSampling(temperature=0.7, max_response_len=6),
                       **{"request_timeout_s": 60.0, "retries": 3, **kw})


MSG = [{"role": "user", "content": "Is 3+4=7 right? Answer 1 or 0."}]


def test_the_judge_answers_with_its_chat_template_and_a_seed_from_the_text(cpu_engine, tokenizer):
    c = GenRMClient({"judge0": cpu_engine.url}, cfg(), tokenizer)
    try:
        ids = c.render(MSG)
        assert ids == tokenizer.apply_chat_template(MSG, tokenize=True, add_generation_prompt=True)
        sp = c.sampling(ids, {"max_response_len": 3, "top_k": 5})
        assert sp["max_new_tokens"] == 3 and sp["top_k"] == 5 and sp["temperature"] == 0.7
        assert sp["sampling_seed"] == c.sampling(list(ids), None)["sampling_seed"]
        assert sp["sampling_seed"] != c.sampling(ids + [5], None)["sampling_seed"]
        a = asyncio.run(c.generate(MSG))
        b = asyncio.run(c.generate(MSG))
        assert isinstance(a, str) and a == a.strip()
        assert a == b  # same text, same seed: the same verdict whenever it is asked
        direct = cpu_engine.client().generate(ids, {**c.sampling(ids, None)}, return_logprob=False)
        assert a == direct.text.strip()
        m = c.take_metrics()
        assert m["genrm/requests"] == 2.0 and m["genrm/errors"] == 0.0 and m["genrm/latency_p50"] > 0
        assert c.take_metrics() == {"genrm/requests": 0.0, "genrm/errors": 0.0}  # per step: taken means reset
    finally:
        c.close()


def test_a_dead_judge_is_passed_over_and_the_call_goes_to_a_live_one(cpu_engine, tokenizer):
    c = GenRMClient({"judge0": _dead_url(), "judge1": cpu_engine.url}, cfg(), tokenizer)
    try:
        async def many():
            return await asyncio.gather(*(c.generate(MSG) for _ in range(6)))
        out = asyncio.run(many())
        assert len(out) == 6 and len(set(out)) == 1
        m = c.take_metrics()
        assert m["genrm/requests"] == 6.0 and m["genrm/errors"] == 0.0
        assert c._down.get("judge0", 0) > 0 and "judge1" not in c._down
        assert set(c._picker.busy().values()) == {0}  # every call released its judge
    finally:
        c.close()


def test_every_judge_dead_is_a_genrm_error_after_the_retries(tokenizer):
    dead = {f"judge{i}": _dead_url() for i in range(2)}
    c = GenRMClient(dead, cfg(retries=3), tokenizer)
    try:
        with pytest.raises(GenRMError, match=r"after 2 attempt\(s\) on judge0, judge1.*refused|after 2 attempt"):
            asyncio.run(c.generate(MSG))
        assert c.take_metrics() == {"genrm/requests": 1.0, "genrm/errors": 1.0}
    finally:
        c.close()


def test_a_4xx_is_not_retried(cpu_engine, tiny_llama, tmp_path, tokenizer):
    from relax_hpc.engines.launcher import start_engine

    h = start_engine("cpu", tiny_llama, log_path=tmp_path / "keyed.log", api_key="right",
                     extra_args=["--threads", "1"]).wait_ready(120)
    c = GenRMClient({"judge0": h.url, "judge1": cpu_engine.url}, cfg(), tokenizer, api_key="wrong")
    try:
        c._picker._turn = iter([0] * 10)  # judge0 first (the keyed one; the open one would answer)
        with pytest.raises(GenRMError, match=r"1 attempt\(s\) on judge0.*401"):
            asyncio.run(c.generate(MSG))
    finally:
        c.close()
        h.stop()


def test_route_keys_and_bad_messages_are_refused_clearly(cpu_engine, tokenizer):
    c = GenRMClient({"judge0": cpu_engine.url}, cfg(), tokenizer)
    try:
        with pytest.raises(GenRMError, match="route_key 'quality' names a judge instance"):
            asyncio.run(c.generate(MSG, route_key="quality"))
        assert asyncio.run(c.generate(MSG, route_key="__default__"))  is not None
        with pytest.raises(GenRMError, match="takes messages"):
            asyncio.run(c.generate("just a string"))
    finally:
        c.close()


def test_without_a_judge_the_module_call_names_the_keys_to_set():
    genrm.reset()
    with pytest.raises(GenRMError, match="set genrm.model_path and roles.genrm.enabled"):
        asyncio.run(genrm.generate(MSG))
    assert genrm.take_metrics() == {}


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    """A judge model whose context holds the dapo-genrm prompt (about 750 characters, one token each)."""
    from tests.rollout.conftest import _tiny_model_maker

    out = tmp_path_factory.mktemp("judge-model") / "tiny-judge"
    return _tiny_model_maker()(out, arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, seed=1, max_pos=2048)


@pytest.fixture(scope="module")
def judge_engine(tiny_judge, tmp_path_factory):
    from relax_hpc.engines.launcher import start_engine

    h = start_engine("cpu", tiny_judge, log_path=tmp_path_factory.mktemp("judge-log") / "judge.log",
                     extra_args=["--threads", "1", "--seed", "0"])
    try:
        yield h.wait_ready(120)
    finally:
        h.stop()


def _dapo_recipe(model) -> Recipe:
    r = Recipe()
    r.rollout.rm_type, r.rollout.reward_key, r.rollout.reward_error_policy = "dapo-genrm", "score", "skip"
    r.genrm = GenRMConfig(model_path=str(model), sampling=GenRMSampling(temperature=0.0, max_response_len=4))
    return r


def test_a_prompt_longer_than_the_judge_context_is_a_reward_failure_naming_the_fix(cpu_engine, tiny_llama):
    from relax_hpc.rollout.rewards import RewardRunner
    from relax_hpc.rollout.sample import Sample

    r = _dapo_recipe(tiny_llama)  # max_pos 512: the judge prompt does not fit
    genrm.configure({"judge0": cpu_engine.url}, r.genrm)
    try:
        s = Sample(index=0, group_index=0, prompt="1+1=", label="2", response="Answer: 2")
        [failure] = asyncio.run(RewardRunner(r).score_group([s]))
        assert "longer than the model's context length" in str(failure.error) and "longer context" in str(failure.error)
        assert genrm.take_metrics() == {"genrm/requests": 1.0, "genrm/errors": 1.0}
    finally:
        genrm.reset()


def test_rm_type_dapo_genrm_through_the_reward_runner(judge_engine, tiny_judge):
    """The built-in, end to end: the runner asks the module's judge; the score is the rule's reading of the text."""
    from relax_hpc.rollout.rewards import RewardRunner
    from relax_hpc.rollout.sample import Sample

    r = _dapo_recipe(tiny_judge)
    genrm.configure({"judge0": judge_engine.url}, r.genrm)
    try:
        runner = RewardRunner(r)
        samples = [Sample(index=i, group_index=0, prompt=f"{i}+1=", label=str(i + 1),
                          response=("Answer: " + str(i + 1)) if i % 2 == 0 else "no answer") for i in range(4)]
        failures = asyncio.run(runner.score_group(samples))
        assert failures == []
        for s in samples:
            if s.index % 2:
                assert s.reward["format_error"] == "answer_missing"
            else:
                assert s.reward["format_error"] == "" and s.reward["judge_response"]
                assert s.reward["score"] == (genrm_verdict(s.reward["judge_response"])[0] or 0.0)
        assert genrm.take_metrics()["genrm/requests"] == 2.0
    finally:
        genrm.reset()

