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

import functools
import importlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from relax_hpc.errors import PermanentError
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
    "megatron.core.transformer.moe.moe_layer",  # and its moe_utils, token dispatchers, experts
    "megatron.core.post_training.modelopt.gpt.model_specs",
)


@functools.cache
def _imports(name: str) -> bool:
    """Whether ``name`` really imports: a TE or apex build that is present but broken (built against another torch,
    common on clusters) is found by ``find_spec`` and fails at its first kernel; here it counts as absent."""
    try:
        importlib.import_module(name)
        return True
    except Exception:  # ImportError, OSError of a missing .so, a version check's RuntimeError
        if name.startswith("transformer_engine"):  # asked before megatron imports: leave it no half-imported TE
            for mod in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
                del sys.modules[mod]
        return False


def te_available() -> bool:
    """Whether a real, working transformer_engine imports (not our stub)."""
    mod = sys.modules.get("transformer_engine")
    if mod is not None and getattr(mod, "_relax_stub", False):
        return False
    return _imports("transformer_engine.pytorch")


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


# megatron-core's fused kernels that need more than torch: the extension module (apex's, or TE) that must import,
# on CUDA. A flag left on without its kernel fails at the first forward of a real shape (masked softmax: "No module
# named scaled_masked_softmax_cuda", seen on an H200 without apex). The pure-torch fusions (bias-activation,
# bias-dropout: torch.compile'd functions) are left as the provider says.
FUSIONS = {
    "masked_softmax_fusion": "scaled_masked_softmax_cuda",  # apex; SDPAttention does not use it
    "persist_layer_norm": "apex.contrib.layer_norm.layer_norm",  # apex FastLayerNorm
    "apply_rope_fusion": "transformer_engine",  # megatron takes TE's fused RoPE
    "gradient_accumulation_fusion": "fused_weight_gradient_mlp_cuda",  # apex; megatron's own linears need it with TE too
}


def _importable(name: str) -> bool:
    return te_available() if name == "transformer_engine" else _imports(name)


def fusion_flags(asked: dict[str, bool], *, cuda: bool, importable) -> dict[str, bool]:
    """Each fusion flag of ``asked`` (the provider's) kept on only where it can run: on CUDA, with the module it
    needs importable (:data:`FUSIONS`). Pure: the test gives ``importable`` a stand-in."""
    return {key: bool(on) and cuda and importable(FUSIONS[key]) for key, on in asked.items()}


def choose_kernels(provider, *, cuda: bool, importable) -> None:
    """The layer spec and fusion flags the provider builds with: Transformer Engine's spec when TE imports, else the
    pure-torch :func:`torch_block_spec` (SDPA attention, packed sequences, sequence parallel); each fusion flag
    kept only where its kernel runs (:func:`fusion_flags`). ``importable`` is :func:`_importable`, or a test's
    stand-in."""
    if not importable("transformer_engine"):
        provider.transformer_layer_spec = torch_block_spec
    for key, on in fusion_flags({k: getattr(provider, k, False) for k in FUSIONS}, cuda=cuda,
                                importable=importable).items():
        setattr(provider, key, on)


def moe_settings(provider, hf_config, cfg: TrainConfig, *, te: bool) -> None:
    """The provider's mixture-of-experts settings (a no-op for a dense model): ``train.ep`` experts' shards, the
    expert kernels that run here, and the routing and losses of the HF model.

    * Without Transformer Engine the experts are megatron-core's ``SequentialMLP`` (one local MLP per expert: the
      bridge turns grouped GEMM and permute fusion on, which need TE).
    * ``norm_topk_prob`` (Qwen3-MoE: true) is Megatron's softmax over the top-k logits (``moe_router_pre_softmax``
      off); without it, softmax over all experts then top-k, unrenormalised.
    * ``train.routing_replay``: megatron-core's replay slot on every router (:mod:`relax_hpc.train.routing`).
    * The load-balancing loss as the HF config trains it: ``router_aux_loss_coef`` only where
      ``output_router_logits`` is on (Qwen3-30B-A3B: off, so no aux loss); no z-loss (Qwen3 has none). Dropless
      routing (no capacity factor), as HF.
    """
    experts = getattr(provider, "num_moe_experts", None)
    replay = cfg.routing_replay
    if not experts:
        if cfg.ep > 1:
            raise PermanentError(f"train.ep = {cfg.ep} but the model is dense (no experts in its config). "
                                 "Fix: train.ep: 1")
        if replay:
            raise PermanentError("train.routing_replay = true but the model is dense (no experts in its config): "
                                 "there is no routing to replay. Fix: train.routing_replay: false")
        return
    if replay and cfg.pp > 1 and cfg.recompute != "none":  # relax_hpc.train.routing: recompute reruns the routers
        raise PermanentError(f"train.routing_replay = true with train.pp = {cfg.pp} and train.recompute = "
                             f"{cfg.recompute}: the pipeline schedule interleaves micro-batches, so a recomputed "
                             "router would replay another micro-batch's experts. Fix: train.recompute: none, or pp: 1")
    provider.moe_enable_routing_replay = bool(replay)  # a replay slot per router (relax_hpc.train.routing)
    if experts % cfg.ep:
        raise PermanentError(f"train.ep = {cfg.ep} does not divide the model's {experts} experts. "
                             f"Fix: a divisor of {experts}")
    provider.expert_model_parallel_size = cfg.ep
    if not te:
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
    provider.moe_router_pre_softmax = not getattr(hf_config, "norm_topk_prob", True)
    coeff = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    coeff = coeff if getattr(hf_config, "output_router_logits", False) else 0.0
    provider.moe_aux_loss_coeff = coeff
    provider.moe_router_load_balancing_type = "aux_loss" if coeff else "none"
    provider.moe_z_loss_coeff = None
    provider.moe_expert_capacity_factor = None


def experts_apart(chunks: list) -> int:
    """Mark the routed experts' weights expert-parallel (``allreduce = False``) at EP = 1 too, as megatron-core marks
    them at EP > 1 only; returns how many. Then DDP reduces their grads over the expert data-parallel group (at EP=1 the
    same ranks as data parallelism: the same numbers) and the optimizer keeps them in its own chained optimizer at
    every EP, so a checkpoint's optimizer state has the same names whatever the EP it was saved at (else one saved at
    EP=2 does not load at EP=1: "optimizer.state.param.… not in state dict")."""
    n = 0
    for c in chunks:
        for name, p in c.named_parameters():
            if ".mlp.experts." in name:
                p.allreduce = False
                n += 1
    return n


def recompute_settings(cfg: TrainConfig) -> dict:
    """``train.recompute*`` as megatron-core's TransformerConfig fields (selective: core attention only)."""
    if cfg.recompute == "none":
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None,
                "recompute_modules": ["core_attn"]}
    return {"recompute_granularity": "full", "recompute_method": cfg.recompute_method,
            "recompute_num_layers": cfg.recompute_num_layers}


def check_recompute(cfg: TrainConfig, num_layers: int) -> None:
    """Uniform full recompute takes each pipeline stage's layers in chunks of ``recompute_num_layers``: one that does
    not divide them fails at the first step inside Megatron (IndexError, measured), so refuse it at build."""
    per_stage = num_layers // cfg.pp
    if cfg.recompute == "full" and cfg.recompute_method == "uniform" and per_stage % cfg.recompute_num_layers:
        raise PermanentError(
            f"train.recompute_num_layers = {cfg.recompute_num_layers} does not divide the {per_stage} layers of a "
            f"pipeline stage ({num_layers} layers / train.pp = {cfg.pp}), which uniform recompute takes in chunks of "
            f"that many. Fix: a divisor of {per_stage} (e.g. 1), or train.recompute_method: block")


class TorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch LayerNorm/RMSNorm) that also runs with sequence parallelism.

    ``WrappedTorchNorm`` refuses ``sequence_parallel`` (an assert at build) because its weights would then get
    the grads of this rank's part of the sequence only. Like TE's and apex's norms, this one marks its weights
    ``sequence_parallel``, so ``finalize_model_grads`` sums their grads over the TP group (without it the TP=2 tiny
    Qwen3's weights after 2 steps differ from SP off by 4e-4; with it by 0). ``persist_layer_norm`` (apex's
    persistent LayerNorm kernel, a speed hint) is ignored where ``WrappedTorchNorm`` asserts on it."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds or config.layernorm_zero_centered_gamma \
                or config.memory_efficient_layer_norm:
            raise ValueError(f"torch norms do plain LayerNorm and RMSNorm, not {config.normalization!r} with "
                             "zero-centered gamma or memory-efficient layer norm")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def torch_block_spec(config, vp_stage: int | None = None):
    """The decoder without Transformer Engine: :func:`relax_hpc.train.attention.torch_layer_spec`'s layers and
    final norm, each torch norm a :class:`TorchNorm` (the final one too, which a layer spec cannot set)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from relax_hpc.train.attention import torch_layer_spec

    layer = torch_layer_spec(config)
    sub, attn = layer.submodules, layer.submodules.self_attention.submodules
    for owner, key in ((sub, "input_layernorm"), (sub, "pre_mlp_layernorm"), (attn, "q_layernorm"),
                       (attn, "k_layernorm")):
        if getattr(owner, key, None) is WrappedTorchNorm:
            setattr(owner, key, TorchNorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=sub.input_layernorm)


@dataclass
class BuiltModel:
    bridge: object  # megatron.bridge AutoBridge (HF config/tokenizer/artifacts, name mapping)
    chunks: list  # GPTModel per virtual-pipeline chunk on this rank (one here), not yet wrapped in DDP
    hf_dir: str


def build_model(hf_dir: str | Path, cfg: TrainConfig) -> BuiltModel:
    """GPTModel with the HF weights loaded, split as ``parallel_state`` says (init_parallel first)."""
    from megatron.core import parallel_state as ps

    assert ps.model_parallel_is_initialized(), "call relax_hpc.train.parallel.init_parallel(tp, pp) first"
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())
    assert have == (cfg.tp, cfg.pp, cfg.ep), (
        f"parallel state is tp, pp, ep = {have} but train config says {cfg.tp, cfg.pp, cfg.ep}")
    from relax_hpc.train.parallel import seed_all

    seed_all(cfg.seed)  # reproducible builds; on GPU this also seeds the TP-aware CUDA RNG the init needs
    AutoBridge = import_bridge()
    bridge = AutoBridge.from_hf_pretrained(str(hf_dir))
    provider = bridge.to_megatron_provider(load_weights=True)
    on_cpu = cpu_compat.needed()
    choose_kernels(provider, cuda=not on_cpu, importable=_importable)
    provider.tensor_model_parallel_size = cfg.tp
    provider.pipeline_model_parallel_size = cfg.pp
    provider.sequence_parallel = cfg.sequence_parallel
    moe_settings(provider, bridge.hf_pretrained.config, cfg, te=_importable("transformer_engine"))
    check_recompute(cfg, provider.num_layers)
    for key, value in recompute_settings(cfg).items():
        setattr(provider, key, value)
    provider.attention_dropout = 0.0  # RL: log-probs must be deterministic; also the CPU RNG tracker needs it
    provider.hidden_dropout = 0.0
    provider.bf16 = cfg.bf16
    provider.fp16 = False
    provider.params_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    provider.pipeline_dtype = provider.params_dtype
    provider.autocast_dtype = provider.params_dtype
    provider.use_cpu_initialization = on_cpu  # also makes TP shards equal to the TP=1 init
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
    experts_apart(chunks)
    if cfg.lora is not None:  # adapters on the loaded weights, the base frozen (relax_hpc.train.lora)
        from relax_hpc.train.lora import apply_lora

        chunks = apply_lora(chunks, cfg.lora, hf_dir, seed=cfg.seed, have_te=_importable("transformer_engine"))
    if cfg.routing_replay:  # the routers keep their replay slots; megatron's class-wide list need not
        from relax_hpc.train import routing

        routing.forget_instances()
    return BuiltModel(bridge=bridge, chunks=chunks, hf_dir=str(hf_dir))


def _float16_module():
    from megatron.core.transformer.module import Float16Module

    return Float16Module


def optimizer_config(cfg: TrainConfig, params_dtype):
    """megatron-core's OptimizerConfig for ``train``: Adam (AdamW), and the optimizer offload keys under their own
    names (Relax's --optimizer-cpu-offload, --overlap-cpu-optimizer-d2h-h2d, --use-precision-aware-optimizer).
    The whole optimizer goes to the host with ``optimizer_cpu_offload`` (Megatron-LM's --optimizer-offload-fraction
    default, 1.0; megatron-core's own default, 0.0, would offload nothing). GPU only: the recipe validator refuses
    them on a CPU-only actor (:func:`relax_hpc.recipe.memory_plan.recipe_problems`)."""
    from megatron.core.optimizer import OptimizerConfig

    try:
        return OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=cfg.bf16, fp16=False, params_dtype=params_dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            use_precision_aware_optimizer=cfg.use_precision_aware_optimizer,
            optimizer_cpu_offload=cfg.optimizer_cpu_offload,
            optimizer_offload_fraction=1.0 if cfg.optimizer_cpu_offload else 0.0,
            overlap_cpu_optimizer_d2h_h2d=cfg.overlap_cpu_optimizer_d2h_h2d,
        )
    except (AssertionError, RuntimeError, TypeError) as e:  # its checks are asserts; without Transformer Engine a
        # RuntimeError, or (megatron-core 0.16.1) a TypeError from its TE version check, even with the CPU offload
        raise ValueError(f"megatron-core refuses the optimizer of train.use_precision_aware_optimizer = "
                         f"{cfg.use_precision_aware_optimizer}, train.optimizer_cpu_offload = {cfg.optimizer_cpu_offload} "
                         f"({type(e).__name__}: {e}): the precision-aware optimizer, and so the CPU offload that runs on "
                         "its code path, needs Transformer Engine on the GPU nodes. Fix: tools/install --gpu --te, or "
                         "train.use_precision_aware_optimizer: false and optimizer_cpu_offload: false") from e


def wrap_ddp_and_optimizer(chunks: list, cfg: TrainConfig):
    """Megatron DDP around each chunk and the Megatron optimizer (DistributedOptimizer when configured).

    Grads reduce in fp32; no overlap options (they use CUDA streams, and buy nothing at these sizes).
    Wires ``finalize_model_grads`` (DP all-reduce, tied-embedding grads across PP), ``no_sync`` and the
    loss scaler into the model config, as Megatron's training loop does.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
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
    optimizer = get_megatron_optimizer(optimizer_config(cfg, config.params_dtype), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model, optimizer
