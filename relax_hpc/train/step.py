"""One optimizer step of the policy loss (:func:`relax_hpc.algo.policy_loss`) over a global batch.

Loss weighting, so that any TP/PP/DP layout and micro-batch split gives the loss of the whole batch
(Relax's: the mean over samples of each sample's token-mean, or with ``calculate_per_token_loss`` the
mean over all loss tokens): ``policy_loss`` reduces over the samples of one micro-batch, so micro-batch k
gets the weight w_k = B_k / N (or its token share). Megatron's schedule divides each micro-batch loss
by this rank's number of micro-batches M and DDP averages gradients over the DP ranks, so the tensor
we backprop is loss_k · w_k · M · dp. Metrics are Σ_k w_k · metric_k summed over DP ranks: exactly the
whole-batch value, whatever the layout.

Non-finite steps (``train.nonfinite``): the loss (known on the last pipeline stage) and the grad norm (Megatron's,
a collective) are checked before the update, and every rank of the role takes the same decision from an all-reduced
flag. A non-finite step is never applied: its grads are zeroed and the optimizer does not step (weights and Adam
state untouched). Its step slot is still used: ``MegatronActor.step`` (the checkpoint's step) and so the
learning-rate schedule move on, as for an applied update, so checkpoint names stay unique and the schedule stays
aligned with the run's steps; Adam's own step count (its bias correction) counts applied updates only. Whether
the run goes on is :class:`NonFiniteGuard`'s call.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from relax_hpc.errors import PermanentError
from relax_hpc.train import batch as B
from relax_hpc.train.config import TrainConfig
from relax_hpc.train.logprobs import plan_micro_batches, response_logprobs, run_forward, seq_multiple


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0 = the first): linear warmup, then constant or cosine."""
    if cfg.lr_warmup_steps > 0 and step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay == "cosine" and cfg.lr_decay_steps > 0:
        k = min(step - cfg.lr_warmup_steps, cfg.lr_decay_steps) / cfg.lr_decay_steps
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * k))
    return cfg.lr


class NonFiniteError(PermanentError):
    """Training met a non-finite loss, grad norm or training column and ``train.nonfinite`` /
    ``train.max_nonfinite_skips`` say the run ends: doing the step again computes the same numbers."""


class NonFiniteGuard:
    """``train.nonfinite`` and ``train.max_nonfinite_skips`` for one trainer: counts consecutive skipped optimizer
    steps (in this process: a restarted role counts from 0) and raises :class:`NonFiniteError` where the keys say
    the run ends. The same calls on every rank give the same verdict."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.streak = 0  # consecutive optimizer steps skipped

    def applied(self) -> None:
        self.streak = 0

    def skipped(self, where: str, what: str) -> None:
        """An optimizer step (or, at the door, a rollout step's batch) was not applied at ``where`` (e.g. "rollout
        step 7, optimizer step 13") because ``what`` (e.g. "loss = nan, grad_norm = nan"); raises when the run
        must end."""
        self.streak += 1
        keys = f"train.nonfinite = {self.cfg.nonfinite}, train.max_nonfinite_skips = {self.cfg.max_nonfinite_skips}"
        if self.cfg.nonfinite == "fail":
            raise NonFiniteError(
                f"{where}: {what}; not applied, and the run stops ({keys}). Fix: find where the non-finite value "
                "comes from (rewards, engine log-probs, a learning rate too high), or set train.nonfinite: skip "
                "to skip such steps")
        if self.streak > self.cfg.max_nonfinite_skips:
            raise NonFiniteError(
                f"{where}: {what}; {self.streak} consecutive optimizer steps skipped, more than "
                f"train.max_nonfinite_skips allows ({keys}). Fix: find where the non-finite value comes from "
                "(rewards, engine log-probs, a learning rate too high), or raise train.max_nonfinite_skips")


class RoutingReplayError(PermanentError):
    """``train.routing_replay`` is on but the step's chunks carry no ``routed_experts``: a retry reads the same."""


def nonfinite_what(metrics: dict[str, float]) -> str | None:
    """What made a step returned by :func:`train_step` non-finite ("loss = nan, grad_norm = inf"), or None if it
    was applied."""
    if not metrics.get("nonfinite_skipped"):
        return None
    parts = [f"{k} = {metrics[k]}" for k in ("loss", "grad_norm") if not math.isfinite(metrics.get(k, 0.0))]
    return ", ".join(parts) or "gradients overflowed"


def train_step(model: list, optimizer, share: B.Share, *, train_cfg: TrainConfig, algo_cfg, step: int,
               pad_id: int, temperature: float = 1.0, opd=None, old_out: list | None = None) -> dict[str, float]:
    """Forward/backward over this DP rank's ``share`` of a global batch and one optimizer step.

    Every rank of a DP group passes the same share (:func:`relax_hpc.train.batch.dp_shard`); the share's
    :class:`~relax_hpc.train.batch.GlobalStats` give the loss weights of the whole global batch.
    Returns float metrics, the same on every rank: Relax's ``loss``, ``pg_loss``, ``pg_clipfrac``,
    ``ppo_kl``, ``entropy_loss`` (+ ``kl_loss``, ``tis``... as configured), plus ``grad_norm``, ``lr``,
    ``update_successful``, ``num_samples``, ``num_loss_tokens``, ``padding_share`` (pad tokens / all tokens the
    micro-batches held) and ``nonfinite_skipped`` (1: the loss or grad
    norm was not finite and the update was not applied; :func:`nonfinite_what` says why). Non-finite values stay
    in the metrics as they are.

    ``old_out`` (a list as long as ``share.samples``): filled, on the last pipeline stage, with each sample's π_old
    where this forward is it (no ``old_log_probs``, not ``use_rollout_logprobs``): its response log-probs before
    the update, ``[R_i]`` float32 on the CPU (:func:`relax_hpc.train.config.old_from_train_forward`).
    """
    from megatron.core import parallel_state as ps

    from relax_hpc.algo import policy_loss

    n = share.stats.n
    dp = ps.get_data_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    if train_cfg.global_batch_size is not None and n != train_cfg.global_batch_size:
        raise ValueError(f"train_step got {n} samples but train.global_batch_size = {train_cfg.global_batch_size}")
    if n < dp or not share.samples:
        raise ValueError(f"train_step got {n} samples for {dp} data-parallel ranks: every rank needs at least one")
    if train_cfg.routing_replay:
        missing = [i for i, x in enumerate(share.samples) if B.field(x, "routed_experts") is None]
        if missing:
            raise RoutingReplayError(
                f"train.routing_replay = true but {len(missing)} of {len(share.samples)} samples (first: {missing[0]}) "
                "carry no routed_experts from the engine. Fix: an engine that returns them (SGLang with "
                "--enable-return-routed-experts, or the reference engine) and the rollout asking for them "
                "(return_routed_experts), or train.routing_replay: false")
    per_token = bool(algo_cfg.calculate_per_token_loss)
    total = max(share.stats.loss_tokens if per_token else float(n), 1.0)
    mbs = plan_micro_batches(share.samples, train_cfg.micro_batch_size, pad_id=pad_id, train=True, pp=pp,
                             max_seq_len=train_cfg.max_seq_len, global_seq_len=share.stats.max_seq_len,
                             max_tokens=train_cfg.max_tokens_per_micro_batch, multiple=seq_multiple(model))
    M = len(mbs)
    for mb in mbs:
        mb.weight = (mb.num_loss_tokens if per_token else mb.n_real) / total
    entropy_grad = algo_cfg.entropy_coef != 0

    def loss_fn(mb: B.MicroBatch, output: torch.Tensor):
        lp, ent = response_logprobs(output, mb, temperature=temperature, with_entropy=True, entropy_grad=entropy_grad)
        dev = lp.device

        def data(t):
            return None if t is None else t.to(dev)

        old = data(mb.old_log_probs)
        if old is None and not algo_cfg.use_rollout_logprobs:
            old = lp.detach()  # no actor_fwd: π_old is this very forward (ratio 1), Relax's on-policy shortcut
            if old_out is not None:
                rows = old.float().cpu()
                for row, i in enumerate(mb.index if mb.index is not None else range(mb.n_real)):
                    old_out[i] = rows[row, :mb.response_lens[row]].clone()
        loss, metrics = policy_loss(
            algo_cfg, lp, old, data(mb.advantages), data(mb.loss_mask),
            ref_log_probs=data(mb.ref_log_probs), rollout_log_probs=data(mb.rollout_log_probs), entropy=ent,
            opd=opd, teacher_log_probs=data(mb.teacher_log_probs),  # OPD's loss form (opd.loss_coef)
        )
        reported = {k: float(v) * mb.weight for k, v in metrics.items()}  # as Relax reports: by share of the step
        return loss * (mb.weight * M * dp), reported

    for m in model:
        m.train()
        m.zero_grad_buffer()
    optimizer.zero_grad()
    results = run_forward(model, mbs, loss_fn, forward_only=False)

    metrics: dict[str, float] = {}
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for r in results:
            for k, v in r.items():
                metrics[k] = metrics.get(k, 0.0) + v
        metrics["_held"] = float(sum(mb.tokens.numel() for mb in mbs))  # token slots the forwards ran over
        metrics["_real"] = float(sum(mb.real_tokens for mb in mbs))
        if dp > 1:
            parts: list = [None] * dp
            dist.all_gather_object(parts, metrics, group=ps.get_data_parallel_group())
            metrics = {}
            for part in parts:
                for k, v in part.items():
                    metrics[k] = metrics.get(k, 0.0) + v
    if pp > 1:
        box = [metrics]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        metrics = box[0]

    held, real = metrics.pop("_held", 0.0), metrics.pop("_real", 0.0)
    metrics["padding_share"] = 1.0 - real / held if held else 0.0  # pad tokens / all tokens of the micro-batches
    lr = lr_at(train_cfg, step)
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
        g["weight_decay"] = train_cfg.weight_decay * g.get("wd_mult", 1.0)
    # optimizer.step() in its parts, so the update can be refused after the norm: grads to the optimizer's main
    # grads (with a loss scaler: unscaled, and overflow found), the grad norm (collective), then clip and update
    overflow = bool(optimizer.prepare_grads())
    grad_norm = float(optimizer.get_grad_norm())
    loss = metrics.get("loss", 0.0)  # the same on every rank (gathered over DP, broadcast from the last stage)
    flags = torch.tensor([float(not math.isfinite(loss)), float(overflow or not math.isfinite(grad_norm))],
                         dtype=torch.float32, device=_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank of the role decides alike (the loss: last PP stage)
    bad = bool(flags.sum().item() > 0)
    if bad:
        optimizer.zero_grad()
        for m in model:
            m.zero_grad_buffer()
        ok = False
    else:
        _clip(optimizer, grad_norm)
        ok = optimizer.step_with_ready_grads()
    metrics.update(
        grad_norm=grad_norm, lr=lr, update_successful=float(bool(ok)), num_samples=float(n),
        num_loss_tokens=float(share.stats.loss_tokens), nonfinite_skipped=float(bad),
    )
    return metrics


def _clip(optimizer, grad_norm: float) -> None:
    """Clip each (chained) optimizer's grads by the total norm, as megatron-core 0.16.1's ``step()`` does."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _device() -> torch.device:
    from relax_hpc.train import cpu_compat

    return cpu_compat.device()
