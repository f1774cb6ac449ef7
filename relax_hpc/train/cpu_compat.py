"""Everything megatron-core 0.16.1 / megatron-bridge 0.3.1 need to run on a machine with no GPU. One module.

Applied only when ``torch.cuda.is_available()`` is False (CI, laptops); on a GPU nothing here runs
and the GPU code paths stay exactly as upstream wrote them. The facts behind each fix are measured in
``/work/shared/reference/ml-cpu-notes.md`` (§1, §3, appendix A); in short:

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
  (:func:`_patch_recompute_rng`). Sequence parallelism needs nothing here: torch 2.13's gloo has the
  ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` it uses (TP=2 with SP trains to the same numbers as
  without, tests/train/test_memory.py);
* four DistributedOptimizer bugs on the torch-Adam path (no apex/TE, so every CPU run hits them;
  one of them silently resumes with the wrong Adam bias correction) — :func:`_patch_distributed_optimizer`;
* megatron-bridge's TP scatter hands non-contiguous views to gloo ``scatter``, which ignores strides and
  silently loads wrong ``o_proj``/``down_proj`` shards at TP>1 — :func:`patch_bridge`.
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


def apply() -> bool:
    """Install the CPU layer once per process (no-op on a GPU machine). Returns whether it is active.

    Call before building models or optimizers; :func:`relax_hpc.train.parallel.init_parallel` does.
    """
    global _applied, _mode
    if not needed():
        _patch_distributed_optimizer(only_without_apex_or_te=True)
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
        _patch_distributed_optimizer(only_without_apex_or_te=False)
        _applied = True
        return True


def after_model_parallel() -> None:
    """After ``initialize_model_parallel``: a tracker whose ``fork()`` does nothing (CUDA RNG unusable here)."""
    if not needed():
        return
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def patch_bridge() -> None:
    """Make megatron-bridge's TP scatter send contiguous shards (gloo scatter ignores strides). CPU only."""
    global _bridge_patched
    if not needed() or _bridge_patched:
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


def _patch_recompute_rng() -> None:
    """Megatron's activation recompute (``CheckpointFunction``, any ``train.recompute``) saves and restores the CUDA
    RNG through ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state``, which call
    ``torch.cuda.random.get_rng_state`` ("Torch not compiled with CUDA enabled" at the first recomputed forward) and
    queue a ``torch.cuda`` lazy call per backward. There is no CUDA RNG here: the stand-ins hand back the CPU state
    and set nothing (``CheckpointFunction`` restores the CPU state itself, and dropout is 0)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None


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
