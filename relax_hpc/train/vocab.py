"""Per-token log-probs (and entropy) from vocab-parallel logits: the one place of that math, for the forward passes
(:mod:`.logprobs`, which re-exports it) and the vision-language models' (:mod:`.vlm`).

Why our own vocab-parallel math instead of ``tensor_parallel.vocab_parallel_cross_entropy``: that kernel
overwrites its input in place (fine for a loss, wrong when entropy is taken from the same logits) and
gives no entropy. Here log p and the entropy share one max/sum-exp; the only collectives are
all-reduces over the TP group (max without grad; sums through ``reduce_from_tensor_model_parallel_region``,
whose backward is the identity, which is the exact gradient of a sum of per-rank partial sums).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False,
                            entropy_grad: bool = True):
    """log p(target) and optionally the entropy, for logits ``[..., V/tp]`` sharded over the TP group.

    Returns (log_probs [...], entropy [...] or None), in float32; log-probs are differentiable, the
    entropy too unless ``entropy_grad`` is False (a metric only: no graph kept for it).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as tp_sum

    logits = logits.float()
    tp = ps.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    lo = ps.get_tensor_model_parallel_rank() * part
    m = logits.detach().amax(dim=-1)
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - m.unsqueeze(-1)
    e = z.exp()
    sum_e = tp_sum(e.sum(dim=-1))
    local = targets - lo
    inside = (local >= 0) & (local < part)
    z_t = z.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * inside
    log_z = sum_e.log()
    log_probs = tp_sum(z_t) - log_z
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = log_z - tp_sum((e * z).sum(dim=-1)) / sum_e
    return log_probs, entropy
