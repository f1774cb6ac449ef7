"""Per-token log-probs (and entropy) of response tokens from the model's vocab-parallel logits
(:func:`~relax_hpc.train.vocab.vocab_parallel_logprobs`), and the forward passes.

:func:`run_forward` drives Megatron's ``forward_backward_func`` (1F1B when PP > 1) over micro-batches
for both the forward-only pass (old/reference log-probs) and the training pass (:mod:`.step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist

from relax_hpc.train import batch as B
from relax_hpc.train import cpu_compat, omni, routing, vlm
from relax_hpc.train.vocab import vocab_parallel_logprobs  # noqa: F401  (callers import it here)


def response_logprobs(output: torch.Tensor, mb: B.MicroBatch, *, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = True):
    """From the model output ``[B, S, V/tp]``: log-probs (and entropy) ``[n_real, T]`` of the response tokens."""
    idx = mb.logit_index.to(output.device)
    flat = output.reshape(-1, output.shape[-1])  # [B·S, V/tp]: padded rows or one packed row alike
    picked = flat[idx.reshape(-1)].reshape(*idx.shape, flat.shape[-1])
    if temperature != 1.0:
        picked = picked / temperature
    lp, ent = vocab_parallel_logprobs(picked, mb.targets.to(output.device), with_entropy=with_entropy,
                                      entropy_grad=entropy_grad)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    valid = mb.valid.to(output.device)
    lp = torch.where(valid, lp, zero)
    if ent is not None:
        ent = torch.where(valid, ent, zero)
    return lp, ent


_on_micro_batch: Callable[[], None] | None = None


def set_progress_hook(fn: Callable[[], None] | None) -> None:
    """Call ``fn`` before each micro-batch's forward: a role passes ``ctx.progress`` so a long train step or
    log-prob pass keeps showing progress (``logging.task_timeout_s`` restarts a role whose task does not)."""
    global _on_micro_batch
    _on_micro_batch = fn


def _forward_step(loss_fn: Callable, data_iterator, model):
    mb = next(data_iterator)
    if _on_micro_batch is not None:
        _on_micro_batch()
    dev = next(model.parameters()).device
    routing.replay(model, mb.routed_experts, mb.tokens.shape[0])  # MoE routing replay: the engine's experts, or off
    if vlm.is_vlm_model(model):  # keyword call, the images in; the model makes its M-RoPE positions itself
        out = vlm.vlm_forward(model, mb.tokens, mb.pixel_values, mb.image_grid_thw, image_limits=mb.image_limits or [],
                              image_counts=mb.image_counts, pixel_values_videos=mb.pixel_values_videos,
                              video_grid_thw=mb.video_grid_thw)
    elif omni.is_omni_model(model):  # the audio tower's embeddings at the audio pads (relax_hpc.train.omni)
        out = omni.omni_forward(model, mb.tokens, mb.input_features, mb.audio_feature_lens,
                                audio_limits=mb.audio_limits or [])
    elif mb.packed is None:
        out = model(mb.tokens.to(dev), mb.position_ids.to(dev), None)
    else:
        out = model(mb.tokens.to(dev), mb.position_ids.to(dev), None, packed_seq_params=_on(mb.packed, dev))
    return out, partial(loss_fn, mb)


def _on(params, dev):
    """PackedSeqParams as the attention wants them: Transformer Engine's kernels read the boundaries on the GPU;
    the pure-torch path (SDPAttention, megatron's unfused RoPE) reads them as Python ints, free from host memory
    and a device sync per layer from the GPU's."""
    from dataclasses import replace

    from relax_hpc.train.model import te_available

    if not te_available():
        return params
    return replace(params, cu_seqlens_q=params.cu_seqlens_q.to(dev), cu_seqlens_kv=params.cu_seqlens_kv.to(dev))


def plan_micro_batches(samples: Sequence, mbs: int, *, pad_id: int, train: bool, pp: int,
                       max_seq_len: int | None, global_seq_len: int, max_tokens: int | None = None,
                       multiple: int = 1) -> list[B.MicroBatch]:
    """Split this rank's samples into micro-batches: ``mbs`` samples each, padded (with PP every one gets the same
    [mbs, global_seq_len] shape), or with ``max_tokens`` packed by token count (with PP every one gets the same
    [1, max_tokens] shape). ``multiple``: lengths rounded up to it (TP size under sequence parallelism).
    Each micro-batch's ``index`` says which of ``samples`` it holds."""
    if max_tokens is not None:
        groups = B.pack([B.tokens_of(s).numel() for s in samples], max_tokens)
        out = []
        for g in groups:
            mb = B.make_packed_micro_batch([samples[i] for i in g], pad_id=pad_id, train=train,
                                           seq_len=max_tokens if pp > 1 else None, max_seq_len=max_seq_len,
                                           multiple=multiple)
            mb.index = g
            out.append(mb)
        return out
    out, start = [], 0
    for g in B.chunks(samples, mbs):
        if pp > 1:
            mb = B.make_micro_batch(g, pad_id=pad_id, train=train, seq_len=global_seq_len, rows=mbs,
                                    max_seq_len=max_seq_len, multiple=multiple)
        else:
            mb = B.make_micro_batch(g, pad_id=pad_id, train=train, max_seq_len=max_seq_len, multiple=multiple)
        mb.index = list(range(start, start + len(g)))
        start += len(g)
        out.append(mb)
    return out


def seq_multiple(model: list) -> int:
    """What every micro-batch's length must be a multiple of: the TP size under sequence parallelism, else 1."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    return ps.get_tensor_model_parallel_world_size() if get_model_config(model[0]).sequence_parallel else 1


def run_forward(model: list, micro_batches: list[B.MicroBatch], loss_fn: Callable, *, forward_only: bool) -> list:
    """Run ``forward_backward_func`` over the micro-batches; returns ``loss_fn``'s dicts (last stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mb0 = micro_batches[0]
    fb = get_forward_backward_func()
    return fb(
        forward_step_func=partial(_forward_step, loss_fn),
        data_iterator=iter(micro_batches) if len(model) == 1 else [iter(micro_batches) for _ in model],
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=mb0.tokens.shape[1],
        micro_batch_size=mb0.tokens.shape[0],
        forward_only=forward_only,
    )


def _forward_log_probs(model: list, samples: Sequence, *, mbs: int, pad_id: int, temperature: float,
                       max_seq_len: int | None, rows: int, T: int, global_seq_len: int,
                       max_tokens: int | None) -> torch.Tensor:
    """Forward-only log-probs of ``samples`` (this DP rank's) as ``[rows, T]`` on every stage of the pipeline."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    out = torch.zeros(rows, T, dtype=torch.float32, device=cpu_compat.device())  # NCCL needs device tensors
    if samples:
        mbs_list = plan_micro_batches(samples, mbs, pad_id=pad_id, train=False, pp=pp, max_seq_len=max_seq_len,
                                      global_seq_len=global_seq_len, max_tokens=max_tokens,
                                      multiple=seq_multiple(model))

        def loss_fn(mb, output):
            lp, _ = response_logprobs(output, mb, temperature=temperature)
            return lp.sum() * 0.0, {"log_probs": lp.detach().cpu()}

        for m in model:
            m.eval()
        with torch.no_grad():
            results = run_forward(model, mbs_list, loss_fn, forward_only=True)
        for m in model:
            m.train()
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for mb, res in zip(mbs_list, results):
                lp = res["log_probs"]
                out[mb.index, : lp.shape[1]] = lp.to(out.device)
    if pp > 1:
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast(out, src=src, group=ps.get_pipeline_model_parallel_group())
    return out


def compute_log_probs(model: list, samples: Sequence, *, mbs: int, pad_id: int, temperature: float = 1.0,
                      max_seq_len: int | None = None, share: bool = False,
                      max_tokens: int | None = None) -> list[torch.Tensor]:
    """Forward-only response log-probs, one ``[R_i]`` tensor per sample, in the order of ``samples``.

    ``share=False``: ``samples`` is the global batch (the same on every rank); each DP rank computes its
    share and the results are gathered over DP, so every rank gets all of them whatever the layout.
    ``share=True``: ``samples`` is this DP rank's share (the actor's π_old): no gather, each rank keeps its own.
    Either way the last pipeline stage's results are broadcast to the other stages.
    """
    from megatron.core import parallel_state as ps

    lens = [B.response_bounds(s)[1] for s in samples]
    if share:
        if not samples:
            return []
        out = _forward_log_probs(model, samples, mbs=mbs, pad_id=pad_id, temperature=temperature,
                                 max_seq_len=max_seq_len, rows=len(samples), T=max(lens),
                                 global_seq_len=max(B.tokens_of(s).numel() for s in samples), max_tokens=max_tokens)
        return [row[:n].cpu().clone() for row, n in zip(out, lens)]
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = B.dp_shard(samples, dp, dp_rank)
    out = _forward_log_probs(model, mine, mbs=mbs, pad_id=pad_id, temperature=temperature, max_seq_len=max_seq_len,
                             rows=-(-len(samples) // dp), T=max(lens),
                             global_seq_len=max(B.tokens_of(s).numel() for s in samples), max_tokens=max_tokens)
    if dp > 1:
        gathered = [torch.empty_like(out) for _ in range(dp)]
        dist.all_gather(gathered, out, group=ps.get_data_parallel_group())
    else:
        gathered = [out]
    rows = []
    for r in range(dp):
        n = len(B.dp_shard(samples, dp, r))
        rows.extend(gathered[r][:n].cpu())
    return [row[:n].clone() for row, n in zip(rows, lens)]


def rollout_logprob_gap(samples: Sequence, log_probs: Sequence[torch.Tensor]) -> dict[str, float]:
    """``train/train_rollout_logprob_abs_diff_max``: the largest |actor − engine| log-prob over the response tokens
    with engine log-probs (``rollout_log_probs``) and loss mask 1, over the whole global batch: ``samples`` is this DP
    rank's share, and the max is all-reduced over the DP group (a collective: every rank calls it). Empty when no
    token counts. Masked tokens are left out: a failed sample's placeholder log-probs (0) or an observation's are no
    engine's. The mean, ``train/train_rollout_logprob_abs_diff``, is Relax's and comes with the loss metrics
    (:func:`relax_hpc.algo.losses.policy_loss`: a mean over samples of each one's mean over its loss tokens): one
    token far off shows here when the mean hides it."""
    from megatron.core import parallel_state as ps

    top, count = 0.0, 0
    have = [(lp, r, B.field(s, "loss_mask")) for s, lp in zip(samples, log_probs)
            if (r := B.field(s, "rollout_log_probs")) is not None]
    if have:  # all samples at once: a step holds thousands of short ones, and a torch call per sample adds up
        lps, n = B.end_to_end([lp for lp, _, _ in have])
        rollout, n_r = B.end_to_end([r for _, r, _ in have])
        if n != n_r:
            i = next(i for i, (a, b) in enumerate(zip(n, n_r)) if a != b)
            raise ValueError(f"sample {i} has {n[i]} log-probs from the actor but {n_r[i]} from the engine")
        keep = B.end_to_end([torch.ones(k) if m is None else m for (_, _, m), k in zip(have, n)])[0] != 0
        d = (lps - rollout).abs()[keep]
        if d.numel():
            top, count = float(d.max()), d.numel()
    acc = torch.tensor([top, float(count)], dtype=torch.float64, device=cpu_compat.device())
    if ps.get_data_parallel_world_size() > 1:  # [max, count]: one all-reduce (MAX), a count > 0 anywhere counts
        dist.all_reduce(acc, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    top, count = acc.tolist()
    return {"train/train_rollout_logprob_abs_diff_max": top} if count > 0 else {}


def sample_means(samples: Sequence, names: Sequence[str]) -> dict[str, float]:
    """Relax's ``rollout/*`` per-sample means: for each per-token field in ``names``, the mean over the global
    batch's samples that have it of each sample's mean over its loss tokens (0 for a sample with none).
    ``samples`` is this DP rank's share; sums and counts are all-reduced over the DP group (a collective: every
    rank calls it with the same ``names``). A field no sample has is left out."""
    from megatron.core import parallel_state as ps

    k = len(names)
    acc = torch.zeros(2 * k, dtype=torch.float64)  # [sums..., counts...]
    masks = [B.field(s, "loss_mask") for s in samples]
    for j, n in enumerate(names):  # all samples at once, as rollout_logprob_gap
        have = [(v, m) for s, m in zip(samples, masks) if (v := B.field(s, n)) is not None]
        if not have:
            continue
        v, lens = B.end_to_end([v for v, _ in have])
        w = B.end_to_end([torch.ones(c) if m is None else m for (_, m), c in zip(have, lens)])[0]
        row = torch.repeat_interleave(torch.arange(len(have)), torch.tensor(lens))
        v, w = v.double(), w.double()
        num = torch.zeros(len(have), dtype=torch.float64).index_add_(0, row, v * w)
        den = torch.zeros(len(have), dtype=torch.float64).index_add_(0, row, w)
        acc[j] = float((num / den.clamp(min=1.0)).sum())
        acc[k + j] = float(len(have))
    acc = acc.to(cpu_compat.device())
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(acc, group=ps.get_data_parallel_group())
    acc = acc.cpu().tolist()
    return {n: acc[j] / acc[k + j] for j, n in enumerate(names) if acc[k + j] > 0}
