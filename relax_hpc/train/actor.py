"""MegatronActor: the one object the actor, reference and actor_fwd roles hold.

Usage (every rank of the role, after the role's bootstrap made the default process group)::

    init_parallel(train_cfg.tp, train_cfg.pp, seed=train_cfg.seed)
    actor = MegatronActor.from_hf(hf_dir, train_cfg, algo_cfg)          # forward_only=True for reference
    old = actor.compute_log_probs(batch)                                   # list of [R_i] tensors
    metrics = actor.train_step(batch)                                      # one optimizer step
    actor.save_checkpoint(ckpt_root, {"data_pos": 17})                     # collective; `latest` last
    extra = actor.load_checkpoint(ckpt_root)                               # at any TP/PP
    actor.export_hf(out_dir); for name, t in actor.named_hf_weights(): ...

Batch format (the same list on every rank, and the actor takes each DP rank's share itself; or each rank's
:class:`~relax_hpc.train.batch.Share`, so a rank builds only its own samples' tensors): a list of
samples, each a mapping or object with ``tokens`` LongTensor[L] (prompt + response), ``response_start``
int (first response index; response R = L − response_start tokens), ``advantage`` float or
``advantages`` [R], ``old_log_probs`` [R] (if absent and not ``use_rollout_logprobs``: π_old = this
forward, ratio 1), optional ``loss_mask`` [R], ``ref_log_probs`` [R], ``rollout_log_probs`` [R].
Padding or packing, micro-batching (``train.micro_batch_size`` samples, or ``train.max_tokens_per_micro_batch``
tokens) and DP sharding happen inside; see :mod:`.batch`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from relax_hpc.train import checkpoint as ckpt
from relax_hpc.train import export as hf_export
from relax_hpc.train.batch import Share, share_of
from relax_hpc.train.config import TrainConfig
from relax_hpc.train.logprobs import compute_log_probs
from relax_hpc.train.model import build_model, wrap_ddp_and_optimizer
from relax_hpc.train.parallel import ParallelInfo, info
from relax_hpc.train.step import NonFiniteGuard, nonfinite_what, train_step


class MegatronActor:
    def __init__(self, built, model: list, optimizer, train_cfg: TrainConfig, algo_cfg, *, temperature: float,
                 pad_id: int, opd=None):
        self.bridge = built.bridge
        self.hf_dir = built.hf_dir
        self.model = model  # DDP-wrapped chunks (training) or bare GPTModel chunks (forward only)
        self.optimizer = optimizer  # None when forward only
        self.train_cfg = train_cfg
        self.algo_cfg = algo_cfg
        self.opd = opd  # the recipe's opd section (on-policy distillation): its loss form joins the policy loss
        self.temperature = temperature
        self.pad_id = pad_id
        self.step = 0  # optimizer steps done, applied or skipped as non-finite (restored by load_checkpoint)
        self.guard = NonFiniteGuard(train_cfg)  # train.nonfinite / train.max_nonfinite_skips
        self.last_skip: str | None = None  # why the last train_step was not applied (None: it was)

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, train_cfg: TrainConfig, algo_cfg=None, *,
                temperature: float = 1.0, forward_only: bool = False, opd=None,
                freeze_vision: bool = False, freeze_audio: bool = True) -> "MegatronActor":
        """Build from an HF directory. ``init_parallel(train_cfg.tp, train_cfg.pp)`` must have run.

        ``temperature`` is the rollout sampling temperature: logits are divided by it before log-probs,
        as the engine did when it sampled. ``forward_only`` (reference, actor_fwd): no DDP, no optimizer.
        ``freeze_vision`` (``model.freeze_vision``): a VLM's vision tower is not trained (refused for a text model).
        ``freeze_audio`` (``model.freeze_audio``): an omni model's audio tower is not trained (false: refused).
        """
        from relax_hpc.train.vlm import build_vlm, check_freeze_vision, is_vlm

        if algo_cfg is None:
            from relax_hpc.algo import AlgorithmConfig

            algo_cfg = AlgorithmConfig()
        check_freeze_vision(hf_dir, freeze_vision)
        from relax_hpc.train.omni import build_omni, is_omni

        built = build_vlm(hf_dir, train_cfg, freeze_vision=freeze_vision) if is_vlm(hf_dir) else \
            build_omni(hf_dir, train_cfg, freeze_audio=freeze_audio) if is_omni(hf_dir) else \
            build_model(hf_dir, train_cfg)
        if forward_only:
            model, optimizer = built.chunks, None
            for m in model:
                m.requires_grad_(False)
        else:
            model, optimizer = wrap_ddp_and_optimizer(built.chunks, train_cfg)
        hf_cfg = built.bridge.hf_pretrained.config
        pad_id = getattr(hf_cfg, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(hf_cfg, "eos_token_id", 0)
            pad_id = pad_id[0] if isinstance(pad_id, (list, tuple)) else (pad_id or 0)
        return cls(built, model, optimizer, train_cfg, algo_cfg, temperature=temperature, pad_id=int(pad_id), opd=opd)

    @property
    def parallel(self) -> ParallelInfo:
        return info()

    def compute_log_probs(self, batch: Sequence, *, share: bool = False) -> list[torch.Tensor]:
        """Forward only: per-sample log-probs of the response tokens ([R_i] float32, CPU). ``batch`` is the
        global batch (every rank gets all log-probs) or, with ``share``, this DP rank's share (its own only)."""
        cfg = self.train_cfg
        mbs = cfg.logprob_micro_batch_size or cfg.micro_batch_size
        max_tokens = cfg.logprob_max_tokens_per_micro_batch or cfg.max_tokens_per_micro_batch
        return compute_log_probs(self.model, batch, mbs=mbs, pad_id=self.pad_id, temperature=self.temperature,
                                 max_seq_len=cfg.max_seq_len, share=share, max_tokens=max_tokens)

    def compute_ref_log_probs(self, batch: Sequence, *, share: bool = False) -> list[torch.Tensor]:
        """π_ref from this model with its LoRA adapters switched off (:func:`relax_hpc.train.lora.adapters_off`): the
        base model's log-probs, what a reference role holding the base weights computes, with no second copy of
        them. Arguments and result as :meth:`compute_log_probs`. A model without adapters has no base to return."""
        from relax_hpc.train.lora import adapters_off, has_lora

        if has_lora(self.model) is None:
            raise RuntimeError("compute_ref_log_probs needs a model with train.lora adapters (without them the "
                               "reference is a model of its own: roles.reference)")
        with adapters_off(self.model):
            return self.compute_log_probs(batch, share=share)

    def train_step(self, batch: Sequence | Share, *, rollout_step: int | None = None,
                   old_out: list | None = None) -> dict[str, float]:
        """One optimizer step; metrics (same on every rank) incl. loss, pg_loss, grad_norm. ``batch``: the
        global batch (the same list on every rank; each takes its share) or this rank's :class:`Share` of it.
        ``old_out``: filled with π_old from this forward (:func:`relax_hpc.train.step.train_step`).

        A non-finite loss or grad norm is never applied (:mod:`.step`): ``nonfinite_skipped`` is 1, ``last_skip``
        says why, and :class:`~relax_hpc.train.step.NonFiniteError` is raised where ``train.nonfinite`` /
        ``train.max_nonfinite_skips`` end the run (``rollout_step``, if given, is named in its message)."""
        if self.optimizer is None:
            raise RuntimeError("this MegatronActor was built forward_only: it cannot train")
        if not isinstance(batch, Share):
            p = self.parallel
            batch = share_of(batch, p.dp, p.dp_rank, balance=self.train_cfg.balance_data)
        where = self._where(rollout_step)
        metrics = train_step(self.model, self.optimizer, batch, train_cfg=self.train_cfg, algo_cfg=self.algo_cfg,
                             step=self.step, pad_id=self.pad_id, temperature=self.temperature, opd=self.opd,
                             old_out=old_out)
        self.step += 1  # a skipped step's slot too: checkpoint names stay unique, the lr schedule moves on
        metrics["step"] = float(self.step)
        self.last_skip = nonfinite_what(metrics)
        if self.last_skip is None:
            self.guard.applied()
        else:
            self.guard.skipped(where, self.last_skip)
        return metrics

    def skip_steps(self, k: int, what: str, *, rollout_step: int | None = None) -> None:
        """``k`` optimizer steps not even tried (the step's training columns were not finite: ``what``): their slots
        pass as a skipped step's do, and the guard may end the run (:class:`~relax_hpc.train.step.NonFiniteError`).
        They count as one skip against ``train.max_nonfinite_skips``: one bad batch, whatever its k mini-batches
        (counting k would make ``skip`` end the run at once wherever k exceeds the bound)."""
        where = self._where(rollout_step)
        self.step += k
        self.last_skip = what
        self.guard.skipped(where, what)

    def _where(self, rollout_step: int | None) -> str:
        at = f"optimizer step {self.step + 1}"
        return at if rollout_step is None else f"rollout step {rollout_step}, {at}"

    def save_checkpoint(self, root: str | os.PathLike, extra_state: dict | None = None, *,
                        keep: int | None = None) -> Path:
        """Collective save of model, optimizer, RNG, step and ``extra_state`` under ``root``; ``latest`` last."""
        return ckpt.save(root, self.model, self.optimizer, step=self.step, extra_state=extra_state, keep=keep)

    def load_checkpoint(self, path: str | os.PathLike, *, load_optimizer: bool = True) -> dict:
        """Collective load (root with ``latest``, or a step dir), at any TP/PP; returns ``extra_state``."""
        self.step, extra = ckpt.load(path, self.model, self.optimizer if load_optimizer else None)
        return extra

    def export_hf(self, out_dir: str | os.PathLike) -> Path:
        """Collective: write an HF model directory (config, tokenizer, safetensors) that transformers loads."""
        return hf_export.export_hf(self.bridge, self.model, out_dir)

    def load_hf_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        """Collective: the model's weights from full HF-named tensors (what the weight sync sends)."""
        hf_export.load_hf_weights(self.bridge, self.model, named)

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective iterator of (HF name, full CPU tensor), for weight sync; every rank gets full tensors."""
        return hf_export.named_hf_weights(self.bridge, self.model)

    def in_place(self) -> Callable[[torch.Tensor], bool]:
        """Which exported tensors are views of the model's own parameter memory (Megatron's DDP param buffer on
        CPU, TP 1: most of them; a gathered or converted tensor is not). Between steps that memory stays put,
        so a weight sync may send them as they lie (``WeightSender.push(in_place=...)``)."""
        storages = {p.untyped_storage().data_ptr() for m in self.model for p in m.parameters()}
        return lambda t: t.untyped_storage().data_ptr() in storages
