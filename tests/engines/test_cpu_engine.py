"""CPU-engine specifics: weight updates over a real gloo group (this test process is rank 0, the trainer),
from disk, and the parts of SGLang's /generate contract the client does not use (batch input, text, stop strings)."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.distributed as dist

from relax_hpc.engines.client import EngineError, SamplingParams
from relax_hpc.engines.receiver import init_weight_update_group
from relax_hpc.engines.launcher import free_port

PROMPT = [1, 10, 11, 12, 13, 14]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
GROUP = "test_weight_group"


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    """The trainer's copy of the weights; tests update it exactly as they update the engine."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def group(client):
    """Rank 0 (here) + the engine as rank 1, as the actor and one TP=1 engine would be."""
    port = free_port("127.0.0.1")
    fut = client.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, group_name=GROUP, backend="gloo")
    pg = init_weight_update_group("127.0.0.1", port, 0, 2, GROUP, backend="gloo", timeout_s=60)
    assert "Succeeded" in fut.result(timeout=60)["message"]
    yield pg
    client.destroy_weights_update_group(GROUP)
    dist.destroy_process_group(pg)


def engine_matches_model(client, model, names) -> None:
    """Fingerprint: the first rows of each parameter, exactly."""
    sd = model.state_dict()
    for n in names:
        assert torch.equal(torch.tensor(client.get_weights_by_name(n, truncate_size=3)), sd[n][:3].float()), n


def greedy_logprob_gap(client, model) -> float:
    """Generate greedily on the engine; compare with the local model's teacher-forced log-probs and argmax."""
    g = client.generate(PROMPT, GREEDY)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + g.output_ids])).logits[0, len(PROMPT) - 1:-1]
    assert logits.argmax(-1).tolist() == g.output_ids
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.output_ids)[:, None])[:, 0]
    return (ref - torch.tensor(g.output_logprobs)).abs().max().item()


def test_update_outside_session_is_refused(client, group):
    with pytest.raises(EngineError) as e:
        client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], GROUP)
    assert e.value.status == 400 and "begin_weight_update" in str(e.value)
    with pytest.raises(EngineError):
        client.end_weight_update()
    client.begin_weight_update()
    try:
        with pytest.raises(EngineError, match="already"):
            client.begin_weight_update()
    finally:
        client.end_weight_update()


def test_update_per_tensor_broadcast(client, group, hf_model):
    before = client.generate(PROMPT, GREEDY).output_ids
    names = ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "model.norm.weight"]
    sd = hf_model.state_dict()
    gen = torch.Generator().manual_seed(0)
    new = [sd[n] + 0.5 * torch.randn(sd[n].shape, generator=gen) for n in names]
    client.begin_weight_update()
    fut = client.submit(client.update_weights_from_distributed, names, [str(t.dtype) for t in new],
                        [list(t.shape) for t in new], GROUP, weight_version="v1")
    for t in new:
        dist.broadcast(t, src=0, group=group)
    fut.result(timeout=60)
    client.end_weight_update()
    with torch.no_grad():
        for n, t in zip(names, new):
            sd[n].copy_(t)
    engine_matches_model(client, hf_model, names)
    assert client.weight_version() == "v1"
    g = client.generate(PROMPT, GREEDY)
    assert g.weight_version == "v1" and g.output_ids != before
    assert greedy_logprob_gap(client, hf_model) < 1e-4


def test_update_flattened_bucket(client, group, hf_model):
    names = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.1.input_layernorm.weight"]
    sd = hf_model.state_dict()
    gen = torch.Generator().manual_seed(1)
    new = [sd[n] * 1.5 + 0.1 * torch.randn(sd[n].shape, generator=gen) for n in names]
    client.begin_weight_update()
    fut = client.submit(client.update_weights_from_distributed, names, ["float32"] * 3, [list(t.shape) for t in new],
                        GROUP, weight_version="v2", load_format="flattened_bucket")
    dist.broadcast(torch.cat([t.flatten() for t in new]), src=0, group=group)
    fut.result(timeout=60)
    client.end_weight_update()
    with torch.no_grad():
        for n, t in zip(names, new):
            sd[n].copy_(t)
    engine_matches_model(client, hf_model, names)
    assert client.generate(PROMPT, GREEDY).weight_version == "v2"
    assert greedy_logprob_gap(client, hf_model) < 1e-4


def test_unknown_name_fails_after_receiving(client, group):
    """The engine takes every broadcast before judging names, so a bad name never hangs the trainer."""
    client.begin_weight_update()
    try:
        fut = client.submit(client.update_weights_from_distributed, ["model.nope.weight"], ["float32"], [[4]], GROUP)
        dist.broadcast(torch.zeros(4), src=0, group=group)
        with pytest.raises(EngineError, match="unknown parameter"):
            fut.result(timeout=60)
    finally:
        client.end_weight_update()


def test_update_weights_from_disk(client, tiny_llama):
    from transformers import AutoModelForCausalLM

    client.update_weights_from_disk(str(tiny_llama), weight_version="disk-0")
    original = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine_matches_model(client, original, ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"])
    assert client.weight_version() == "disk-0"
    assert greedy_logprob_gap(client, original) < 1e-4
    with pytest.raises(EngineError, match="safetensors"):
        client.update_weights_from_disk(str(tiny_llama / "nowhere"))
    client.update_weight_version("v3")
    assert client.generate(PROMPT, {"max_new_tokens": 1}).weight_version == "v3"


# ---------------------------------------------------------------------------- raw /generate contract

def post(cpu_engine, body) -> httpx.Response:
    return httpx.post(cpu_engine.url + "/generate", json=body, timeout=60)


def test_batch_input_and_text(cpu_engine):
    r = post(cpu_engine, {"input_ids": [[1, 2], [1, 2, 3]], "sampling_params": {"max_new_tokens": 3},
                          "rid": ["a", "b"], "return_logprob": [True, False]})
    out = r.json()
    assert r.status_code == 200 and [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert len(out[0]["meta_info"]["output_token_logprobs"]) == 3 and "output_token_logprobs" not in out[1]["meta_info"]
    t = post(cpu_engine, {"text": "12+7=", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                          "return_logprob": True, "return_text_in_logprobs": True}).json()
    assert t["meta_info"]["prompt_tokens"] == 5 and isinstance(t["text"], str)
    assert all(isinstance(row[2], str) for row in t["meta_info"]["output_token_logprobs"])


def test_stop_strings(cpu_engine):
    sp = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    ref = post(cpu_engine, {"text": "hello", "sampling_params": sp}).json()
    char = next(c for c in ref["text"][3:] if c.isalnum())  # a character that appears a few tokens in
    g = post(cpu_engine, {"text": "hello", "sampling_params": {**sp, "stop": [char]}}).json()
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": char}
    assert g["text"] == ref["text"][:ref["text"].index(char)]  # SGLang trims the matched stop string


def test_edge_requests(cpu_engine):
    zero = post(cpu_engine, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}).json()
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    too_long = post(cpu_engine, {"input_ids": [1] * 600})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    unsupported = post(cpu_engine, {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}})
    assert unsupported.status_code == 400 and "frequency_penalty" in unsupported.text
    neutral = post(cpu_engine, {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.0, "n": 1,
                                                                      "max_new_tokens": 1, "stop": []}})
    assert neutral.status_code == 200
    assert post(cpu_engine, {"input_ids": [1], "text": "x"}).status_code == 400
    assert httpx.get(cpu_engine.url + "/no_such_endpoint").status_code == 404
