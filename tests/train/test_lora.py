"""LoRA on the actor (relax_hpc/train/lora.py, ``train.lora``): the recipe's checks, then the ``lora`` job of the
shared two-process launch (conftest's ``multi_run``; tests/train/lora_jobs.py): parity of TP 2 and PP 2 with TP 1,
the base frozen (memory), adapters off = the base, exact resume, the base model a checkpoint records, and what a
weight sync sends in each mode."""

from __future__ import annotations

import pytest

from train.conftest import part


def _problems(**lora):
    from relax_hpc.train.config import LoraConfig, TrainConfig, check

    return check(TrainConfig(lora=LoraConfig(**lora)))


def test_lora_keys_validated():
    assert _problems() == []
    assert _problems(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                     "down_proj", "lm_head"]) == []
    (key, value, msg), = _problems(rank=0)
    assert key == "lora.rank" and value == 0 and "Fix" in msg
    (key, _, msg), = _problems(target_modules=["q_proj", "v_proj"])  # part of the fused linear_qkv
    assert key == "lora.target_modules" and "k_proj" in msg and "linear_qkv" in msg
    (key, _, msg), = _problems(target_modules=["linear_qvk"])
    assert key == "lora.target_modules" and "'linear_qvk' is not a LoRA target" in msg
    assert [k for k, _, _ in _problems(alpha=0, dropout=1.0)] == ["lora.alpha", "lora.dropout"]


def test_hf_names_map_to_megatron():
    from relax_hpc.train.config import megatron_targets

    assert megatron_targets(["down_proj", "q_proj", "k_proj", "v_proj"]) == ["linear_qkv", "linear_fc2"]
    assert megatron_targets(["gate_proj", "up_proj", "lm_head"]) == ["linear_fc1", "output_layer"]


def test_recipe_takes_train_lora(tmp_path):
    """recipes/quickstart-lora.yaml validates; train.lora's keys are the recipe's, refused with their full name."""
    from relax_hpc.recipe.load import load_recipe

    from train.conftest import REPO

    recipe = REPO / "recipes" / "quickstart-lora.yaml"
    r = load_recipe(recipe, [f"run.runs_root={tmp_path}", "train.lora.mode=adapter"])
    assert r.train.lora.rank == 8 and r.train.lora.mode == "adapter" and "output_layer" in r.train.lora.target_modules
    with pytest.raises(Exception, match="train.lora.rank"):
        load_recipe(recipe, [f"run.runs_root={tmp_path}", "train.lora.rank=-1"])


@pytest.fixture(scope="module")
def lora(multi_run) -> dict:
    return part(multi_run, "lora")


LAYOUTS = ("tp1_pp1_dp2", "tp2_pp1_dp1", "tp1_pp2_dp1")


def _maxdiff(a: list, b: list) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_lora_tp2_pp2_parity(lora):
    """The same LoRA training (fp32, 2 steps) at TP 1 (DP 2), TP 2 and PP 2: the same losses, grad norms and
    log-probs after, and it moved them (the adapters train, identically initialised at every layout)."""
    ref = lora["tp1_pp1_dp2"]
    for key in LAYOUTS[1:]:
        got = lora[key]
        for (l1, g1), (l2, g2) in zip(ref["losses"], got["losses"]):
            assert l1 == pytest.approx(l2, abs=1e-6) and g1 == pytest.approx(g2, rel=1e-5), key
        d = _maxdiff(ref["logprobs"], got["logprobs"])
        print(f"LoRA parity {key} vs tp1_pp1_dp2: max |log-prob diff| = {d:.2e}")
        assert d < 1e-5, key
    assert _maxdiff(ref["logprobs"], ref["logprobs_base"]) > 1e-2


def test_adapters_off_is_the_base(lora):
    """With the adapters switched off the trained actor gives the base model's log-probs: the reference's, with no
    second copy of the weights."""
    for key in LAYOUTS:
        assert _maxdiff(lora[key]["logprobs_off"], lora[key]["logprobs_base"]) < 1e-6, key


def test_base_frozen_memory(lora):
    """Only the adapters have gradient buffers and optimizer state; the frozen base has none."""
    full, mine = lora["full"], lora["tp1_pp1_dp2"]
    assert mine["trainable"]["params_trainable"] < mine["trainable"]["params_frozen"] / 10
    assert mine["grad_buffer_bytes"] == mine["trainable"]["bytes_trainable"]  # fp32 grads of the adapters only
    assert full["grad_buffer_bytes"] >= full["trainable"]["bytes_trainable"]
    saved = (full["grad_buffer_bytes"] + full["optimizer_state_bytes"]
             - mine["grad_buffer_bytes"] - mine["optimizer_state_bytes"])
    print(f"LoRA memory (TP 1, DP 2, per rank): grad buffers {mine['grad_buffer_bytes']} B vs full "
          f"{full['grad_buffer_bytes']} B, optimizer state {mine['optimizer_state_bytes']} B vs full "
          f"{full['optimizer_state_bytes']} B: {saved} B saved")
    assert mine["grad_buffer_bytes"] * 10 < full["grad_buffer_bytes"]
    assert mine["optimizer_state_bytes"] * 10 < full["optimizer_state_bytes"]


def test_lora_resume_exact(lora):
    """Train 2, save, train 2 vs load (a new actor) and train 2: the same losses, grad norms and log-probs, bit
    for bit; the checkpoint holds the adapters and their optimizer state, not the base."""
    r = lora["resume"]
    assert r["got"] == r["ref"] and r["got_lp"] == r["ref_lp"] and r["extra"] == {"data_pos": 2}
    assert r["ckpt_bytes"] < lora["full"]["trainable"]["bytes_trainable"]  # less than the base's weights alone


def test_checkpoint_refuses_another_base(lora):
    ref = lora["refusals"]
    assert ref["other_base"].startswith("LoraBaseMismatch") and "Fix: set model.path" in ref["other_base"]
    assert ref["no_lora"].startswith("LoraBaseMismatch") and "no train.lora" in ref["no_lora"]


def test_moe_experts_as_targets_refused_naming_why(lora):
    got = lora["refusals"]["moe_experts"]
    assert got.startswith("PermanentError") and ".mlp.experts." in got and "Fix: target the attention" in got


def test_sync_bytes_adapter_vs_merge(lora):
    """An adapter-mode sync sends under a quarter of a merge-mode (= full fine-tuning) sync's bytes, and the
    engine's merge of the adapters sent gives exactly the merged sync's weights."""
    for key in LAYOUTS:
        (nm, merge), (na, adapter) = lora[key]["merge_sync"], lora[key]["adapter_sync"]
        print(f"weight sync bytes {key}: merge {merge} ({nm} tensors), adapter {adapter} ({na} tensors)")
        assert adapter * 4 < merge
        assert all(".lora_" in n for n in lora[key]["adapter_names"])
    first = lora["tp1_pp1_dp2"]
    assert first["engine_merge_max_diff"] < 1e-6 and first["lm_head_moved"] > 1e-3


def test_export_adapter_refuses_a_full_checkpoint(tmp_path, capsys, tiny_models):
    """relax-export --adapter on a checkpoint of a run without train.lora: refused before any build, naming why."""
    from relax_hpc.train.export_cli import EXIT_REFUSED, main

    from train.test_export_cli import fake_checkpoint, make_run

    run = make_run(tmp_path, tiny_models["qwen3"])
    fake_checkpoint(run / "checkpoints", 3, 3)
    (run / "checkpoints" / "latest").write_text("step_00000003\n")
    assert main([str(run), str(tmp_path / "out"), "--adapter"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "--adapter exports LoRA adapters" in err and "Fix: leave --adapter out" in err
