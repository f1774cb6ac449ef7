"""``--from-relax-args`` with Relax's LoRA flags (relax_hpc/recipe/from_relax.py, relax_names.py): they land on
``train.lora``; ``--lora-rank 0`` (Relax's default: full fine-tuning) leaves LoRA out, saying so."""

from __future__ import annotations

from relax_hpc.recipe.from_relax import convert


def test_lora_flags_land_on_train_lora():
    data, _ = convert(["--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.05",
                       "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj", "--lora-adapter-mode"])
    assert data["train"]["lora"] == {"rank": 16, "alpha": 32.0, "dropout": 0.05, "mode": "adapter",
                                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def test_all_linear_and_merge_mode_by_default():
    data, _ = convert(["--lora-rank", "8", "--lora-target-modules", "all-linear"])
    assert data["train"]["lora"] == {"rank": 8, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1",
                                                                   "linear_fc2"]}


def test_rank_zero_is_full_fine_tuning():
    data, notes = convert(["--lora-rank", "0", "--lora-alpha", "16"])
    assert "lora" not in data.get("train", {})
    assert any("--lora-rank above 0" in n for n in notes)
