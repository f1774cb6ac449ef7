"""The client's check of an answer's routed experts (MoE routing replay), and the CPU engine's hook kinds that spoil
them (``relax_hpc.engines.bad_output``): each spoiled answer is an :class:`EngineOutputError` naming what is wrong,
an answer without routed experts is left alone, and a sound one passes."""

from __future__ import annotations

import base64
import copy
import re

import numpy as np
import pytest

from relax_hpc.engines.bad_output import PAST_ANY_EXPERT, BadOutput
from relax_hpc.engines.client import EngineOutputError, model_routing, parse_generation
from relax_hpc.exchange.fields import Routing

MOE = Routing(layers=2, top_k=2, num_experts=4)
PROMPT, OUT = 3, 2  # the engine ran 3 + 2 - 1 = 4 tokens


def answer(routed: np.ndarray | None = None, finish: str = "length", out: int = OUT) -> dict:
    """An SGLang /generate answer of ``out`` tokens after a prompt of 3, with ``routed`` [tokens, 4] as SGLang
    encodes it (base64 of little-endian int32)."""
    meta = {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": PROMPT, "completion_tokens": out,
            "weight_version": "0", "output_token_logprobs": [[-0.5, 5 + i, None] for i in range(out)]}
    if routed is not None:
        meta["routed_experts"] = base64.b64encode(np.asarray(routed, dtype="<i4").tobytes()).decode()
    return {"text": "ab", "output_ids": [5 + i for i in range(out)], "meta_info": meta}


SOUND = np.array([[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]])


def parse(obj, routing=MOE):
    return parse_generation("http://e", obj, return_logprob=True, vocab_size=128, routing=routing)


HOOKED = [("expert_out_of_range", rf"token 0, layer 0 has expert ids \[{PAST_ANY_EXPERT}, 1\]: an id outside \[0, 4\)"),
          ("duplicate_expert", r"token 0, layer 0 has expert ids \[0, 0\]: an id repeated"),
          ("extra_layer", r"32 expert ids, not 4 tokens × 2 layers × top-2 = 16 \(.*8 ids a token: a row for an "
                          r"extra or a missing layer")]


@pytest.mark.parametrize("kind, want", HOOKED, ids=[k for k, _ in HOOKED])
def test_each_spoiled_answer_is_refused_naming_the_field_and_what(kind, want):
    assert parse(answer(SOUND)).output_ids == [5, 6]
    hook = BadOutput(f"{kind}:1", 128)
    bad = answer(SOUND)
    hook.spoil(bad)
    with pytest.raises(EngineOutputError) as e:
        parse(bad)
    assert str(e.value).startswith("engine http://e: /generate failed: bad output: meta_info.routed_experts: ")
    assert re.search(want, e.value.cause), e.value.cause
    again = answer(SOUND)
    hook.spoil(again)  # only the first answer
    assert parse(again).output_ids == [5, 6] and hook.left == 0


def test_an_answer_without_routed_experts_is_not_spoiled_and_the_count_waits():
    hook = BadOutput("expert_out_of_range:1", 128)
    plain = answer()
    before = copy.deepcopy(plain)
    hook.spoil(plain)
    assert plain == before and hook.left == 1


def test_without_the_model_s_routing_only_what_needs_no_model_is_refused():
    """An engine answer judged without the model (no config.json found): ids >= 0, one row a token ran."""
    assert parse(answer(SOUND), routing=None).output_ids == [5, 6]
    wide = np.concatenate([SOUND, SOUND], axis=1)  # 8 a token: only the model's 2 layers × top-2 tell
    assert parse(answer(wide), routing=None).output_ids == [5, 6]
    with pytest.raises(EngineOutputError, match=r"routed_experts: token 1 has expert ids \[3, 2, -1, 0\]: an id "
                                                r"below 0"):
        parse(answer(np.array([[0, 1, 2, 3], [3, 2, -1, 0], [1, 3, 0, 2], [2, 0, 3, 1]])), routing=None)
    with pytest.raises(EngineOutputError, match=r"routed_experts: 9 expert ids for 4 tokens: not a whole number"):
        parse(answer(SOUND[:3, :3]), routing=None)


def test_an_aborted_answer_s_rows_are_not_counted_its_ids_are():
    """An abort may leave fewer rows than tokens (SGLang stops mid-way); each row it has is still held to the model."""
    short = SOUND[:2]
    assert parse(answer(short, finish="abort")).finish_reason.type == "abort"
    with pytest.raises(EngineOutputError, match=r"routed_experts: 8 expert ids, not 4 tokens"):
        parse(answer(short))
    with pytest.raises(EngineOutputError, match=r"token 1, layer 1 has expert ids \[1, 4\]: an id outside"):
        parse(answer(np.array([[0, 1, 2, 3], [3, 2, 1, 4]]), finish="abort"))


def test_routed_experts_that_are_not_base64_of_int32_are_refused():
    bad = answer(SOUND)
    bad["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(EngineOutputError, match=r"meta_info.routed_experts is not base64 of int32"):
        parse(bad)


def test_the_model_s_routing_comes_from_its_config(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 2,
                                                      "num_experts": 4, "vocab_size": 128}))
    assert model_routing(str(tmp_path)) == MOE
    assert model_routing(None) is None and model_routing(str(tmp_path / "nowhere")) is None
