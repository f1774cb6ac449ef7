"""LoRA adapters by a PEFT directory (``train.lora.mode: adapter`` with SGLang engines): the actor's rank 0 writes each
version under the run's directory and swaps it on every engine by SGLang's ``/unload_lora_adapter`` and
``/load_lora_adapter`` (:class:`relax_hpc.weights.lora.AdapterDirSync`). Here against a real reference engine process
over HTTP, which serves the same calls (relax_hpc/engines/lora.py); SGLang's own parse of the same requests is
tests/sglang_contract/test_lora_sglang.py."""

from __future__ import annotations

import json

import pytest
import torch

Q = "model.layers.0.self_attn.q_proj"
RANK, ALPHA = 4, 8.0
REC = {"config": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}}


def _w0(tiny_llama) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tiny_llama / "model.safetensors"))


def _adapters(seed: int, w0: dict) -> list[tuple[str, torch.Tensor]]:
    """lora_A / lora_B of q_proj (layer 0) and lm_head, as megatron-bridge exports them (B not scaled)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in (Q, "lm_head"):
        o, i = w0[m + ".weight"].shape
        out += [(m + ".lora_A.weight", torch.randn(RANK, i, generator=g)),
                (m + ".lora_B.weight", torch.randn(o, RANK, generator=g))]
    return out


def _merged(w0: dict, named: list, module: str) -> torch.Tensor:
    d = dict(named)
    return w0[module + ".weight"] + (ALPHA / RANK) * d[module + ".lora_B.weight"] @ d[module + ".lora_A.weight"]


def _served(client, module: str, rows: int = 3) -> torch.Tensor:
    return torch.tensor(client.get_weights_by_name(module + ".weight", truncate_size=rows))


def test_each_version_is_swapped_in_from_the_base(cpu_engine, client, tiny_llama, tmp_path):
    """Two versions: each served as W0 + alpha/r · B A (the second from the base, not on top of the first), the
    engine reporting the version; the directory is PEFT's; two versions are kept."""
    from relax_hpc.weights.lora import AdapterDirSync

    w0 = _w0(tiny_llama)
    sync = AdapterDirSync(tmp_path / "lora", None, str(tiny_llama))
    try:
        for v in ("1", "2", "3"):
            named = _adapters(int(v), w0)
            metrics, versions, dead = sync.publish(v, named, REC, {"e0": cpu_engine.url})
            assert versions == {"e0": v} and dead == {} and client.weight_version() == v
            for m in (Q, "lm_head"):
                assert torch.allclose(_served(client, m), _merged(w0, named, m)[:3], atol=1e-5), (v, m)
            assert metrics["perf/weight_sync_bytes"] == sum(t.numel() * 4 for _, t in named)
    finally:
        sync.close()
    root = tmp_path / "lora"
    assert (root / "adapter").resolve() == (root / "v3").resolve()
    assert sorted(p.name for p in root.glob("v*")) == ["v2", "v3"]
    cfg = json.loads((root / "v3" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["target_modules"] == ["lm_head", "q_proj"]
    from safetensors.torch import load_file

    keys = sorted(load_file(str(root / "v3" / "adapter_model.safetensors")))
    assert keys[0] == "base_model.model.lm_head.lora_A.weight" and all(k.startswith("base_model.model.") for k in keys)


def test_unload_gives_back_the_base_and_a_name_loads_once(cpu_engine, client, tiny_llama, tmp_path):
    """The reference engine answers SGLang's calls as SGLang does: unload restores the base, a second load of the
    same name is refused "already loaded" (AdapterDirSync takes that as done), an unknown name is not unloaded."""
    from relax_hpc.engines.lora import LORA_NAME
    from relax_hpc.weights.lora import AdapterDirSync

    w0 = _w0(tiny_llama)
    sync = AdapterDirSync(tmp_path / "lora", None, str(tiny_llama))
    sync.publish("7", _adapters(7, w0), REC, {"e0": cpu_engine.url})
    sync.close()
    path = str(tmp_path / "lora" / "adapter")
    again = client.request("POST", "/load_lora_adapter", {"lora_name": LORA_NAME, "lora_path": path},
                           ok_statuses=(400,)).json()
    assert again["success"] is False and "already loaded" in again["message"]
    other = client.request("POST", "/unload_lora_adapter", {"lora_name": "nope"}, ok_statuses=(400,)).json()
    assert "not loaded" in other["message"]
    assert client.request("POST", "/unload_lora_adapter", {"lora_name": LORA_NAME}).json()["success"]
    assert torch.equal(_served(client, Q), w0[Q + ".weight"][:3])


def test_a_refused_adapter_fails_the_sync_naming_the_engine(cpu_engine, client, tiny_llama, tmp_path):
    """An adapter that does not fit the model is refused by the engine (its weights unchanged) and the sync fails
    naming the engine and the fix; an engine that does not answer is reported dead, not a failure."""
    from relax_hpc.weights.lora import AdapterDirSync
    from relax_hpc.weights.sync import WeightSyncError

    w0 = _w0(tiny_llama)
    sync = AdapterDirSync(tmp_path / "lora", None, str(tiny_llama), timeout=10)
    try:
        sync.publish("8", _adapters(8, w0), REC, {"e0": cpu_engine.url})
        bad = [(n, t[:, :-1] if n.endswith("lora_A.weight") else t) for n, t in _adapters(9, w0)]  # wrong in_features
        with pytest.raises(WeightSyncError, match=r"engine e0 .* did not take LoRA adapter version 9.*Fix"):
            sync.publish("9", bad, REC, {"e0": cpu_engine.url})
        assert torch.equal(_served(client, Q), w0[Q + ".weight"][:3])  # unloaded, the bad one not taken: the base
        from relax_hpc.engines.launcher import free_port

        _, versions, dead = sync.publish("10", _adapters(10, w0), REC, {"gone": f"http://127.0.0.1:{free_port()}"})
        assert versions == {} and list(dead) == ["gone"]
    finally:
        sync.close()


def test_generate_naming_the_adapter(cpu_engine, client):
    """Every request of an adapter-mode run names the adapter (SGLang's lora_path); the reference engine takes it."""
    from types import SimpleNamespace

    from relax_hpc.engines.lora import LORA_NAME, generate_fields

    fields = generate_fields(SimpleNamespace(train=SimpleNamespace(lora=SimpleNamespace(mode="adapter"))))
    assert fields == {"lora_path": LORA_NAME}
    assert generate_fields(SimpleNamespace(train=SimpleNamespace(lora=SimpleNamespace(mode="merge")))) == {}
    assert generate_fields(SimpleNamespace(train=SimpleNamespace(lora=None))) == {}
    gen = client.generate([5, 6, 7], {"max_new_tokens": 2, "temperature": 0.0}, extra=fields)
    assert len(gen.output_ids) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sglang_on_a_gpu_serves_each_adapter_version_it_loads(tmp_path):
    """Real SGLang with the engine role's LoRA flags: each version the sync swaps in is served to the requests naming
    it (their greedy tokens are the reference engine's with the same directory merged; the base model's differ) and
    the engine reports the version. Skipped without CUDA or without RELAX_SGLANG_PYTHON."""
    import os

    from relax_hpc.engines.launcher import launch_engine, sglang_lora_args
    from relax_hpc.engines.lora import LORA_NAME
    from relax_hpc.engines.model_runner import CPUEngine
    from relax_hpc.weights.lora import AdapterDirSync
    from tests.rollout.conftest import _tiny_model_maker

    py = os.environ.get("RELAX_SGLANG_PYTHON")
    if not py:
        pytest.skip("needs RELAX_SGLANG_PYTHON: an interpreter that can `import sglang`")
    key, prompt = "relax-lora-gpu-key", [1, 10, 11, 12, 13, 14, 15]
    # head_dim 64: a size every attention backend of SGLang takes
    model = _tiny_model_maker()(tmp_path / "llama", arch="llama", hidden=256, layers=2, heads=4, kv_heads=2, seed=0)
    w0 = _w0(model)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def adapters(seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        out = []
        for i in range(2):
            for m in targets:
                part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                name = f"model.layers.{i}.{part}.{m}"
                o, n_in = w0[name + ".weight"].shape
                out += [(name + ".lora_A.weight", 0.3 * torch.randn(RANK, n_in, generator=g)),
                        (name + ".lora_B.weight", 0.3 * torch.randn(o, RANK, generator=g))]
        return out

    h = launch_engine("sglang", model, python=py, env={"CUDA_VISIBLE_DEVICES": "0"}, api_key=key,
                      log_path=tmp_path / "sglang.log", ready_timeout=300,
                      extra_args=["--weight-version", "0", "--dtype", "bfloat16", "--mem-fraction-static", "0.3",
                                  "--disable-cuda-graph", *sglang_lora_args(RANK, targets)])
    sync = AdapterDirSync(tmp_path / "lora", key, str(model))
    c = h.client(timeout=120)
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    try:
        base = c.generate(prompt, sp).output_ids
        for v in ("1", "2"):
            _, versions, _ = sync.publish(v, adapters(int(v)), REC, {"e0": h.url})
            assert versions == {"e0": v} and c.weight_version() == v
            got = c.generate(prompt, sp, extra={"lora_path": LORA_NAME})
            ref = CPUEngine(str(model), max_batch=1, batch_wait_ms=1.0, seed=0)
            assert ref.load_lora_adapter({"lora_name": LORA_NAME, "lora_path": str(tmp_path / "lora" / "adapter")})[0]
            want = ref.generate({"input_ids": prompt, "sampling_params": sp})["output_ids"]
            assert got.output_ids[0] == want[0], (v, got.output_ids, want, base)
            assert got.output_ids != base and got.weight_version == v
    finally:
        sync.close()
        c.close()
        h.stop()
