"""What the Megatron roles (actor, reference, actor_fwd) share to get their model.

One builder, so the three hold the same model built the same way (the CPU settings, the parallel layout,
the sampling temperature their log-probs assume); they differ only in ``forward_only`` (no DDP wrapper,
no optimizer).
"""

from __future__ import annotations

from typing import Any


def build_megatron(recipe: Any, role: str, model_path: str, *, forward_only: bool) -> Any:
    """Every rank: Megatron's groups over the role's ranks (``train.tp``/``train.pp``/``train.ep``; for reference and
    actor_fwd, ``forward.*`` over them: :func:`~relax_hpc.train.forward_config.role_train`), then the model from
    ``model_path`` (``model.path``, resolved: :func:`relax_hpc.roles.runtime.resolve`) as a
    :class:`~relax_hpc.train.actor.MegatronActor`."""
    import torch

    from relax_hpc.train import cpu_compat
    from relax_hpc.train.actor import MegatronActor
    from relax_hpc.train.forward_config import role_train
    from relax_hpc.train.parallel import init_parallel

    cpu_compat.compile_eagerly()  # before megatron is imported (its fused ops are wrapped on import)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, recipe.role(role).cpus_per_task))
    cfg = role_train(recipe, role)  # the forward roles: their own TP/PP and token budget (recipe.forward)
    init_parallel(cfg.tp, cfg.pp, seed=cfg.seed, ep=cfg.ep)
    temperature = recipe.rollout.temperature if recipe.rollout.temperature > 1e-6 else 1.0  # greedy: the engine uses T=1
    return MegatronActor.from_hf(model_path, cfg, recipe.algorithm, temperature=temperature,
                                 forward_only=forward_only, opd=recipe.opd,
                                 freeze_vision=recipe.model.freeze_vision, freeze_audio=recipe.model.freeze_audio)
