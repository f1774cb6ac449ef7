"""Megatron-core training backend of the actor (and the forward-only reference/actor_fwd roles).

Importing this package is cheap: ``config`` is pure Python (the recipe validator uses it on login nodes)
and everything that imports megatron (4-5 s) is loaded on first use of a name below.

Modules, one job each:
  config      the recipe's ``train:`` section and its checks
  cpu_compat  the CPU-only compatibility layer (gloo, torch.cuda calls, RNG tracker, optimizer/bridge fixes)
  parallel    init_parallel(tp, pp) on an existing default process group; rank/group helpers
  model       HF dir -> megatron-bridge -> GPTModel (+ Megatron DDP, optimizer); transformer_engine stub
  samples     rollout samples <-> chunk files <-> columns (both sides of the exchange)
  plan        the trainer's data plan: columns -> checked, normalized TrainingSamples, mini-batches, DP shares
  build       build_megatron: the model every Megatron role (actor, reference, actor_fwd) builds alike
  batch       TrainingSample -> padded micro-batch tensors, and back
  logprobs    vocab-parallel per-token log-probs and entropy; forward-only log-probs
  step        one optimizer step with the policy loss from relax_hpc.algo
  checkpoint  dist_checkpointing save/load (model, optimizer, RNG, step, extra state; ``latest`` last)
  export      HF export and full-weight iteration through megatron-bridge
  actor       MegatronActor: the object roles use
"""

from relax_hpc.train.config import TrainConfig, check

__all__ = ["MegatronActor", "TrainConfig", "check", "init_parallel"]


def __getattr__(name):  # lazy: keep `import relax_hpc.train` free of megatron
    if name == "MegatronActor":
        from relax_hpc.train.actor import MegatronActor
        return MegatronActor
    if name == "init_parallel":
        from relax_hpc.train.parallel import init_parallel
        return init_parallel
    raise AttributeError(name)
