"""The fields relax_hpc reads from an SGLang ``/generate`` answer are ones SGLang writes, under that name and in that
form: the answer of SGLang's app (its meta_info built with SGLang's response schema; routed experts as SGLang's
tokenizer manager encodes a tensor of them) read by relax_hpc's client, then by SGLang's own schema and routed-experts
decoder (sglang_side/check_response.py)."""

from __future__ import annotations

import json

from contract_support import run_sglang
from relax_hpc.engines.client import EngineClient, SamplingParams, decode_routed_experts, routed_experts

# what relax_hpc's client reads of meta_info (parse_generation, parse_input_logprobs, routed_problem) and of the answer
READ_META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "output_token_logprobs",
             "input_token_logprobs", "input_top_logprobs", "weight_version"}


def sglang_reads(sglang_python, tmp_path, answer: dict) -> dict:
    f = tmp_path / "answer.json"
    f.write_text(json.dumps(answer))
    r = run_sglang(sglang_python, "check_response.py", str(f))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_generate_answer_fields_and_routed_experts(sglang_python, recorder, tmp_path):
    with EngineClient(recorder.url, api_key=recorder.api_key, retries=0) as c:
        g = c.generate([5, 6, 7], SamplingParams(max_new_tokens=2), extra={"return_routed_experts": True})
    recorder.take()
    got = sglang_reads(sglang_python, tmp_path, {"text": g.text, "meta_info": g.meta_info, "output_ids": g.output_ids})
    assert got["schema_problem"] is None
    assert READ_META <= set(got["schema_fields"]), READ_META - set(got["schema_fields"])
    # routed experts: relax_hpc's decoder gives SGLang's decoder's array, shaped [tokens run, layers, top-k]
    raw = g.meta_info["routed_experts"]
    assert decode_routed_experts(raw).reshape(-1).tolist() == got["routed_experts"]
    arr = routed_experts(g, layers=2, top_k=2)
    assert arr.shape == (3 + 2 - 1, 2, 2) and arr.reshape(-1).tolist() == got["routed_experts"]


def test_negative_control_a_field_sglang_does_not_write(sglang_python, tmp_path):
    """A meta_info field in the wrong form fails SGLang's schema, and a name SGLang does not write is absent from it."""
    got = sglang_reads(sglang_python, tmp_path, {"text": "", "output_ids": [1],
                                                 "meta_info": {"id": "r", "prompt_tokens": "three"}})
    assert got["schema_problem"] == 'invalid type: string "three", expected u32'
    assert "output_logprobs" not in got["schema_fields"]  # a plausible misspelling of output_token_logprobs
