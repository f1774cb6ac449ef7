"""Core attention for the pure-torch layer spec (no Transformer Engine): torch's SDPA, padded or packed.

Why: megatron-core's local ``DotProductAttention`` builds the S×S scores in memory and runs an eager (or
apex-fused) softmax; on a GPU without Transformer Engine that is the actor's slowest part, and it refuses packed
sequences. ``torch.nn.functional.scaled_dot_product_attention`` runs the flash or memory-efficient kernels on CUDA
and the math kernel on CPU, with the same numbers as the unfused path (to fp32 rounding).

Two layouts, as Megatron's attention hands them over:

* ``sbhd`` (padded micro-batches): q ``[s, b, np, hn]``, k/v ``[s, b, ng, hn]`` → ``[s, b, np·hn]``; causal.
* ``thd`` (packed micro-batches, ``packed_seq_params.qkv_format == "thd"``): q ``[t, np, hn]``, k/v
  ``[t, ng, hn]`` with ``cu_seqlens`` the sample boundaries → ``[t, np, hn]``; causal inside each sample, no
  attention across samples. The samples of one length are one batched SDPA call: on CUDA flash kernels, with no
  mask tensor and no padding.

GQA: SDPA's ``enable_gqa`` (the flash and math kernels take it; with it k/v are not copied per query head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's local GPT layer spec (same constructor and forward)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not do context parallelism (context_parallel_size must be 1)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise ValueError("SDPAttention does the vanilla softmax without a sliding window only")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SDPAttention has no dropout (attention_dropout = {dropout}); RL training sets 0")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPAttention is causal only, got attn_mask_type = {attn_mask_type}")
        if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        # apply_query_key_layer_scaling is an fp16 overflow guard that megatron's own attention undoes in its softmax
        # (scale / layer_number, then × layer_number): the attention is softmax(q·k / sqrt(d)) either way
        self.scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal SDPA over [batch, heads, len, dim]; k/v keep their query groups (``enable_gqa``): no repeated
        copies of k and v held for the backward."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=self.heads != self.groups)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        if attention_mask is not None:
            raise ValueError("SDPAttention is causal with right padding only: no attention_mask")
        s, b = query.shape[0], query.shape[1]
        out = self._sdpa(*(t.permute(1, 2, 0, 3) for t in (query, key, value)))  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, np·hn]

    def _packed(self, query, key, value, params):
        plan = getattr(params, "_relax_plan", None)
        if plan is None:  # once per micro-batch, not per layer
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            plan = params._relax_plan = _PackedPlan(cu.tolist(), query.device)
        if plan.bounds[0] != 0 or plan.bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens {plan.bounds[0]}..{plan.bounds[-1]} do not cover the {query.shape[0]} "
                             "packed tokens")
        outs = []
        for m, n, idx in plan.groups:  # m samples of n tokens: one gather of their tokens, one SDPA call
            q, k, v = (t.index_select(0, idx).unflatten(0, (m, n)).transpose(1, 2) for t in (query, key, value))
            outs.append(self._sdpa(q, k, v).transpose(1, 2).flatten(0, 1))  # [m·n, np, hn]
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out if plan.inverse is None else out.index_select(0, plan.inverse)  # [t, np, hn]: Megatron makes
        # it [t, 1, np·hn]


class _PackedPlan:
    """How a packed micro-batch's samples go through SDPA: the samples of one length are one batched call (RL groups
    share prompts, and short answers repeat), still with no mask and no padding. Each length's tokens are gathered by
    one index (``groups``: samples, length, token index) and the outputs put back in token order by one more
    (``inverse``; None when the groups' order is the tokens' own). A gather is one op and one backward op where a
    slice per sample was one each per sample and layer (1,760 samples of the quickstart's step: 10,560 slices)."""

    def __init__(self, bounds: list[int], device):
        self.bounds = bounds
        by_len: dict[int, list[int]] = {}
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                by_len.setdefault(hi - lo, []).append(lo)
        order: list[int] = []
        self.groups = []
        for n, starts in by_len.items():
            idx = [lo + j for lo in starts for j in range(n)]
            order += idx
            self.groups.append((len(starts), n, torch.tensor(idx, dtype=torch.long, device=device)))
        if order == list(range(len(order))):
            self.inverse = None
        else:
            inverse = [0] * len(order)
            for pos, i in enumerate(order):
                inverse[i] = pos
            self.inverse = torch.tensor(inverse, dtype=torch.long, device=device)


def torch_layer_spec(config):
    """megatron-bridge's local (no-TE) GPT layer spec with :class:`SDPAttention` as the core attention."""
    import copy

    from megatron.bridge.models.gpt_provider import local_layer_spec

    spec = copy.deepcopy(local_layer_spec(config))
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
