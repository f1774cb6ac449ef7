"""Megatron's tensor/pipeline/data-parallel groups on top of a default process group someone else made.

The role bootstrap (Slurm/MPI or the local launcher) owns ``torch.distributed.init_process_group``;
this module only carves the world into TP × PP × DP with ``initialize_model_parallel`` (order
tp-cp-ep-dp-pp: TP ranks are adjacent) and applies the CPU compatibility layer when there is no GPU.
Expert parallelism (EP, mixture-of-experts models) is carved out of data parallelism, as Megatron does: the experts
are split over EP groups of ``ep`` data-parallel ranks (expert tensor parallelism = TP), everything else stays as
TP × PP × DP lays it out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from relax_hpc.train import cpu_compat


@dataclass(frozen=True)
class ParallelInfo:
    world: int
    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1
    ep_rank: int = 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_parallel(tp: int = 1, pp: int = 1, seed: int | None = None, ep: int = 1) -> ParallelInfo:
    """Initialise Megatron model parallelism (tp, pp; dp = world / (tp·pp); ep experts' shards over dp ranks) on the
    existing default group.

    Idempotent for the same sizes; raises if already initialised with others (call :func:`destroy_parallel`).
    On a machine without CUDA it first applies :mod:`relax_hpc.train.cpu_compat`.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: the role bootstrap must call "
                           f"init_process_group({cpu_compat.backend()!r}) before init_parallel")
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"train.tp × train.pp = {tp}×{pp} does not divide the world size {world}")
    dp = world // (tp * pp)
    if ep < 1 or dp % ep:
        raise ValueError(f"train.ep = {ep} does not divide the data-parallel size {dp} (world {world} / "
                         f"(train.tp × train.pp = {tp}×{pp})), which Megatron splits the experts over. "
                         f"Fix: a divisor of {dp}")
    cpu_compat.apply()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise RuntimeError(f"model parallel already initialised with tp, pp, ep = {have}, asked {tp, pp, ep}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        cpu_compat.after_model_parallel()
    if seed is not None:
        seed_all(seed)
    return info()


def destroy_parallel() -> None:
    """Undo :func:`init_parallel` (the default process group stays): lets one process try several layouts."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def info() -> ParallelInfo:
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        world=dist.get_world_size(), rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
    )


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch the same on every rank; on GPU also Megatron's TP-aware CUDA RNG."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if not cpu_compat.needed():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
