"""Build the actor's GPTModel from an HF directory through megatron-bridge, weights loaded, plus DDP/optimizer.

Why the bridge: it maps HF names and layouts (fused QKV, gate/up, GQA, qk-norm) to Megatron's TP/PP
shards and back, for Llama and Qwen families, so the same mapping serves loading, export and weight sync.

Import order matters (:func:`import_bridge`): megatron-bridge 0.3.1 imports ``transformer_engine`` at the
top of three modules and subclasses ``te.Linear``. Where TE is not installed (CPU, or a GPU box without
it) we import megatron-core's modules first, so that each records ``HAVE_TE = False`` and falls back to
torch, and only then put an import-only stub in ``sys.modules``; the stub's classes refuse to be built,
so nothing can silently use it. With real TE installed nothing is stubbed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from relax_hpc.train import cpu_compat
from relax_hpc.train.config import TrainConfig

_CORE_MODULES = (  # imported before any TE stub exists, so they keep HAVE_TE = False
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.fusions.fused_layer_norm",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.mlp",
    "megatron.core.post_training.modelopt.gpt.model_specs",
)


def te_available() -> bool:
    """Whether a real transformer_engine is importable (not our stub)."""
    mod = sys.modules.get("transformer_engine")
    if mod is not None:
        return not getattr(mod, "_relax_stub", False)
    return importlib.util.find_spec("transformer_engine") is not None


def _install_te_stub() -> None:
    """Import-only transformer_engine: enough names for megatron-bridge's module-level code."""

    def make_cls(name):
        def __init__(self, *a, **k):
            raise RuntimeError(f"transformer_engine is not installed (relax_hpc import stub): cannot build {name}")
        return type(name, (torch.nn.Module,), {"__init__": __init__})

    te = types.ModuleType("transformer_engine")
    te.__version__ = "0.0.0+stub"
    te._relax_stub = True
    te.__path__ = []  # a package, so submodule imports resolve through sys.modules
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.__path__ = []
    for n in ("Linear", "LayerNormLinear", "LayerNorm", "RMSNorm", "LayerNormMLP", "DotProductAttention",
              "GroupedLinear", "TransformerLayer"):
        setattr(pt, n, make_cls(n))

    def fp8_autocast(*a, **k):
        raise RuntimeError("transformer_engine is not installed (relax_hpc import stub)")

    pt.fp8_autocast = fp8_autocast
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    for n in ("Sequential", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Linear", "Dropout",
              "ConstantScale", "AddExtraInput"):
        setattr(ops, n, make_cls(n))
    pt.ops = ops
    te.pytorch = pt
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": pt,
                        "transformer_engine.pytorch.ops": ops})


def import_bridge():
    """Return ``megatron.bridge.AutoBridge``, importing megatron in the order that keeps a TE stub harmless."""
    if "megatron.bridge" not in sys.modules and not te_available():
        for name in _CORE_MODULES:
            importlib.import_module(name)
        _install_te_stub()
    from megatron.bridge import AutoBridge

    cpu_compat.patch_bridge()
    return AutoBridge


@dataclass
class BuiltModel:
    bridge: object  # megatron.bridge AutoBridge (HF config/tokenizer/artifacts, name mapping)
    chunks: list  # GPTModel per virtual-pipeline chunk on this rank (one here), not yet wrapped in DDP
    hf_dir: str


def build_model(hf_dir: str | Path, cfg: TrainConfig) -> BuiltModel:
    """GPTModel with the HF weights loaded, split as ``parallel_state`` says (init_parallel first)."""
    from megatron.core import parallel_state as ps

    assert ps.model_parallel_is_initialized(), "call relax_hpc.train.parallel.init_parallel(tp, pp) first"
    assert ps.get_tensor_model_parallel_world_size() == cfg.tp and ps.get_pipeline_model_parallel_world_size() == cfg.pp, (
        f"parallel state is tp={ps.get_tensor_model_parallel_world_size()}, "
        f"pp={ps.get_pipeline_model_parallel_world_size()} but train config says tp={cfg.tp}, pp={cfg.pp}")
    from relax_hpc.train.parallel import seed_all

    seed_all(cfg.seed)  # reproducible builds; on GPU this also seeds the TP-aware CUDA RNG the init needs
    AutoBridge = import_bridge()
    bridge = AutoBridge.from_hf_pretrained(str(hf_dir))
    provider = bridge.to_megatron_provider(load_weights=True)
    on_cpu = cpu_compat.needed()
    if not te_available():
        from megatron.bridge.models.gpt_provider import local_layer_spec

        provider.transformer_layer_spec = local_layer_spec
        provider.apply_rope_fusion = False  # needs TE >= 1.4
        provider.persist_layer_norm = False  # not supported by torch LayerNorm
    provider.tensor_model_parallel_size = cfg.tp
    provider.pipeline_model_parallel_size = cfg.pp
    provider.sequence_parallel = False
    provider.attention_dropout = 0.0  # RL: log-probs must be deterministic; also the CPU RNG tracker needs it
    provider.hidden_dropout = 0.0
    provider.bf16 = cfg.bf16
    provider.fp16 = False
    provider.params_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    provider.pipeline_dtype = provider.params_dtype
    provider.autocast_dtype = provider.params_dtype
    provider.use_cpu_initialization = on_cpu  # also makes TP shards equal to the TP=1 init
    provider.gradient_accumulation_fusion = False
    # megatron-bridge turns initialization off when it loads weights, but megatron-core sets the
    # `tensor_model_parallel` attributes of sharded weights only inside that initialization: without
    # them, grad-norm (and so clipping) counts every TP-sharded weight on TP rank 0 only (TP=2 tiny
    # Qwen3: 3.30 instead of 4.85). Initialize (cheap next to loading), the HF weights overwrite it.
    provider.perform_initialization = True
    provider.finalize()
    chunks = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=on_cpu, data_parallel_random_init=False,
        mixed_precision_wrapper=None if not cfg.bf16 else _float16_module(),
    )
    if cfg.tp > 1 and not any(getattr(p, "tensor_model_parallel", False) for c in chunks for p in c.parameters()):
        raise RuntimeError("no parameter is marked tensor_model_parallel at TP > 1: grad norms would be wrong")
    return BuiltModel(bridge=bridge, chunks=chunks, hf_dir=str(hf_dir))


def _float16_module():
    from megatron.core.transformer.module import Float16Module

    return Float16Module


def wrap_ddp_and_optimizer(chunks: list, cfg: TrainConfig):
    """Megatron DDP around each chunk and the Megatron optimizer (DistributedOptimizer when configured).

    Grads reduce in fp32; no overlap options (they use CUDA streams, and buy nothing at these sizes).
    Wires ``finalize_model_grads`` (DP all-reduce, tied-embedding grads across PP), ``no_sync`` and the
    loss scaler into the model config, as Megatron's training loop does.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_grad_reduce=False, overlap_param_gather=False, check_for_nan_in_grad=False,
    )
    config = get_model_config(chunks[0])
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=cfg.bf16, fp16=False, params_dtype=config.params_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_cfg, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model, optimizer
