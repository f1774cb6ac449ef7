"""The actor role: trains the policy (Megatron) and pushes weights to the engines.

After the bootstrap (:mod:`relax_hpc.roles.runtime`) every rank builds the Megatron model from
``model.path`` (:func:`relax_hpc.roles.model.build_megatron`: the builder the forward roles share) and serves
the controller's tasks (:mod:`relax_hpc.roles.tasks`; every task's fields and its result's:
:mod:`relax_hpc.controller.messages`):

- ``connect {engines, load}``: every rank loads the checkpoint ``load`` if given (a resumed run), then
  rank 0 builds the weight-sync group with the engines (:mod:`.weight_sync`).
- ``train {step, chunks}``: read the step's samples from the exchange (checksums verified; with the side
  fields ``ref_log_probs``/``log_probs`` when the reference/actor_fwd roles added them), broadcast the
  normalized rewards over the response tokens (advantages), take π_old from actor_fwd's ``log_probs`` or
  recompute it with a forward pass (or use the engine's log-probs with ``algorithm.use_rollout_logprobs``),
  one ``train_step``. Returns Relax's
  ``train/*`` metrics, ``train/train_rollout_logprob_abs_diff`` (mean |actor − engine| log-prob over the
  response tokens; with identical weights this is the numerical gap, ~1e-7 on CPU) and ``perf/train_time``.
- ``sync {version, engines}``: every rank walks ``named_hf_weights`` (a collective); rank 0 pushes them with
  :class:`relax_hpc.weights.WeightSender` (a new group first if the engine set changed) and, with
  ``logging.check_weight_sync``, checks a spot fingerprint against each engine (:mod:`.weight_sync`).
  Returns the sender's ``perf/weight_sync_*`` metrics, ``weights/fingerprint_match``,
  ``weights/engine_max_abs_diff`` and ``weights/versions_ok`` (every engine serves the new version).
- ``checkpoint {extra}``: ``save_checkpoint`` under ``RUN_DIR/checkpoints``.
- ``stop``.

Without ``model.path`` the role only bootstraps (the launch smoke tests).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from relax_hpc.identity import reachable_host
from relax_hpc.roles.model import build_megatron, resolve
from relax_hpc.roles.runtime import RoleContext, main

ROLE = "actor"


def work(ctx: RoleContext, comm: Any) -> None:
    if ctx.recipe.model.path is None:
        return
    import torch
    import torch.distributed as dist

    from relax_hpc.controller import messages as M
    from relax_hpc.exchange.chunk import ChunkRef
    from relax_hpc.roles import samples as S
    from relax_hpc.roles.tasks import serve
    from relax_hpc.roles.weight_sync import ROWS, EngineChecker
    from relax_hpc.train.logprobs import set_progress_hook
    from relax_hpc.weights import WeightSender, WeightSyncError, push_from_actor

    r = ctx.recipe
    rank = ctx.ident.rank
    actor = build_megatron(r, ROLE, forward_only=False)
    set_progress_hook(ctx.progress)  # each micro-batch counts as progress for logging.task_timeout_s
    ctx.report("ready", model=resolve(r.model.path))
    st: dict[str, Any] = {"sender": None, "engines": {}}
    checker = EngineChecker(ctx.run.api_key())

    def connect(task: M.ConnectTask) -> M.ConnectResult:
        loaded = None
        if task.load:  # collective: every rank got this task
            actor.load_checkpoint(task.load)
            loaded = actor.step
        st["engines"] = dict(task.engines)
        if rank == 0:
            if st["sender"] is None:
                st["sender"] = WeightSender(backend="nccl" if comm.backend == "nccl" else "gloo",
                                            api_key=ctx.run.api_key())
                st["sender"].connect(list(st["engines"].values()), reachable_host(ctx.ident))
            else:  # the engine set changed (an engine died): a group's size is fixed, so a new group
                st["sender"].reconnect(list(st["engines"].values()))
        return M.ConnectResult(engines=sorted(st["engines"]), loaded_step=loaded)

    def train(task: M.TrainTask) -> M.TrainResult:
        t0 = time.monotonic()
        refs = [ChunkRef.from_dict(c) for c in task.chunks]
        # every rank reads the whole batch (train_step shards it), so reward normalization and advantage
        # whitening need no process group; the forward roles' side fields come along when every chunk has them
        batch, reward_metrics = S.read_train_batch(refs, r.algorithm, r.rollout.n_samples_per_prompt, agree=True)
        t_read = time.monotonic() - t0
        diff = {}
        if batch and all("old_log_probs" in s for s in batch):  # π_old from actor_fwd, with the weights held now
            diff = _logprob_gap(batch, [s["old_log_probs"] for s in batch])
        elif not r.algorithm.use_rollout_logprobs:
            old = actor.compute_log_probs(batch)
            for s, lp in zip(batch, old):
                s["old_log_probs"] = lp
            diff = _logprob_gap(batch, old)
        metrics = actor.train_step(batch)
        out = {f"train/{k}": v for k, v in metrics.items()}
        out.update(diff)
        out.update(reward_metrics)  # rollout/rewards: the mean R̃ this step trains on
        out["perf/train_time"] = time.monotonic() - t0
        out["perf/exchange_read_time"] = t_read
        return M.TrainResult(metrics=out)

    def sync(task: M.SyncTask) -> M.SyncResult:
        t0 = time.monotonic()
        version = str(task.version)
        engines = dict(task.engines or st["engines"])
        dead = checker.unreachable(engines) if rank == 0 else {}  # died after its last request: left out
        engines = {n: u for n, u in engines.items() if n not in dead}
        if not engines:
            raise WeightSyncError(f"no rollout engine left to sync: {dead}")
        if engines != st["engines"]:  # an engine died since the last sync
            connect(M.ConnectTask(engines=engines, load=None))
        heads: dict[str, torch.Tensor] = {}

        def stream():  # every rank walks the collective gather; rank 0 keeps each tensor's first rows
            for name, t in actor.named_hf_weights():
                heads[name] = t[:ROWS].detach().clone()
                ctx.progress()
                yield name, t

        out: dict[str, Any] = dict(push_from_actor(stream(), st["sender"] if rank == 0 else None, version))
        dist.barrier()
        out["perf/weight_sync_time"] = time.monotonic() - t0
        if rank != 0:
            return M.SyncResult(metrics=out)
        checks = checker.check(engines, heads, version) if r.logging.check_weight_sync else {}
        if checks:
            out["weights/fingerprint_match"] = float(all(c["fingerprint_equal"] for c in checks.values()))
            out["weights/engine_max_abs_diff"] = max(c["max_abs_diff"] for c in checks.values())
            out["weights/versions_ok"] = float(all(c["version_ok"] for c in checks.values()))
        return M.SyncResult(metrics=out, engine_versions={n: c["version"] for n, c in checks.items()},
                            checks=checks, dead_engines=dead)

    def checkpoint(task: M.CheckpointTask) -> M.CheckpointResult:
        t0 = time.monotonic()
        path = actor.save_checkpoint(ctx.run.path / "checkpoints", dict(task.extra or {}), keep=r.checkpoint.keep)
        return M.CheckpointResult(path=str(path), metrics={"perf/save_time": time.monotonic() - t0})

    try:
        serve(ctx, comm, {"connect": connect, "train": train, "sync": sync, "checkpoint": checkpoint,
                          "stop": lambda task: M.StopResult()})
    finally:
        checker.close()
        if st["sender"] is not None:  # the engines are going away too: leave without asking them
            st["sender"].close(destroy_on_engines=False)


def _logprob_gap(batch: list[dict], old: list) -> dict[str, float]:
    """Mean and max |actor − engine| log-prob over the response tokens that have engine log-probs."""
    import torch

    diffs = [(lp - s["rollout_log_probs"]).abs() for s, lp in zip(batch, old) if "rollout_log_probs" in s]
    if not diffs:
        return {}
    d = torch.cat(diffs)
    return {"train/train_rollout_logprob_abs_diff": float(d.mean()),
            "train/train_rollout_logprob_abs_diff_max": float(d.max())}


if __name__ == "__main__":
    sys.exit(main(ROLE, work))
