"""Everything megatron-core 0.16.1 / megatron-bridge 0.3.1 need to run on a machine with no GPU. One module.

Applied only when ``torch.cuda.is_available()`` is False (CI, laptops); on a GPU nothing here runs
and the GPU code paths stay exactly as upstream wrote them. The facts behind each fix, in
short:

* collectives: gloo instead of NCCL (:func:`backend`);
* ``torch.cuda.current_device()`` is called on every forward (rotary embedding, the attention memory
  buffer, DDP buffers) and ``device="cuda"`` / ``.cuda()`` / ``Tensor.type() == "torch.cuda.FloatTensor"``
  appear all over the optimizer and grad-clipping code: a process-wide ``TorchFunctionMode`` sends
  them to the CPU (:class:`_CudaToCpu`), and ``torch.cuda.current_device``/``synchronize``/``get_rng_state``
  get CPU stand-ins, and ``torch.cuda.nvtx`` ranges (Qwen3-VL's forward marks them) do nothing;
* the attention always enters ``get_cuda_rng_tracker().fork()``, whose CUDA RNG cannot be seeded here:
  an "inference" tracker whose ``fork()`` is a no-op (valid because dropout is 0 in RL training,
  which :mod:`relax_hpc.train.model` enforces) — :func:`after_model_parallel`;
* activation recompute saves and restores the CUDA RNG state around every recomputed chunk: CPU stand-ins
  (:func:`_patch_recompute_rng`); the unfused RoPE of packed sequences (GPUs run TE's fused kernel) slices the
  frequencies per sequence in Python: one gather instead (:func:`_patch_rope_thd`, the same numbers). Sequence
  parallelism needs nothing here: torch 2.13's gloo has the ``reduce_scatter_tensor`` and
  ``all_gather_into_tensor`` it uses (TP=2 with SP trains to the same numbers as without,
  tests/train/test_memory.py);
* Megatron's fused ops are ``torch.compile``'d at import; on a CPU they run as written (:func:`compile_eagerly`);
* four DistributedOptimizer bugs on the torch-Adam path (no apex/TE, so every CPU run hits them;
  one of them silently resumes with the wrong Adam bias correction) — :func:`_patch_distributed_optimizer`;
* megatron-bridge's TP scatter hands non-contiguous views to gloo ``scatter``, which ignores strides and
  silently loads wrong ``o_proj``/``down_proj`` shards at TP>1 — :func:`patch_bridge`;
* mixture-of-experts: the all-to-all token dispatcher makes a ``torch.cuda.Stream`` at build and copies its split
  sizes to the host on it every forward — :func:`_patch_moe_dispatcher`; and without Transformer Engine (GPU too)
  the router's gating linear reads a ``te_general_gemm`` that megatron-core never defines — :func:`_patch_moe_router`;
  megatron-bridge maps the experts of megatron-core's ``SequentialMLP`` (the no-TE experts) to the wrong HF experts
  at expert parallelism > 1, and cannot export them — :func:`_patch_bridge_sequential_experts` (GPU without TE too).
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_applied = False
_bridge_patched = False
_mode: TorchFunctionMode | None = None


def needed() -> bool:
    """True on a machine without a usable GPU: the only case in which this module changes anything."""
    return not torch.cuda.is_available()


def backend() -> str:
    """The torch.distributed backend for this machine (gloo on CPU, NCCL on GPU)."""
    return "gloo" if needed() else "nccl"


def device() -> torch.device:
    """Where model tensors live: the current CUDA device, or the CPU."""
    return torch.device("cpu") if needed() else torch.device("cuda", torch.cuda.current_device())


def _is_cuda(d) -> bool:
    return (isinstance(d, str) and d.startswith("cuda")) or (isinstance(d, torch.device) and d.type == "cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements to CPU: ``device="cuda"`` kwargs, ``Tensor.cuda()``, ``Tensor.to("cuda")``,
    and makes ``Tensor.type()`` report ``torch.cuda.*`` so megatron's dtype checks accept CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            s = func(*args)
            return s if s.startswith("torch.cuda.") else s.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _eager(model=None, **_):
    return model if model is not None else (lambda fn: fn)


def compile_eagerly() -> None:
    """On a CPU, ``torch.compile`` returns what it is given, and dynamo is off. Call before megatron is imported.

    Megatron wraps its fused ops in ``torch.compile`` (``megatron.core.jit.jit_fuser``) when its modules are
    imported; on a CPU compiling them costs ~20 s of C++ at the first step and gains nothing at the sizes a CPU
    trains, so dynamo is disabled and they run eagerly. Eagerly is what they do with dynamo off, but wrapping them
    still imports inductor: 0.8 CPU-s of every Megatron process's start (1.7 s of ``import megatron.core``'s 4.4)."""
    if not needed():
        return
    torch.compile = _eager
    from torch import _dynamo

    _dynamo.config.disable = True  # what is compiled another way (torch._dynamo.optimize) runs eagerly too


def apply() -> bool:
    """Install the CPU layer once per process (no-op on a GPU machine). Returns whether it is active.

    Call before building models or optimizers; :func:`relax_hpc.train.parallel.init_parallel` does.
    """
    global _applied, _mode
    if not needed():
        _patch_distributed_optimizer(only_without_apex_or_te=True)
        _patch_moe_router()
        return False
    with _lock:
        if _applied:
            return True
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # bridge/Megatron checkpoint RNG
        torch.cuda.set_rng_state = lambda state, device="cuda": None
        torch.cuda.nvtx.range_push = lambda *a, **k: None  # else "NVTX functions not installed"
        torch.cuda.nvtx.range_pop = lambda *a, **k: None
        _mode = _CudaToCpu()
        _mode.__enter__()  # process-wide, for good: megatron calls these at any time
        _patch_recompute_rng()
        _patch_rope_thd()
        _patch_distributed_optimizer(only_without_apex_or_te=False)
        _patch_moe_dispatcher()
        _patch_moe_router()
        _applied = True
        return True


def after_model_parallel() -> None:
    """After ``initialize_model_parallel``: a tracker whose ``fork()`` does nothing (CUDA RNG unusable here)."""
    if not needed():
        return
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def patch_bridge() -> None:
    """Make megatron-bridge's TP scatter send contiguous shards (gloo scatter ignores strides; CPU only), and number
    ``SequentialMLP`` experts globally (any machine: only names of the no-TE experts are touched)."""
    global _bridge_patched
    if _bridge_patched:
        return
    _patch_bridge_sequential_experts()
    if not needed():
        _bridge_patched = True
        return
    from megatron.bridge.models.conversion import param_mapping as pm

    orig = pm.MegatronParamMapping.scatter_to_tp_ranks

    @functools.wraps(orig)
    def scatter_to_tp_ranks(self, splits, output_shape, dtype, device, src_rank=0):
        if splits:
            splits = [s.contiguous() for s in splits]
        return orig(self, splits, output_shape, dtype, device, src_rank)

    pm.MegatronParamMapping.scatter_to_tp_ranks = scatter_to_tp_ranks
    _bridge_patched = True


def _patch_bridge_sequential_experts() -> None:
    """megatron-bridge 0.3.1 numbers the experts globally only in TEGroupedMLP's names
    (``experts.linear_fc1.weight<G>``). megatron-core's ``SequentialMLP``, the experts built without TE
    (``experts.local_experts.<L>.linear_fc1.weight``), keeps the local number L: at expert parallelism > 1 each EP
    rank's local expert L loaded HF expert L (measured on the tiny Qwen3-MoE at EP=2: logits off by 0.07), and the
    export failed reading an expert number after ``.weight`` (ValueError). Here the name's expert number becomes the
    global one, ep_rank · experts/ep + L, as for grouped experts: the names sort by it (the bridge pairs EP ranks'
    tensors by position in that order), loading finds the HF expert by it, and the export gathers each local expert
    from every EP rank under its HF names."""
    import re

    from megatron.bridge.models.conversion import model_bridge as mb
    from megatron.bridge.models.conversion import param_mapping as pm
    from megatron.core import parallel_state as ps

    local = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
    to_global_orig, sort_key_orig = mb._megatron_local_name_to_global, mb.extract_sort_key

    @functools.wraps(to_global_orig)
    def to_global(models, config, param_name, vp_stage=None):
        name = to_global_orig(models, config, param_name, vp_stage)
        m = local.search(name)
        ep = ps.get_expert_model_parallel_world_size()
        if m is None or ep == 1 or ".adapter." in name:
            return name
        g = config.num_moe_experts // ep * ps.get_expert_model_parallel_rank() + int(m.group(1))
        return f"{name[:m.start()]}.mlp.experts.local_experts.{g}.{name[m.end():]}"

    @functools.wraps(sort_key_orig)
    def sort_key(param_name):  # layer, then expert as a number (the name alone puts expert 10 before 2)
        m = local.search(param_name)
        if m is None:
            return sort_key_orig(param_name)
        numbers, _ = sort_key_orig(param_name)
        return [numbers[0], int(m.group(1))], param_name

    gather_orig = pm.MegatronParamMapping.gather_from_ep_ranks

    @functools.wraps(gather_orig)
    def gather_from_ep_ranks(self, megatron_weights, megatron_module, hf_param_name):
        m = local.search(self.megatron_param)
        if m is None:
            return gather_orig(self, megatron_weights, megatron_module, hf_param_name)
        # upstream's, with the expert number read from local_experts.<G>
        per_rank = None
        if megatron_module is not None:
            per_rank = self._get_config(megatron_module).num_moe_experts // self.ep_size
        per_rank = self.broadcast_obj_from_pp_rank(per_rank, "num_experts_per_rank")
        first = int(m.group(1)) % per_rank
        names = [re.sub(r"experts\.(\d+)", f"experts.{first + per_rank * i}", str(hf_param_name))
                 for i in range(self.ep_size)]
        gathered = [torch.empty_like(megatron_weights) for _ in range(self.ep_size)]
        torch.distributed.all_gather(gathered, megatron_weights.contiguous(), group=self.ep_group)
        return dict(zip(names, gathered))

    mb._megatron_local_name_to_global = to_global
    mb.extract_sort_key = sort_key
    pm.MegatronParamMapping.gather_from_ep_ranks = gather_from_ep_ranks


def _patch_rope_thd() -> None:
    """Megatron's unfused RoPE of packed (``thd``) sequences slices the frequencies once per sequence in Python (GPUs
    run TE's fused kernel instead): 8 torch calls per sample per layer, 14,080 for the 1,760 one-token answers of
    the quickstart's step. Each sequence takes ``freqs[0:len]``, so the concatenation is ``freqs`` indexed by each
    token's position within its sequence: one gather, the same numbers. Context parallelism and the frequencies laid
    out over the whole pack (``freqs.size(0) == cu_seqlens[-1]``) keep megatron's own loop."""
    from megatron.core.models.common.embeddings import rope_utils

    orig = rope_utils._apply_rotary_pos_emb_thd
    if getattr(orig, "_relax", False):
        return

    @functools.wraps(orig)
    def thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None):
        if cp_group is None or cp_group.size() != 1 or (freqs.dim() >= 1 and freqs.size(0) == t.size(0)):
            return orig(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                        multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        pos = getattr(cu_seqlens, "_relax_positions", None)  # once per micro-batch (q and k of every layer)
        if pos is None:
            lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lens)
            pos = cu_seqlens._relax_positions = torch.arange(starts.numel(), device=t.device) - starts
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[pos], rotary_interleaved=rotary_interleaved,
                                                     multi_latent_attention=multi_latent_attention,
                                                     mscale=mscale).squeeze(1)

    thd._relax = True
    rope_utils._apply_rotary_pos_emb_thd = thd


def _patch_recompute_rng() -> None:
    """Megatron's activation recompute (``CheckpointFunction``, any ``train.recompute``) saves and restores the CUDA
    RNG through ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state``, which call
    ``torch.cuda.random.get_rng_state`` ("Torch not compiled with CUDA enabled" at the first recomputed forward) and
    queue a ``torch.cuda`` lazy call per backward. There is no CUDA RNG here: the stand-ins hand back the CPU state
    and set nothing (``CheckpointFunction`` restores the CPU state itself, and dropout is 0)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None


def _patch_moe_router() -> None:
    """megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` from TE and, where that import fails, defines
    nothing, so the router's ``RouterGatingLinearFunction`` fails with a NameError at its first forward on any machine
    without TE. ``None`` is what its test means: the plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_moe_dispatcher() -> None:
    """megatron-core's ``MoEAlltoAllTokenDispatcher`` (the one Qwen3-MoE's provider asks for, and the one that takes
    a different token count on each expert-parallel rank) builds a class-wide ``torch.cuda.Stream`` for its
    device-to-host copies, and in ``_maybe_dtoh_and_synchronize`` copies the all-to-all split sizes to the host as
    numpy arrays on that stream and waits on an event. Here everything is on the host already: the stand-in makes
    only the numpy conversion (what the rest of the dispatcher then sees on a GPU too) and waits on nothing."""
    from megatron.core.transformer.moe import token_dispatcher as td

    D = td.MoEAlltoAllTokenDispatcher
    D.cuda_dtoh_stream = "cpu"  # __init__ makes a torch.cuda.Stream only while this is None

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                t = getattr(self, name, None)
                if torch.is_tensor(t):
                    setattr(self, name, t.numpy())
        return tokens_per_expert

    D._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize


_distopt_patched = False


def _patch_distributed_optimizer(only_without_apex_or_te: bool) -> None:
    """Fix megatron-core 0.16.1 DistributedOptimizer bugs that appear with plain torch Adam (no apex/TE).

    On a GPU with TE or apex installed upstream takes another path and nothing is patched; on a GPU
    *without* them the same bugs exist (one is a silent wrong resume), so the fixes apply there too.
    1. ``state_dict()`` asserts one ``step`` over an empty Adam state (fresh optimizer, before any step or
       before a load): fill the state with step 0 and zero moments first — what Adam would create itself.
    2. the dp_reshardable load copies into views of leaf params that require grad: load under no_grad.
    3. the fully_reshardable load copies every Adam key including ``step``, which the source lacks: skip it.
    4. the load gives every param the *same* ``step`` tensor, which Adam then bumps once per param per
       step (wrong bias correction after resume): give each param its own copy.
    """
    global _distopt_patched
    if _distopt_patched:
        return
    from megatron.core.optimizer import distrib_optimizer as dopt

    if only_without_apex_or_te and dopt.HAVE_APEX_OR_TE:
        return
    DO = dopt.DistributedOptimizer

    def fill_empty_adam_state(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state[p]
                if len(st) == 0:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    orig_sharded = DO.sharded_state_dict

    @functools.wraps(orig_sharded)
    def sharded_state_dict(self, *args, **kwargs):  # fix 1
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            fill_empty_adam_state(self)
        return orig_sharded(self, *args, **kwargs)

    orig_state_dict = DO.state_dict

    @functools.wraps(orig_state_dict)
    def state_dict(self):  # fix 1 (non-sharded path)
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            fill_empty_adam_state(self)
        return orig_state_dict(self)

    orig_load = DO.load_state_dict

    @functools.wraps(orig_load)
    def load_state_dict(self, state_dict):  # fixes 2 and 4
        with torch.no_grad():
            orig_load(self, state_dict)
        for st in self.optimizer.state.values():
            if "step" in st and torch.is_tensor(st["step"]):
                st["step"] = st["step"].clone()

    orig_set = DO._set_main_param_and_optimizer_states

    @functools.wraps(orig_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):  # fix 3
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or "step" in tensors:
            return orig_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, t in dst.items():
            if key != "step":
                t.copy_(tensors[key])

    DO.sharded_state_dict = sharded_state_dict
    DO.state_dict = state_dict
    DO.load_state_dict = load_state_dict
    DO._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    _distopt_patched = True
