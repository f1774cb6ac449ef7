"""The actor role: trains the policy (Megatron) and pushes weights to the engines.

After the bootstrap (:mod:`relax_hpc.roles.runtime`) every rank builds the Megatron model from
``model.path`` (:func:`relax_hpc.train.build.build_megatron`: the builder the forward roles share) and serves
the controller's tasks (:mod:`relax_hpc.roles.tasks`; every task's fields and its result's:
:mod:`relax_hpc.controller.messages`):

- ``connect {engines, load, followers}``: every rank loads the checkpoint ``load`` if given (a resumed run), then
  rank 0 builds the weight-sync group with the engines and the followers (actor_fwd's rank 0, which gets every
  sync like an engine: :mod:`relax_hpc.weights.follower`) on a backend they all serve; engines on the actor's GPU
  get the weights by CUDA IPC instead, and hand their memory over while it trains (``rollout.engine.offload``).
- ``train {step, chunks}``: engines that hand over release their memory first (``perf/engine_release_time``); read the step's samples from the exchange (checksums verified; with the side
  fields ``ref_log_probs``/``log_probs`` when the reference/actor_fwd roles added them), broadcast the
  normalized rewards over the response tokens (advantages), split the samples into k mini-batches
  (``train.num_steps_per_rollout``, shuffled with the run's seed and the step) and build tensors only for
  this DP rank's share of each, take π_old for all of them before the first update from actor_fwd's
  ``log_probs`` or a forward pass (or the engine's log-probs with ``algorithm.use_rollout_logprobs``), then
  k ``train_step`` calls. Returns Relax's ``train/*`` metrics (means over the k steps; ``train/num_steps`` = k),
  ``train/train_rollout_logprob_abs_diff`` (Relax's |π_old − engine| log-prob: per sample over its loss-mask tokens,
  then over the samples), its ``_max`` over the loss-mask tokens (with identical weights the numerical gap, ~1e-6
  on CPU) and ``perf/train_time``. Non-finite numbers
  (``train.nonfinite``): a training column that is not fit to train on (NaN/inf reward, log-prob NaN or above 0:
  :func:`relax_hpc.train.plan.check_train_columns`) skips the whole step before any tensor is built, a
  non-finite loss or grad norm skips its optimizer step; ``train/nonfinite_skipped`` counts them and the result's
  ``skipped`` says why (or the run fails: :class:`relax_hpc.train.step.NonFiniteError`).
- ``stage {step, chunks}`` (streaming within a step, ``rollout.stream_groups``): π_old of chunks of step ``step`` that
  landed while the rest is generated, a forward pass per chunk with the weights held now (those the step's first
  update starts from), kept until its ``train``, which computes the other chunks' the same way and gives the plan
  the step's ``log_probs`` column. Returns ``perf/actor_stage_time``.
- ``sync {version, engines}``: released engines take their memory back (``perf/engine_resume_time``); every rank
  walks ``named_hf_weights`` (a collective); rank 0 pushes them with
  :class:`relax_hpc.weights.WeightSender` (a new group first if the engine set changed) and, with
  ``logging.check_weight_sync``, checks a spot fingerprint against each engine. An engine that dies during the
  push (an attached job scancelled or preempted) is left out and the push goes again to the others, up to
  ``SYNC_TRIES`` (3) times; it is reported in ``dead_engines``. The push, the check and the retry are one call,
  :meth:`relax_hpc.weights.push.ActorSync.sync`. Returns the sender's ``perf/weight_sync_*`` metrics,
  ``weights/fingerprint_match``, ``weights/engine_max_abs_diff`` and ``weights/versions_ok`` (every engine serves
  the new version; the followers are checked alike), and ``follower_versions``. With ``land`` (``train.overlap_sync``,
  docs/controller.md "The sync behind the next train") rank 0 packs the export into a host snapshot, answers at once
  (``landing``) and pushes it while the next ``train`` runs, reporting the landing under task id ``land``
  (:meth:`Actor._sync_behind`); the next ``sync``, ``connect`` or ``stop`` waits for that push first.
- ``checkpoint {extra}``: ``save_checkpoint`` under ``RUN_DIR/checkpoints``.
- ``stop``.

Trainer offload (``train.offload``, colocate; :mod:`relax_hpc.train.offload`): the actor's parameters, gradients and
optimizer state leave the device while the engines generate. ``connect`` ends with everything off; ``train``
brings it all back first (``perf/train_reload_time``) and sends the gradients and optimizer state off at its end
(the sync needs only the parameters); ``sync`` sends the parameters off at its end and reports what the step's cycle
freed (``perf/train_offload_bytes``) and took (``perf/train_offload_time``); ``checkpoint`` brings back what it
saves and sends it off again (the controller holds the next generate until it is done).

LoRA (``train.lora``, docs/lora.md): without a reference role the actor computes ``ref_log_probs`` itself in
``train``, its adapters switched off (:meth:`Actor._ref_log_probs`); in ``mode: adapter`` with SGLang engines
``connect`` and ``sync`` hand the engines the adapters as a PEFT directory instead of pushing weights
(:meth:`Actor._adapter_dir_connect`, :class:`relax_hpc.weights.lora.AdapterDirSync`).

Without ``model.path`` the role only bootstraps (the launch smoke tests).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from relax_hpc.roles.runtime import RoleContext, main, resolve

if TYPE_CHECKING:
    from relax_hpc.controller import messages as M

ROLE = "actor"
log = logging.getLogger("relax_hpc.actor")
# tests (tests/e2e/test_overlap_sync.py): the push behind the train of step N (this variable's value) waits until the
# next train has begun, so that a short run shows the overlap whatever the timing
HOLD_PUSH, HOLD_PUSH_S = "RELAX_TEST_HOLD_PUSH", 600


def work(ctx: RoleContext, comm: Any) -> None:
    if ctx.recipe.model.path is None:
        return
    from relax_hpc.roles.tasks import serve
    from relax_hpc.train.build import build_megatron
    from relax_hpc.train.logprobs import set_progress_hook

    model = build_megatron(ctx.recipe, ROLE, resolve(ctx.recipe.model.path), forward_only=False)
    set_progress_hook(ctx.progress)  # each micro-batch counts as progress for logging.task_timeout_s
    ctx.report("ready", model=resolve(ctx.recipe.model.path))
    actor = Actor(ctx, comm, model)
    try:
        serve(ctx, comm, actor.handlers())
    finally:
        actor.close()


class Actor:
    """The actor between tasks: the model and its weight sync (the group with the engines and followers it pushes
    to: :class:`relax_hpc.weights.push.ActorSync`). One method per task kind."""

    def __init__(self, ctx: RoleContext, comm: Any, model: Any):
        from relax_hpc.identity import reachable_host
        from relax_hpc.weights.push import ActorSync, BackgroundPush

        self.ctx, self.comm, self.model, self.recipe = ctx, comm, model, ctx.recipe
        self.rank = ctx.ident.rank
        # the backend is one every engine serves (nccl from the GPU, or gloo from host memory), or CUDA IPC to engines
        # on the actor's GPU, which then hand their memory over while it trains (rollout.engine.offload)
        self.weights = ActorSync(self.rank, None, ctx.run.api_key(), address=lambda: reachable_host(ctx.ident),
                                 offload=ctx.recipe.rollout.engine.offload,
                                 freeze_vision=ctx.recipe.model.freeze_vision,  # the vision tower is not sent
                                 node=ctx.ident.node)  # a node's engines get their weights from its first rank
        # streaming within a step (rollout.stream_groups): π_old of the chunks that landed early, chunk id -> per sample
        self.staged: dict[str, list] = {}
        self.adapter_dir = False  # train.lora.mode adapter with SGLang: the adapters go by PEFT directory (connect says)
        self._adapter_sync = None  # rank 0's AdapterDirSync, then
        self.behind = BackgroundPush()  # train.overlap_sync: rank 0's push of the last sync, behind this train
        self.training = threading.Event()  # set when a train begins (the test hook below waits for it)
        self.offload = None  # train.offload: params, grads and optimizer state off the device while engines generate
        if ctx.recipe.train.offload:
            from relax_hpc.train.offload import TrainOffload

            self.offload = TrainOffload(model.model, model.optimizer)

    def handlers(self) -> dict[str, Any]:
        return {"connect": self.connect, "train": self.train, "sync": self.sync, "checkpoint": self.checkpoint,
                "stage": self.stage, "stop": self.stop}

    def stop(self, task: M.StopTask) -> M.StopResult:
        from relax_hpc.controller import messages as M

        self.behind.wait()  # a push still behind: it lands (and is reported) before the actor goes
        return M.StopResult()

    def close(self) -> None:
        try:
            self.behind.wait()
        except Exception as e:  # noqa: BLE001 - reported to the controller already; the group closes anyway
            log.warning("%s", e)
        self.weights.close()
        if self._adapter_sync is not None:
            self._adapter_sync.close()

    # -- connect
    def connect(self, task: M.ConnectTask) -> M.ConnectResult:
        from relax_hpc.controller import messages as M

        self.behind.wait()  # the group may be rebuilt: no push of the last sync still on it
        loaded = None
        if task.load:  # collective: every rank got this task
            self.model.load_checkpoint(task.load)
            loaded = self.model.step
        self.weights.connect(task.engines, task.followers, task.nodes)  # rank 0 (and each node's first rank) connect
        self._adapter_dir_connect(task.engines)  # train.lora.mode adapter with SGLang: adapters by PEFT directory
        self._off(("params", "grads", "optimizer"))  # the engines generate step 1 next
        return M.ConnectResult(engines=sorted(self.weights.engines), loaded_step=loaded, weights=self.weights.route())

    # -- train
    def train(self, task: M.TrainTask) -> M.TrainResult:
        from relax_hpc.exchange.chunk import DamagedChunk

        self.training.set()
        released = self.weights.release()  # engines sharing the GPU give it up first (rank 0 asks them)
        reload_s = self._on(("params", "grads", "optimizer"))  # then the actor's state comes back into it
        try:
            result = self._train(task)
        except DamagedChunk:  # the step is generated again, with the actor idle: off the device again
            self._off(("params", "grads", "optimizer"))
            raise
        self._off(("grads", "optimizer"))  # the sync that follows needs only the parameters
        result.metrics.update(released)
        if reload_s is not None:
            result.metrics["perf/train_reload_time"] = reload_s
        return result

    def _on(self, kinds: tuple[str, ...]) -> float | None:
        """train.offload: bring ``kinds`` back onto the device (seconds; None without offload). A barrier first: rank 0
        alone asks the engines to release, and no rank may reload into memory they still hold."""
        if self.offload is None:
            return None
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return self.offload.reload(kinds)

    def _off(self, kinds: tuple[str, ...]) -> None:
        if self.offload is not None:
            self.offload.offload(kinds)

    def _train(self, task: M.TrainTask) -> M.TrainResult:
        from relax_hpc.controller import messages as M
        from relax_hpc.train import plan as P
        from relax_hpc.train.config import old_from_train_forward, steps_per_rollout
        from relax_hpc.train.logprobs import rollout_logprob_gap, sample_means

        t0 = time.monotonic()
        r, p = self.recipe, self.model.parallel
        cols = P.read_train_columns(task.chunks, agree=True)  # the forward roles' side fields too, when every chunk has them
        k = steps_per_rollout(r.train, len(cols["raw_reward"]))
        fused = old_from_train_forward(r) and k == 1 and "log_probs" not in cols  # π_old: the update's own forward
        if (not fused and self.recipe.rollout.stream_groups and "log_probs" not in cols
                and not r.algorithm.use_rollout_logprobs):
            cols["log_probs"] = self._chunk_old_log_probs(task)  # π_old chunk by chunk: staged early, or now
        try:  # every rank reads the same columns: every rank skips (or fails) alike
            plan = P.train_plan(cols, r.algorithm, r.rollout.n_samples_per_prompt, k=k,
                                seed=r.run.seed, step=task.step, dp=p.dp, dp_rank=p.dp_rank, opd=r.opd,
                                balance=r.train.balance_data)
        except P.UnsoundTrainData as e:  # the whole step is skipped, or the run fails (train.nonfinite)
            return self._not_trained(task.step, k, e, t0)
        mine = plan.samples  # this rank's samples of every mini-batch: only these become tensors
        t_read = time.monotonic() - t0
        ref_s = self._ref_log_probs(mine)
        if not fused:
            old = self._old_log_probs(mine)
            out = rollout_logprob_gap(mine, old) if old is not None else {}
            means = sample_means(mine, list(ROLLOUT_MEANS))  # before the updates: π_old as the step saw it
        t_train = time.monotonic()
        metrics, skipped = self._optimizer_steps(plan.shares, task.step, fused)
        t_train = time.monotonic() - t_train
        if fused:  # π_old came out of the update's forward, before the update: the same metrics from it
            out = rollout_logprob_gap(mine, [s.old_log_probs for s in mine])
            means = sample_means(mine, list(ROLLOUT_MEANS))
        out = {**metrics, **out, **plan.metrics}  # plan.metrics: rollout/rewards, the mean R̃ this step trains on
        out.update({ROLLOUT_MEANS[k]: v for k, v in means.items()})
        if "rollout/advantages" in out:  # outcome rewards, no critic: the return is the advantage (Relax's GRPO)
            out["rollout/returns"] = out["rollout/advantages"]
        lengths = cols["tokens"].lengths()
        out["perf/actor_train_time"] = t_train
        out["perf/tokens_per_gpu_per_sec"] = float(lengths.sum()) / t_train / p.world if t_train > 0 else 0.0
        out["perf/longest_sample_tokens_per_sec"] = float(lengths.max()) / t_train if t_train > 0 else 0.0
        out["perf/train_time"] = time.monotonic() - t0
        out["perf/train_get_data_time"] = t_read
        if ref_s is not None:
            out["perf/ref_log_probs_time"] = ref_s  # the reference role's timer, where the actor does its work
        return M.TrainResult(metrics=out, skipped=skipped or None)

    # -- stage (streaming within a step)
    def stage(self, task: M.StageTask) -> M.StageResult:
        """π_old of chunks of step ``task.step`` that landed while the rest of the step is generated: a forward pass
        per chunk with the weights held now, which are those the step's first update starts from (the controller
        stages step n only after step n−1 trained, and before step n's train)."""
        from relax_hpc.controller import messages as M

        t0 = time.monotonic()
        self.staged = {k: v for k, v in self.staged.items() if k.startswith(f"step_{task.step}/")}  # older: unused
        for ref in task.chunks:
            self._stage_chunk(ref)
        return M.StageResult(metrics={"perf/actor_stage_time": time.monotonic() - t0})

    def _stage_chunk(self, ref: Any) -> list:
        """π_old of one chunk's samples, alone in their forward pass: the same numbers whenever it is computed."""
        from relax_hpc.exchange.fields import LOGPROB_FIELDS, MEDIA_FIELDS
        from relax_hpc.train.plan import logprob_batch
        from relax_hpc.train.samples import as_ref, read_columns

        c = as_ref(ref)
        if c.id not in self.staged:
            media = tuple(f for f in MEDIA_FIELDS if f in c.all_fields)  # a VLM's / omni model's chunks
            batch = logprob_batch(read_columns([c], (*LOGPROB_FIELDS, *media), agree=True))
            self.staged[c.id] = [lp.detach().cpu().numpy().astype("float32")
                                 for lp in self.model.compute_log_probs(batch)]
        return self.staged[c.id]

    def _chunk_old_log_probs(self, task: M.TrainTask) -> Any:
        """The ``log_probs`` column of the step (π_old), chunk by chunk in the task's order: the staged chunks' and
        the others' computed now the same way, so the numbers do not depend on which chunks landed early."""
        from relax_hpc.exchange.chunk import Ragged

        per_sample = [lp for ref in task.chunks for lp in self._stage_chunk(ref)]
        self.staged = {}
        return Ragged.from_list(per_sample)

    def _not_trained(self, step: int, k: int, e: Exception, t0: float) -> M.TrainResult:
        """Step ``step``'s data is not fit to train on: its ``k`` optimizer steps are skipped (``train.nonfinite``)."""
        from relax_hpc.controller import messages as M

        steps = f"steps {self.model.step + 1}-{self.model.step + k}" if k > 1 else f"step {self.model.step + 1}"
        why = f"optimizer {steps}: {e}"
        self.model.skip_steps(k, str(e), rollout_step=step)
        log.warning("step %d: not trained (train.nonfinite = skip): %s", step, why)
        return M.TrainResult(metrics={"train/nonfinite_skipped": float(k), "train/num_steps": float(k),
                                      "train/step": float(self.model.step),
                                      "perf/train_time": time.monotonic() - t0,
                                      "perf/train_get_data_time": time.monotonic() - t0}, skipped=[why])

    def _ref_log_probs(self, mine: list) -> float | None:
        """train.lora without a reference role (:func:`relax_hpc.train.config.reference_from_actor`): π_ref of this
        rank's samples from the actor's own model, adapters off, set as their ``ref_log_probs`` (the field the
        reference role writes and the loss reads), before any update. The seconds it took, or None (not this run's
        way: a reference role's side field, or no π_ref needed)."""
        from relax_hpc.train.config import reference_from_actor

        if not reference_from_actor(self.recipe):
            return None
        t0 = time.monotonic()
        ref = self.model.compute_ref_log_probs(mine, share=True)
        for s, lp in zip(mine, ref):
            s.ref_log_probs = lp
        return time.monotonic() - t0

    def _old_log_probs(self, mine: list) -> list | None:
        """π_old of this rank's samples, set on them: actor_fwd's ``log_probs`` (the weights held now), else this
        actor's before the step's first update; None with ``algorithm.use_rollout_logprobs`` (the engine's)."""
        if mine and all(s.old_log_probs is not None for s in mine):
            return [s.old_log_probs for s in mine]
        if self.recipe.algorithm.use_rollout_logprobs:
            return None
        old = self.model.compute_log_probs(mine, share=True)
        for s, lp in zip(mine, old):
            s.old_log_probs = lp
        return old

    def _optimizer_steps(self, shares: list, step: int, fused: bool = False) -> tuple[dict[str, float], list[str]]:
        """One ``train_step`` per mini-batch: the ``train/*`` metrics over them, and why steps were not applied.
        ``fused`` (one mini-batch, :func:`~relax_hpc.train.config.old_from_train_forward`): its forward's π_old is set
        on the samples as their ``old_log_probs``."""
        steps, skipped = [], []
        for share in shares:
            old = [None] * len(share.samples) if fused else None
            steps.append(self.model.train_step(share, rollout_step=step, old_out=old))
            for s, lp in zip(share.samples, old or ()):
                s.old_log_probs = lp
            if self.model.last_skip is not None:  # not applied (train.nonfinite = skip); NaN/inf stay in its metrics
                skipped.append(f"optimizer step {self.model.step}: {self.model.last_skip}")
                log.warning("step %d: optimizer step %d not applied: %s", step, self.model.step, self.model.last_skip)
        return {f"train/{k}": v for k, v in _over_steps(steps).items()}, skipped

    # -- sync
    def sync(self, task: M.SyncTask) -> M.SyncResult:
        from relax_hpc.controller import messages as M

        self.behind.wait()  # the last sync's push landed: one push at a time, versions only rise
        if self.adapter_dir:  # train.lora.mode adapter with SGLang (_adapter_dir_connect)
            return self._adapter_dir_sync(task)
        if task.land is not None and self._can_push_behind(task):
            return self._sync_behind(task)
        self._on(("params",))  # off since the connect (a resume's or a catch-up sync); else a no-op
        done = self.weights.sync(str(task.version), task.engines, self.model, progress=self.ctx.progress,
                                 check=self.recipe.logging.check_weight_sync, nodes=task.nodes)
        if getattr(task, "snapshot", None):  # external engines (not in the group) load it from disk
            done.metrics["perf/weight_snapshot_time"] = self._snapshot(task.snapshot)
        if self.offload is not None:  # the engines generate next: the parameters go too, and the step's cycle is told
            self._off(("params",))
            done.metrics.update(self.offload.cycle_metrics())
        return M.SyncResult(metrics=done.metrics, engine_versions=done.engine_versions, checks=done.checks,
                            dead_engines=done.dead_engines, follower_versions=done.follower_versions)

    # -- train.overlap_sync: the push behind the next train
    def _can_push_behind(self, task: M.SyncTask) -> bool:
        """The same on every rank: rank 0 sends to every member (one node), the engines keep their memory, and no
        snapshot is to be written. Else the sync runs in series, and the controller hears so (no ``landing``)."""
        return (self.weights.solo_ok(task.engines, task.nodes) and not task.snapshot and self.offload is None
                and not self.recipe.rollout.engine.offload)

    def _sync_behind(self, task: M.SyncTask) -> M.SyncResult:
        """Every rank walks the export (collective); rank 0 keeps a host copy and answers at once (``landing``), its
        push of the copy runs while the next train does, and its landing goes to the controller as the result of
        task ``task.land``: the step counts as synced only then."""
        from relax_hpc.controller import messages as M
        from relax_hpc.weights.push import take_snapshot

        t0 = time.monotonic()
        sender = self.weights.sender  # rank 0's: the snapshot is packed into the buckets it sends
        snap = take_snapshot(self.model, self.rank, freeze_vision=self.recipe.model.freeze_vision,
                             progress=self.ctx.progress, **({"bucket_bytes": sender.bucket_bytes} if sender else {}))
        if snap is None:  # not rank 0: nothing to send
            return M.SyncResult(landing=True)
        version, engines, check = str(task.version), dict(task.engines), self.recipe.logging.check_weight_sync
        self.training.clear()
        hold = os.environ.get(HOLD_PUSH) == version  # tests: this push lands only once the next train has begun

        def push():
            if hold and not self.training.wait(HOLD_PUSH_S):
                log.warning("%s=%s: no train began within %d s; pushing", HOLD_PUSH, version, HOLD_PUSH_S)
            return self.weights.sync(version, engines, snap, progress=lambda: None, check=check, solo=True)

        self.behind.start(push, lambda outcome, s: self._report_landing(task.land, outcome, s))
        return M.SyncResult(landing=True, metrics={"perf/weight_pack_ahead_time": time.monotonic() - t0,
                                                   "perf/weight_pack_ahead_bytes": float(snap.nbytes)})

    def _report_landing(self, land: int, outcome: tuple[str, Any], seconds: float) -> None:
        """Rank 0, in the push's thread: its outcome to the controller as the result of task ``land`` (a connection
        of its own: the task poll holds the other)."""
        from relax_hpc.controller import messages as M
        from relax_hpc.controller.protocol import Client
        from relax_hpc.roles.tasks import describe

        kind, value = outcome
        if kind == "ok":
            result = M.SyncResult(metrics={**value.metrics, "perf/weight_sync_behind_time": seconds},
                                  engine_versions=value.engine_versions, checks=value.checks,
                                  dead_engines=value.dead_engines, follower_versions=value.follower_versions).to_dict()
        else:
            result = M.TaskError(error=describe(value), restartable=bool(getattr(value, "restartable", False))).to_dict()
        addr = self.ctx.run.read_json(self.ctx.run.controller_addr)
        client = Client(addr["host"], int(addr["port"]), self.ctx.run.token(), timeout_s=30.0)
        try:
            client.task_done(ROLE, 0, int(land), result, seconds)
        finally:
            client.close()

    # -- train.lora.mode adapter with SGLang engines: the adapters as a PEFT directory (relax_hpc.weights.lora)
    def _adapter_dir_connect(self, engines: dict[str, str]) -> None:
        """Collective: whether this run's adapters go by PEFT directory (adapter mode, and an engine that is not
        relax_hpc's reference engine: SGLang, whose weight-update calls refuse adapter names and whose LoRA serves
        an adapter to the requests naming it); if so the engines load the actor's adapters now (the base model
        at a fresh start: B = 0), so the first step's requests find the adapter they name."""
        import torch.distributed as dist

        from relax_hpc.roles.runtime import resolve
        from relax_hpc.weights.lora import AdapterDirSync, adapter_mode

        self.adapter_dir = False
        if not adapter_mode(self.model):
            return
        sender = self.weights.sender
        infos = sender.infos if sender is not None else {}
        flag = [self.rank == 0 and any((i or {}).get("engine") != "relax_hpc-cpu" for i in infos.values())]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(flag, src=0)
        self.adapter_dir = bool(flag[0])
        if not self.adapter_dir:
            return
        if self.rank == 0 and self._adapter_sync is None:
            self._adapter_sync = AdapterDirSync(self.ctx.run.path / "lora", self.ctx.run.api_key(),
                                                str(resolve(self.recipe.model.path)))
        self._publish_adapters(None, dict(engines))

    def _publish_adapters(self, version: str | None, engines: dict[str, str]):
        """Collective: every rank exports the adapters, rank 0 writes and swaps them on ``engines`` (``version``:
        what they report after; None: left as it is). Rank 0's (metrics, versions, dead); other ranks' None."""
        import torch.distributed as dist

        from relax_hpc.weights.lora import adapter_tensors, lora_record

        named = list(adapter_tensors(self.model))
        out = None
        if self.rank == 0:
            sync = self._adapter_sync
            if version is None:
                sync.write("0", named, lora_record(self.model))
                for url in engines.values():
                    sync.swap(url, None)
            else:
                out = sync.publish(version, named, lora_record(self.model), engines)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return out

    def _adapter_dir_sync(self, task: M.SyncTask) -> M.SyncResult:
        """``sync`` in adapter mode with SGLang: the adapters' PEFT directory, swapped on every engine; no
        fingerprint check (SGLang's ``/get_weights_by_name`` reads base weights, not adapters)."""
        from relax_hpc.controller import messages as M

        self._on(("params",))
        t0 = time.monotonic()
        engines = dict(task.engines or self.weights.engines)
        resumed = {}
        if self.rank == 0 and self.weights.released:  # engines that handed their memory over
            resumed = self.weights.resume(engines)  # take it back first, as ActorSync.sync does before a push
        out = self._publish_adapters(str(task.version), engines)
        metrics, versions, dead = out if out is not None else ({}, {}, {})
        metrics.update(resumed)
        metrics["perf/weight_sync_time"] = time.monotonic() - t0
        if self.offload is not None:
            self._off(("params",))
            metrics.update(self.offload.cycle_metrics())
        return M.SyncResult(metrics=metrics, engine_versions=versions, checks={}, dead_engines=dead,
                            follower_versions={})

    def _snapshot(self, where: str) -> float:
        """Collective: the weights as an HF directory at ``where``, whole or not at all (written beside it, then
        renamed by rank 0); the seconds it took."""
        import os
        import shutil
        from pathlib import Path

        t0, path = time.monotonic(), Path(where)
        tmp = path.with_name(path.name + ".tmp")
        self.model.export_hf(tmp)
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        return time.monotonic() - t0

    # -- checkpoint
    def checkpoint(self, task: M.CheckpointTask) -> M.CheckpointResult:
        from relax_hpc.controller import messages as M

        t0 = time.monotonic()
        self._on(("params", "optimizer"))  # what it saves (the grads stay off: not saved)
        path = self.model.save_checkpoint(self.ctx.run.path / "checkpoints", dict(task.extra or {}),
                                          keep=self.recipe.checkpoint.keep)
        self._off(("params", "grads", "optimizer"))
        return M.CheckpointResult(path=str(path), metrics={"perf/save_model_time": time.monotonic() - t0})


# Relax's rollout/* per-sample means of the per-token fields the step trains on (relax_hpc.train.logprobs.sample_means)
ROLLOUT_MEANS = {"old_log_probs": "rollout/log_probs", "ref_log_probs": "rollout/ref_log_probs",
                 "rollout_log_probs": "rollout/rollout_log_probs", "advantages": "rollout/advantages"}


def _over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from its k optimizer steps' (mini-batch updates): the mean of each, but the counts
    (``num_samples``, ``num_loss_tokens``, ``nonfinite_skipped``) summed and ``step`` the last; ``num_steps`` is k.
    A skipped step's NaN or inf makes the mean NaN or inf: visible, as it should be."""
    out = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}
    for k in ("num_samples", "num_loss_tokens", "nonfinite_skipped"):
        if k in out:
            out[k] = sum(m[k] for m in steps)
    out["step"] = steps[-1]["step"]
    out["num_steps"] = float(len(steps))
    return out


if __name__ == "__main__":
    sys.exit(main(ROLE, work))
