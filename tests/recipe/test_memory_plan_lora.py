"""The memory plan with ``train.lora`` (relax_hpc/recipe/memory_plan.py): the frozen base keeps its parameters but
has no gradient buffer and no optimizer state, so those two terms count the adapters only."""

from __future__ import annotations

import json
from pathlib import Path

from relax_hpc.recipe import load_recipe
from relax_hpc.recipe.memory_plan import GiB, ModelShape, lora_params, plan
from relax_hpc.train.config import LoraConfig

REPO = Path(__file__).resolve().parents[2]
QWEN3_4B = REPO / "tests" / "recipe" / "data" / "qwen3-4b"
CONFIG = json.loads((QWEN3_4B / "config.json").read_text())


def _actor(*overrides: str) -> dict[str, float]:
    r = load_recipe(str(REPO / "recipes" / "qwen3-4b-dapo-8gpu.yaml"),
                    [f"model.path={QWEN3_4B}", "slurm.gpu_memory_gb=80", "train.offload=false", *overrides])
    mp, _ = plan(r, CONFIG)
    phase = next(p for c in mp.cards for p in c.phases if p.name == "train")
    return {t.what: t.gib for t in phase.terms if t.role == "actor"}


def test_lora_counts_the_adapters_for_grads_and_optimizer():
    full = _actor()
    lora = _actor("train.lora.rank=16")
    assert lora["params"] == full["params"]  # the base stays in memory
    shape = ModelShape.from_config(CONFIG)
    n = lora_params(shape, LoraConfig(rank=16), shape.layers, 1)
    # rank 16 on q/k/v/o/gate/up/down of Qwen3-4B's 36 layers: 16 × 36 × (2560+6144 + 4096+2560 + 2560+19456 + 9728+2560)
    assert n == 16 * 36 * (2560 + 6144 + 4096 + 2560 + 2560 + 19456 + 9728 + 2560)
    assert abs(lora["grads"] * GiB - n * 4 / _tp()) < 1e3
    assert lora["grads"] * 50 < full["grads"] and lora["optimizer"] * 50 < full["optimizer"]


def _tp() -> int:
    r = load_recipe(str(REPO / "recipes" / "qwen3-4b-dapo-8gpu.yaml"), [f"model.path={QWEN3_4B}"])
    return r.train.tp
