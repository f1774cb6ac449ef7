"""The reference engine answers SGLang's scoring request (the OPD teacher's): ``max_new_tokens`` 0, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``. Checked against an independent teacher-forced forward of the same HF
model in float32, through the raw wire (SGLang's shapes) and through the client's ``input_logprobs``."""

from __future__ import annotations

import httpx
import pytest
import torch

from relax_hpc.engines.client import EngineError, EngineOutputError, parse_input_logprobs

PROMPTS = [[1, 10, 11, 12, 13, 14, 20, 21], [1, 5, 7], [3, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99]]


@pytest.fixture(scope="module")
def hf_log_probs(tiny_llama):
    """log_softmax of the HF model's float32 logits for each prompt alone: row p predicts token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in PROMPTS]


def post(cpu_engine, body) -> httpx.Response:
    return httpx.post(cpu_engine.url + "/generate", json=body, timeout=60)


def scoring(ids, start, **kw) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": start, **kw}


def test_a_batch_is_scored_as_an_independent_forward_computes_it(cpu_engine, hf_log_probs):
    starts = [3, 0, 9]
    r = post(cpu_engine, scoring(PROMPTS, starts, top_logprobs_num=4))
    assert r.status_code == 200
    for p, k, ref, out in zip(PROMPTS, starts, hf_log_probs, r.json()):
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["completion_tokens"] == 0  # nothing generated
        assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["prompt_tokens"] == len(p)
        rows = meta["input_token_logprobs"]
        assert [row[1] for row in rows] == p[k:] and rows[0][0] is None  # SGLang: positions k.., the first null
        want = torch.stack([ref[pos - 1, p[pos]] for pos in range(k + 1, len(p))])
        torch.testing.assert_close(torch.tensor([row[0] for row in rows[1:]]), want, atol=1e-5, rtol=0)
        top = meta["input_top_logprobs"]
        assert len(top) == len(rows) and top[0] is None and all(len(e) == 4 for e in top[1:])
        for j, e in enumerate(top[1:], start=k + 1):
            values, ids = ref[j - 1].topk(4)
            assert [x[1] for x in e] == ids.tolist()
            torch.testing.assert_close(torch.tensor([x[0] for x in e]), values, atol=1e-5, rtol=0)
        assert meta["output_top_logprobs"] == []


def test_the_temperature_does_not_scale_input_log_probs(cpu_engine):
    """SGLang computes input log-probs from the raw logits (its logits processor leaves temp_scaled_logprobs off)."""
    cold = post(cpu_engine, scoring(PROMPTS[0], 2)).json()["meta_info"]["input_token_logprobs"]
    hot = post(cpu_engine, {**scoring(PROMPTS[0], 2), "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}})
    assert hot.json()["meta_info"]["input_token_logprobs"] == cold


def test_the_client_reads_a_response_after_its_prompt(cpu_engine, client, hf_log_probs):
    """The OPD teacher's request: the log-probs of the tokens after a prompt of P come from start P - 1, rows 1.."""
    prompt_len = 5
    [a] = client.input_logprobs([PROMPTS[0]], prompt_len - 1)
    assert a.problem is None and a.token_ids == PROMPTS[0][prompt_len - 1:] and a.logprobs[0] is None
    want = [hf_log_probs[0][pos - 1, PROMPTS[0][pos]].item() for pos in range(prompt_len, len(PROMPTS[0]))]
    assert a.logprobs[1:] == pytest.approx(want, abs=1e-5) and len(a.logprobs[1:]) == len(PROMPTS[0]) - prompt_len
    # with generation too: the input rows are the same numbers, the output is generated as before
    r = post(cpu_engine, {**scoring(PROMPTS[0], prompt_len - 1),
                          "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}).json()
    assert len(r["output_ids"]) == 3 and [x[0] for x in r["meta_info"]["input_token_logprobs"]] == a.logprobs


def test_bad_scoring_requests_are_refused(cpu_engine, client):
    too_far = post(cpu_engine, scoring([1, 2, 3], 3))
    assert too_far.status_code == 400 and "logprob_start_len=3 is higher than the number of input tokens 3" in \
        too_far.json()["error"]["message"]
    assert post(cpu_engine, scoring([1, 2, 3], -2)).status_code == 400
    top_out = post(cpu_engine, {**scoring([1, 2, 3], 0), "top_logprobs_num": 2,
                                "sampling_params": {"max_new_tokens": 2}})
    assert top_out.status_code == 400 and "max_new_tokens 0" in top_out.text
    # without logprob_start_len (or -1) the answer is as before: no input log-probs
    plain = post(cpu_engine, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    assert "input_token_logprobs" not in plain.json()["meta_info"]
    with pytest.raises(ValueError, match="logprob_start_len 3 for a prompt of 3 tokens"):
        client.input_logprobs([[1, 2, 3]], 3)


def _answer(rows, **meta):
    return {"output_ids": [], "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 0},
                                            "input_token_logprobs": rows, **meta}}


def test_the_client_checks_every_row_of_an_answer():
    ids = [4, 5, 6, 7]
    good = [[None, 5, None], [-1.0, 6, None], [-2.0, 7, None]]
    assert parse_input_logprobs("u", _answer(good), ids, 1).problem is None
    # shapes and ids: the engine is wrong (the rows would be read off by one), raised
    for rows, want in [(good[1:], "2 input_token_logprobs rows for logprob_start_len 1 of 4 input tokens"),
                       ([[-0.5, 5, None], *good[1:]], "SGLang's is null"),
                       ([good[0], [-1.0, 9, None], good[2]], "row 1 is for token 9, but input position 2 holds 6")]:
        with pytest.raises(EngineOutputError, match=want):
            parse_input_logprobs("u", _answer(rows), ids, 1)
    with pytest.raises(EngineOutputError, match="answered with 1 output tokens"):
        parse_input_logprobs("u", {**_answer(good), "output_ids": [3]}, ids, 1)
    with pytest.raises(EngineError, match="malformed"):
        parse_input_logprobs("u", {"meta_info": {}}, ids, 1)
    # SGLang reports ids from vocab_size - 1 up as 0: accepted
    assert parse_input_logprobs("u", _answer([good[0], [-1.0, 0, None], good[2]]), ids, 1).problem is None
    # values: reported per prompt, not raised
    for v, want in [(float("nan"), "is nan"), (None, "is None"), (0.5, "is 0.5 > 0"), (-1e39, "must be finite")]:
        a = parse_input_logprobs("u", _answer([good[0], [v, 6, None], good[2]]), ids, 1)
        assert want in a.problem and "position 2 (token 6)" in a.problem
    top = [None, [[-1.0, 6, None], [-1.5, 3, None]], [[float("nan"), 7, None], [-3.0, 1, None]]]
    a = parse_input_logprobs("u", _answer(good, input_top_logprobs=top), ids, 1, top_logprobs_num=2)
    assert "a top log-prob of position 3 (token 7) is nan" in a.problem
    with pytest.raises(EngineOutputError, match="input_top_logprobs is not 3 entries"):
        parse_input_logprobs("u", _answer(good, input_top_logprobs=top[:2]), ids, 1, top_logprobs_num=2)
