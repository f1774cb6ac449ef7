"""Real SGLang on a CUDA GPU, driven by relax_hpc's own client and weight sender (``tools/gpu-check``'s ``sglang``
stage runs this file; skipped without CUDA or without ``RELAX_SGLANG_PYTHON``): one SGLang server for the module,
on a tiny Qwen3-MoE (routed experts) in bf16 with SGLang's memory saver, the way a colocated run starts it.

* generate: log-probs per token, the finish reason, and the routed experts (``--enable-return-routed-experts``)
  decoded by relax_hpc to ``[tokens run, layers, top-k]`` ids of the model's experts, the same for the same prompt;
* release / resume memory occupation: the memory comes back to the card and is taken again (seen from this
  process, ``torch.cuda.mem_get_info``), and the server stays healthy;
* the colocate hand-over: the actor's weights by CUDA IPC (``WeightSender(path="tensor")``: SGLang's
  ``/update_weights_from_tensor``) after the resume, read back by name, the version set, generation going on;
* the weight sync over NCCL (``WeightSender(backend="nccl")``: a group with SGLang, its flattened buckets): this
  process on a second GPU, since NCCL refuses two ranks on one device; on a one-GPU machine it skips, saying so
  (the one skip ``tools/gpu-check`` allows there).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS, EXPERTS, TOP_K = 2, 8, 2
KEY = "relax-sglang-gpu-test-key"
PROMPT = [1, 10, 11, 12, 13, 14, 15]
NEEDS_TWO = "needs 2 GPUs: NCCL refuses two ranks on one device (SGLang on GPU 0, this process on GPU 1)"


@pytest.fixture(scope="module")
def sglang_python() -> str:
    py = os.environ.get("RELAX_SGLANG_PYTHON")
    if not py:
        pytest.skip("needs RELAX_SGLANG_PYTHON: an interpreter that can `import sglang`")
    return py


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from tests.rollout.conftest import _tiny_model_maker

    # head_dim 64: a size every attention backend of SGLang takes
    return _tiny_model_maker()(tmp_path_factory.mktemp("sglang-gpu") / "qwen3-moe", arch="qwen3_moe", hidden=256,
                               layers=LAYERS, heads=4, kv_heads=2, seed=0,
                               moe=dict(experts=EXPERTS, experts_per_token=TOP_K, moe_intermediate=64))


@pytest.fixture(scope="module")
def engine(sglang_python, moe_model, tmp_path_factory):
    from relax_hpc.engines.launcher import launch_engine

    h = launch_engine("sglang", moe_model, python=sglang_python, env={"CUDA_VISIBLE_DEVICES": "0"}, api_key=KEY,
                      log_path=tmp_path_factory.mktemp("sglang-gpu-log") / "sglang.log", ready_timeout=300,
                      extra_args=["--weight-version", "0", "--dtype", "bfloat16", "--mem-fraction-static", "0.3",
                                  "--disable-cuda-graph", "--enable-memory-saver", "--enable-return-routed-experts"])
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def client(engine):
    c = engine.client(timeout=120)
    yield c
    c.close()


def hf_weights(model_path, device: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    return {n: t.detach().to(device) for n, t in m.state_dict().items()}


def perturbed(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The weights with the two tensors SGLang keeps unfused (read back by name) changed."""
    g = torch.Generator(device=sd["model.norm.weight"].device).manual_seed(seed)
    out = dict(sd)
    for n in ("model.norm.weight", "model.embed_tokens.weight"):
        out[n] = sd[n] + 0.05 * torch.randn(sd[n].shape, generator=g, device=sd[n].device, dtype=sd[n].dtype)
    return out


def assert_engine_has(client, sd: dict[str, torch.Tensor], version: str) -> None:
    for n in ("model.norm.weight", "model.embed_tokens.weight"):
        got = torch.tensor(client.get_weights_by_name(n, truncate_size=8)).flatten()
        want = sd[n].flatten()[:got.numel()].float().cpu()
        assert torch.allclose(got, want, atol=1e-2, rtol=0), (n, got, want)
    assert client.weight_version() == version
    g = client.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    assert len(g.output_ids) == 4 and g.weight_version == version


def test_generate_with_routed_experts(client):
    from relax_hpc.engines.client import routed_experts

    sp = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    g = client.generate(PROMPT, sp, extra={"return_routed_experts": True})
    assert len(g.output_ids) == len(g.output_logprobs) == 5 and g.finish_reason.type == "length"
    assert all(lp <= 0 for lp in g.output_logprobs) and g.weight_version == "0"
    r = routed_experts(g, layers=LAYERS, top_k=TOP_K)
    assert r.shape == (len(PROMPT) + 5 - 1, LAYERS, TOP_K), r.shape
    assert r.min() >= 0 and r.max() < EXPERTS
    assert all(len(set(row)) == TOP_K for row in r.reshape(-1, TOP_K).tolist())  # top-k: distinct experts
    again = client.generate(PROMPT, sp, extra={"return_routed_experts": True})
    assert (routed_experts(again, layers=LAYERS, top_k=TOP_K) == r).all() and again.output_ids == g.output_ids


def test_release_and_resume_memory(client):
    total = torch.cuda.mem_get_info(0)[1]
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info(0)[0]
    client.release_memory_occupation()
    free1 = torch.cuda.mem_get_info(0)[0]
    client.resume_memory_occupation()
    free2 = torch.cuda.mem_get_info(0)[0]
    print(f"free {free0 / 1e9:.2f} → released {free1 / 1e9:.2f} → resumed {free2 / 1e9:.2f} GB of {total / 1e9:.0f}")
    # --mem-fraction-static 0.3: SGLang holds about 0.3 of the card (weights + KV cache), given back and taken again
    assert free1 - free0 >= 0.2 * total, (free0, free1, total)
    assert free1 - free2 >= 0.2 * total, (free1, free2, total)
    assert client.is_healthy(timeout=60)


def test_colocate_handover_by_cuda_ipc(client, moe_model):
    """After a release/resume the weights are undefined: all of them come back by CUDA IPC from this process."""
    from relax_hpc.weights.sync import WeightSender

    client.release_memory_occupation()
    client.resume_memory_occupation()
    sd = perturbed(hf_weights(moe_model, "cuda:0"), seed=1)
    s = WeightSender(path="tensor", api_key=KEY, timeout=120, connect_timeout=120)
    try:
        s.connect([client], "127.0.0.1")
        assert s.path == "tensor"
        stats = s.push(sd.items(), "ipc-1")
        assert stats["perf/weight_sync_tensors"] == len(sd)
        assert_engine_has(client, sd, "ipc-1")
    finally:
        s.close()


def test_weight_sync_over_nccl(client, moe_model):
    from relax_hpc.weights.sync import WeightSender

    if torch.cuda.device_count() < 2:
        pytest.skip(NEEDS_TWO)
    torch.cuda.set_device(1)  # this process's NCCL rank binds its current device: not SGLang's GPU 0
    sd = perturbed(hf_weights(moe_model, "cuda:1"), seed=2)
    s = WeightSender(backend="nccl", path="distributed", device="cuda:1", api_key=KEY, timeout=120,
                     connect_timeout=120)
    try:
        s.connect([client], "127.0.0.1")
        assert s.backend == "nccl" and s.path == "distributed"
        s.push(sd.items(), "nccl-1")
        assert_engine_has(client, sd, "nccl-1")
    finally:
        s.close()
        torch.cuda.set_device(0)
