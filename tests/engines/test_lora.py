"""LoRA adapters on the reference engine (relax_hpc/engines/lora.py): what ``train.lora.mode: adapter``'s weight sync
sends (``…lora_A.weight`` and ``…lora_B.weight``, B already scaled) through the engine's own update paths, and
SGLang's ``/load_lora_adapter_from_tensors`` (PEFT names and config). A real engine on the tiny Llama, in process."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.engines.tensor_wire import serialize_named

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from relax_hpc.engines.model_runner import CPUEngine

    return CPUEngine(str(tiny_llama), max_batch=2, batch_wait_ms=1.0, seed=0)


def _ab(seed: int, r: int = 4, out_f: int = 64, in_f: int = 64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, in_f, generator=g), torch.randn(out_f, r, generator=g)


def _update(engine, named):
    """``/update_weights_from_tensor`` in a session, as its route answers: (success, message)."""
    from relax_hpc.engines.http import HTTPError

    engine.begin_weight_update()
    try:
        return engine.update_weights_from_tensor({"serialized_named_tensors": [serialize_named(named)]})
    except HTTPError as e:  # the route turns it into a 400 {"success": false, "message"}
        return False, e.message
    finally:
        engine.end_weight_update()


def test_adapters_sent_by_the_sync_are_merged_from_the_base(engine):
    w0 = engine.params[Q + ".weight"].detach().clone()
    a, b = _ab(1)
    ok, msg = _update(engine, [(Q + ".lora_A.weight", a), (Q + ".lora_B.weight", b)])
    assert ok, msg
    assert torch.allclose(engine.params[Q + ".weight"], w0 + b @ a, atol=1e-5)
    # the next step's adapters replace these, from the same base (no drift over steps)
    a2, b2 = _ab(2)
    assert _update(engine, [(Q + ".lora_A.weight", a2), (Q + ".lora_B.weight", b2)])[0]
    assert torch.allclose(engine.params[Q + ".weight"], w0 + b2 @ a2, atol=1e-5)
    # the actor's fingerprint check reads an adapter back by its name
    assert engine.get_weights_by_name({"name": Q + ".lora_B.weight", "truncate_size": 2}) == b2[:2].tolist()
    # a full weight of an adapted module (a merged sync) is its new base
    w1 = torch.zeros_like(w0)
    assert _update(engine, [(Q + ".weight", w1)])[0]
    assert torch.allclose(engine.params[Q + ".weight"], w1 + b2 @ a2, atol=1e-5)


def test_bad_adapters_are_refused_naming_them(engine):
    a, b = _ab(3)
    ok, msg = _update(engine, [("model.layers.0.self_attn.k_proj.lora_A.weight", a)])
    assert not ok and "lora_A and lora_B must both be sent" in msg
    ok, msg = _update(engine, [(Q + ".lora_A.weight", a[:, :32]), (Q + ".lora_B.weight", b)])
    assert not ok and "does not fit its weight" in msg and Q in msg
    ok, msg = _update(engine, [("model.layers.9.self_attn.q_proj.lora_A.weight", a),
                               ("model.layers.9.self_attn.q_proj.lora_B.weight", b)])
    assert not ok and "unknown parameter" in msg


def test_load_lora_adapter_from_tensors_sglang_form(engine):
    """SGLang's call: PEFT-named tensors and adapter_config; B scaled here by lora_alpha / r."""
    from relax_hpc.engines.cpu_engine import lora_route

    name = "model.layers.1.mlp.down_proj"
    w0 = engine.params[name + ".weight"].detach().clone()
    a, b = _ab(4, out_f=64, in_f=256)
    body = {"lora_name": "policy", "config_dict": {"r": 4, "lora_alpha": 8, "peft_type": "LORA"},
            "serialized_named_tensors": [serialize_named([(f"base_model.model.{name}.lora_A.weight", a),
                                                          (f"base_model.model.{name}.lora_B.weight", b)])]}
    status, out = lora_route(engine)(body)
    assert status == 200 and out["success"], out
    assert torch.allclose(engine.params[name + ".weight"], w0 + 2.0 * b @ a, atol=1e-5)
    body["config_dict"] = {"r": 0}
    body["serialized_named_tensors"] = [serialize_named([(f"base_model.model.{name}.lora_A.weight", a)])]
    status, out = lora_route(engine)(body)
    assert status == 400 and "lora_alpha" in out["message"]
