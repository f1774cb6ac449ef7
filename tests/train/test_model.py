"""The optimizer the actor builds (relax_hpc/train/model.py ``optimizer_config``): the recipe's optimizer offload keys
reach megatron-core's real OptimizerConfig under their own names, and what megatron-core refuses is said naming
the keys (the CPU here has no Transformer Engine, which the precision-aware optimizer needs without CPU offload)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from relax_hpc.train.config import TrainConfig
from relax_hpc.train.model import optimizer_config


def test_the_offload_keys_reach_megatrons_optimizer_config():
    """Offload without the precision-aware optimizer (which needs Transformer Engine, absent here; the recipe
    validator asks for both together): megatron-core's real OptimizerConfig takes them, under their own names."""
    cfg = TrainConfig(bf16=True, optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True, lr=2e-6,
                      weight_decay=0.1)
    opt = optimizer_config(cfg, torch.bfloat16)
    assert type(opt).__module__.startswith("megatron.core.optimizer")
    assert opt.optimizer_cpu_offload and opt.overlap_cpu_optimizer_d2h_h2d and not opt.use_precision_aware_optimizer
    assert opt.optimizer_offload_fraction == 1.0  # all of it: megatron-core's own default (0.0) offloads nothing
    assert opt.use_distributed_optimizer and opt.bf16 and opt.lr == 2e-6 and opt.weight_decay == 0.1
    assert opt.decoupled_weight_decay  # megatron's CPU offload asserts AdamW mode


def test_by_default_nothing_is_offloaded():
    opt = optimizer_config(TrainConfig(), torch.float32)
    assert not opt.optimizer_cpu_offload and not opt.use_precision_aware_optimizer
    assert opt.optimizer_offload_fraction == 0.0 and not opt.overlap_cpu_optimizer_d2h_h2d


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed: accepted")
@pytest.mark.parametrize("offload", [False, True])
def test_without_transformer_engine_the_precision_aware_optimizer_is_refused_naming_the_keys(offload):
    """megatron-core 0.16.1 checks Transformer Engine's version for the precision-aware optimizer (a TypeError
    without TE, with or without the CPU offload): the error names the recipe keys, why and the fix."""
    cfg = TrainConfig(bf16=True, use_precision_aware_optimizer=True, optimizer_cpu_offload=offload)
    with pytest.raises(ValueError) as e:
        optimizer_config(cfg, torch.bfloat16)
    msg = str(e.value)
    assert "train.use_precision_aware_optimizer = True" in msg and "needs Transformer Engine" in msg
    assert f"train.optimizer_cpu_offload = {offload}" in msg and "Fix: tools/install --gpu --te" in msg
