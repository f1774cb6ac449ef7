"""The reference engine on a GPU (skipped without CUDA; ``tools/gpu-check`` runs it): bf16 generation whose
first-token log-prob matches a transformers forward on the same device, the memory hand-over seen from another
process (``torch.cuda.mem_get_info``: the model's bytes come back on release and are taken again on resume), and
``/update_weights_from_tensor`` with CUDA tensors of this process (IPC handles) landing in the engine.

One engine process for the module, on a model big enough (about 370 MB in bf16) for its memory to stand out of the
allocator's rounding."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = [1, 10, 11, 12, 13, 14, 15]
BF16_LOGPROB_TOL = 0.05  # bf16 kernels reduce in other orders in another process's batch; logits are O(1) here


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    from tests.rollout.conftest import _tiny_model_maker

    out = tmp_path_factory.mktemp("gpu-model") / "qwen3-370m-bytes"
    return _tiny_model_maker()(out, arch="qwen3", hidden=2048, layers=4, heads=16, kv_heads=8, intermediate=5632,
                               seed=0)


@pytest.fixture(scope="module")
def gpu_engine(gpu_model, tmp_path_factory):
    from relax_hpc.engines.launcher import start_engine

    h = start_engine("reference", gpu_model, log_path=tmp_path_factory.mktemp("gpu-engine") / "engine.log",
                     extra_args=["--device", "cuda", "--seed", "0"])
    try:
        yield h.wait_ready(300)
    finally:
        h.stop()


@pytest.fixture(scope="module")
def gpu_client(gpu_engine):
    c = gpu_engine.client(timeout=120)
    yield c
    c.close()


def reference_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0").eval()


def first_token_gap(client, model) -> float:
    """The engine's greedy first token and its log-prob against a teacher-forced forward of ``model``: the gap of
    the log-probs, and that the engine's token is the argmax up to bf16 noise."""
    g = client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT], device="cuda:0")).logits[0, -1].float()
    ref = torch.log_softmax(logits, -1)
    tok = g.output_ids[0]
    assert ref[tok] >= ref.max() - BF16_LOGPROB_TOL, (tok, ref[tok].item(), ref.max().item())
    return abs(ref[tok].item() - g.output_logprobs[0])


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_generates_in_bf16_like_transformers(gpu_client, gpu_model):
    info = gpu_client.server_info()
    assert info["device"] == "cuda:0" and info["dtype"] == "bfloat16", info
    assert info["weight_sync_backends"] == ["nccl", "gloo"]
    assert info["gpu_uuids"] == [str(torch.cuda.get_device_properties(0).uuid)]
    model = reference_model(gpu_model)
    try:
        assert first_token_gap(gpu_client, model) < BF16_LOGPROB_TOL
    finally:
        del model
        torch.cuda.empty_cache()


def test_release_gives_the_memory_back_and_resume_takes_it(gpu_client, gpu_model, gpu_engine):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        nbytes = model_bytes(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gpu_model),
                                                              dtype=torch.bfloat16))
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info(0)[0]
    gpu_client.release_memory_occupation()
    free1 = torch.cuda.mem_get_info(0)[0]
    assert gpu_client.server_info()["memory_released"] is True and gpu_client.is_healthy()
    gpu_client.resume_memory_occupation()
    free2 = torch.cuda.mem_get_info(0)[0]
    print(f"model {nbytes / 1e6:.0f} MB; free {free0 / 1e6:.0f} → released {free1 / 1e6:.0f} → resumed "
          f"{free2 / 1e6:.0f} MB")
    assert free1 - free0 >= 0.9 * nbytes, (free0, free1, nbytes)
    assert free1 - free2 >= 0.9 * nbytes, (free1, free2, nbytes)


def test_update_weights_from_tensor_by_cuda_ipc(gpu_client, gpu_model):
    """After the resume the weights are undefined: all of them go in through IPC handles, two perturbed."""
    from relax_hpc.engines.tensor_wire import serialize_named

    model = reference_model(gpu_model)
    try:
        gen = torch.Generator(device="cuda:0").manual_seed(0)
        sd = model.state_dict()
        with torch.no_grad():
            for n in ("model.norm.weight", "model.layers.1.mlp.down_proj.weight"):
                sd[n].add_(0.05 * torch.randn(sd[n].shape, generator=gen, device="cuda:0", dtype=sd[n].dtype))
        named = list(sd.items())
        assert all(t.is_cuda for _, t in named)
        torch.cuda.synchronize()
        payload = serialize_named(named)
        gpu_client.begin_weight_update()
        try:
            t0 = time.perf_counter()
            gpu_client.update_weights_from_tensor([payload], weight_version="ipc-1")
            took = time.perf_counter() - t0
        finally:
            gpu_client.end_weight_update()
        print(f"update_weights_from_tensor: {len(named)} CUDA tensors, {model_bytes(model) / 1e9:.2f} GB in "
              f"{took * 1e3:.1f} ms (HTTP call included)")
        got = torch.tensor(gpu_client.get_weights_by_name("model.norm.weight", truncate_size=8))
        assert torch.equal(got, sd["model.norm.weight"][:8].float().cpu())
        assert gpu_client.weight_version() == "ipc-1"
        assert first_token_gap(gpu_client, model) < BF16_LOGPROB_TOL
    finally:
        del model
        torch.cuda.empty_cache()
