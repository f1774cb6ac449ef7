"""The colocate training loop: step N = generate a batch → train on it → sync weights → step N+1.

A state machine the controller loop feeds with ``task_done`` messages. It hands out tasks through the
channel (the roles' rank 0 long-poll for them, see :mod:`relax_hpc.roles.tasks`) and keeps one task in
flight at a time, so training is strictly on-policy: the samples of step N were generated with the
weights of step N−1 (version ``"N-1"``, ``"0"`` being the model on disk), and after step N's sync every
engine serves version ``"N"``.

    rollout start_engines → actor connect → [rollout generate(N) → actor train(N) → actor sync(N)
    (→ actor checkpoint(N) every checkpoint.interval steps and after the last)] × run.steps → stop

Each step's metrics (the roles' ``rollout/*``, ``train/*``, ``perf/*``, ``weights/*`` plus
``perf/step_time``) go to :class:`~relax_hpc.ops.metrics.RunMetrics` (TensorBoard, metrics.jsonl), and
``state.json`` gets ``step``, ``phase``, ``reward`` (the step's mean raw reward), ``reward_first10``,
``engines`` and ``last_checkpoint``. A task that reports an error fails the run with the report as
reason (a reward that raised under ``reward_error_policy: fail``, every engine dead, ...). An engine
the driver declared dead is logged by name, marked in ``state.json`` and left out of later steps and
weight syncs.

The exchange (:class:`~relax_hpc.exchange.broker.Broker`, journal ``RUN_DIR/exchange/journal.jsonl``):
each step is a partition started through the staleness gate (colocate: ``max_staleness`` 0), the rollout's
chunks are announced when its ``generate`` reports them (the report travels over the run's token
socket), the actor's ``train`` gets them under a lease of task ``train``, and its ``task_done`` acks the
lease, which clears the step. So the journal records every sample produced and consumed, across
attempts (:mod:`relax_hpc.exchange.audit`).

Resume: if ``RUN_DIR/checkpoints/latest`` names a complete checkpoint of step K, the loop starts there:
rollout restores its data cursor, the actor loads the checkpoint in ``connect``, a sync puts its weights
on the engines (version ``"K"``), and step K+1 follows; metrics after K from an earlier attempt are
dropped (:class:`~relax_hpc.ops.metrics.RunMetrics`). Requests are seeded by (run seed, step), so the
resumed run does what the uninterrupted one would have.

Stop with a checkpoint (:meth:`Colocate.request_stop`: the time-limit warning, ``relax-cancel
--checkpoint``): the step in flight finishes, a checkpoint is saved unless the last one is of this step,
and ``outcome`` becomes ``"requeue"`` or ``"cancel"`` for the controller loop to act on.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from relax_hpc.controller.channel import Channel
from relax_hpc.controller.state import RunState
from relax_hpc.exchange.broker import Broker
from relax_hpc.exchange.chunk import ChunkRef
from relax_hpc.ops.metrics import REWARD, RunMetrics
from relax_hpc.recipe import Recipe
from relax_hpc.roles.samples import PRODUCER, TRAIN_FIELDS
from relax_hpc.rundir import RunDir
from relax_hpc.train.latest import read_latest

log = logging.getLogger("relax_hpc.controller")


@dataclass
class Task:
    role: str
    kind: str
    step: int
    started: float


class Colocate:
    def __init__(self, recipe: Recipe, run: RunDir, state: RunState, channel: Channel):
        if recipe.mode != "colocate":
            raise NotImplementedError(f"mode {recipe.mode!r} is not implemented yet. Fix: use mode: colocate")
        if recipe.algorithm.use_kl_loss:
            raise NotImplementedError("algorithm.use_kl_loss needs reference log-probs, and the reference role does "
                                      "no work yet. Fix: set algorithm.use_kl_loss: false")
        self.recipe, self.run, self.state, self.channel = recipe, run, state, channel
        self.total = recipe.run.steps
        latest = read_latest(run.path / "checkpoints")
        self.resume_path = str(latest[0]) if latest else None
        self.last_ckpt_step = int(latest[1]["step"]) if latest else None
        resume_step = self.last_ckpt_step or 0
        self.broker = Broker(run.path / "exchange", tasks={"train": TRAIN_FIELDS}, max_staleness=recipe.max_staleness)
        if self.broker.rewind(resume_step):  # steps an earlier attempt did after its last checkpoint
            log.info("exchange: partitions after step %d voided; they are produced again", resume_step)
        self.lease = None
        self.metrics = RunMetrics(run.path, recipe.logging.tensorboard, start_step=resume_step,
                                  started=state.doc.get("started_at"))
        self._ids = itertools.count(1)
        self.pending: dict[int, Task] = {}
        self.step = resume_step  # the step in progress, or the last one done between steps (0 before the first)
        self.resyncing = False
        self.stop_request: tuple[str, str] | None = None  # (outcome, why) asked for by request_stop
        self.outcome: str | None = None  # "requeue" or "cancel" once a requested stop is done
        self.engines: dict[str, str] = {}
        self.engine_info: dict[str, dict] = {}
        self.cur: dict[str, float] = {}  # this step's metrics so far
        self.step_t0 = 0.0
        self.data_state: dict | None = (latest[1].get("extra_state") or {}).get("data") if latest else None
        if latest:
            log.info("resuming from %s (step %d of %d)", self.resume_path, resume_step, self.total)
            state.event("resumed", f"from the checkpoint of step {resume_step}")
        state.progress(step=resume_step, phase="starting engines", reward=None, engines={})
        self._assign("rollout", "start_engines", data_state=self.data_state)

    def request_stop(self, outcome: str, why: str) -> None:
        """Finish the step in flight, checkpoint, then stop with ``outcome`` ("requeue" or "cancel")."""
        if self.stop_request is None and self.outcome is None:
            log.info("%s: the step in flight finishes, then a checkpoint, then %s", why, outcome)
            self.stop_request = (outcome, why)
            self.state.event("stop requested", f"{why}: checkpoint, then {outcome}")
    # -- tasks out
    def _assign(self, role: str, kind: str, **fields: Any) -> None:
        tid = next(self._ids)
        self.pending[tid] = Task(role, kind, self.step, time.monotonic())
        self.channel.assign(role, {"id": tid, "kind": kind, **fields})

    def _live(self) -> dict[str, str]:
        return {n: u for n, u in self.engines.items() if not self.engine_info[n].get("dead")}

    # -- results in
    def on_message(self, msg: dict) -> None:
        if msg.get("type") != "task_done":
            return
        task = self.pending.pop(msg["task_id"], None)
        if task is None or not self.state.running:
            return
        res = msg["result"]
        if "error" in res:
            at = f"step {task.step} {task.kind}" if task.step else task.kind
            self.state.fail(task.role, msg["rank"], self._node(task.role), f"{at}: {res['error']}", kind="task")
            return
        self.cur.update({k: v for k, v in (res.get("metrics") or {}).items()})
        getattr(self, f"_{task.kind}_done")(res)

    def _node(self, role: str) -> str | None:
        nodes = self.state.doc["roles"].get(role, {}).get("nodes") or [None]
        return nodes[0]

    def _start_engines_done(self, res: dict) -> None:
        self.engines = dict(res["engines"])
        self.engine_info = {n: {"url": u, "pid": res.get("pids", {}).get(n), "node": res.get("nodes", {}).get(n),
                                "dead": None} for n, u in self.engines.items()}
        log.info("engines: %s", ", ".join(f"{n} {u}" for n, u in self.engines.items()))
        self.state.progress(engines=self.engine_info, phase="connecting weight sync")
        self._assign("actor", "connect", engines=self.engines, load=self.resume_path)

    def _connect_done(self, res: dict) -> None:
        if self.resume_path is None:
            return self._next_step()
        self.resyncing = True  # the engines serve the model on disk: give them the checkpoint's weights
        self.state.progress(phase="sync")
        self._assign("actor", "sync", version=str(self.step), engines=self._live())

    def _next_step(self) -> None:
        if self.stop_request is not None:
            outcome, why = self.stop_request
            if self.step > (self.last_ckpt_step or 0):
                self.state.progress(phase="checkpoint")
                self._assign("actor", "checkpoint", extra={"step": self.step, "data": self.data_state})
            else:
                self.outcome = outcome
            return
        if self.step >= self.total:
            self.state.progress(phase="stopping")
            for role in ("rollout", "actor"):
                self._assign(role, "stop")
            return
        self.step += 1
        self.cur, self.step_t0 = {}, time.monotonic()
        if not self.broker.start_step(self.step):
            raise RuntimeError(f"exchange: step {self.step} may not start (uncleared {self.broker.uncleared()}, "
                               f"max_staleness {self.recipe.max_staleness})")
        self.state.progress(phase="generate")
        self._assign("rollout", "generate", step=self.step, engines=self._live(), seq=self.broker.next_seq(PRODUCER))

    def _generate_done(self, res: dict) -> None:
        for f in res.get("engine_failures", []):
            log.error("step %d: rollout engine %s (%s) died: %s; its requests went to the other engines",
                      self.step, f["name"], f["url"], f["error"])
        for name, why in (res.get("dead_engines") or {}).items():
            if name in self.engine_info and not self.engine_info[name]["dead"]:
                self.engine_info[name]["dead"] = why
        for f in res.get("reward_failures", []):
            log.warning("step %d: reward failed for sample index=%s group_index=%s (prompt %r, response %r, label %r): "
                        "%s", self.step, f.get("index"), f.get("group_index"), f.get("prompt"), f.get("response"),
                        f.get("label"), f.get("error"))
        versions = [v for v in res.get("weight_versions", []) if v not in (None, "None")]
        if versions and all(v.isdigit() for v in versions):
            self.cur["rollout/weight_version"] = float(max(int(v) for v in versions))
        self.data_state = res.get("data_state")
        for c in res["chunks"]:
            self.broker.announce(ChunkRef.from_dict(c))
        self.broker.end_step(self.step)
        self.lease = self.broker.request("train", step=self.step, batch_size=1 << 30, holder="actor")
        self.state.progress(phase="train", engines=self.engine_info)
        self._assign("actor", "train", step=self.step, chunks=[c.to_dict() for c in self.lease.chunks])

    def _train_done(self, res: dict) -> None:
        self.broker.ack(self.lease.id)  # consumed: the step is complete and cleared
        self.lease = None
        self.state.progress(phase="sync")
        self._assign("actor", "sync", version=str(self.step), engines=self._live())

    def _sync_done(self, res: dict) -> None:
        if self.resyncing:
            self.resyncing = False
            return self._next_step()
        bad = {n: v for n, v in (res.get("engine_versions") or {}).items() if v != str(self.step)}
        if bad:
            log.warning("step %d: engines report other weight versions than %d after the sync: %s", self.step,
                        self.step, bad)
        self.cur["perf/step_time"] = time.monotonic() - self.step_t0
        vals = self.metrics.log(self.step, self.cur)
        first, _ = self.metrics.reward_ends()
        self.state.progress(step=self.step, reward=vals.get(REWARD), reward_first10=first)
        every = self.recipe.checkpoint.interval  # 0: only after the last step
        if (every and self.step % every == 0) or self.step == self.total:
            self.state.progress(phase="checkpoint")
            self._assign("actor", "checkpoint", extra={"step": self.step, "data": self.data_state})
        else:
            self._next_step()

    def _checkpoint_done(self, res: dict) -> None:
        self.last_ckpt_step = self.step
        self.state.progress(last_checkpoint={"step": self.step, "path": res.get("path"), "time": time.time()})
        self.state.event("checkpoint", f"step {self.step}: {res.get('path')}")
        self._next_step()

    def _stop_done(self, res: dict) -> None:
        pass  # the role ends; the loop sees it done

    # -- the end
    def finish(self) -> dict:
        """summary.json and reward.png (whatever the run's outcome); returns the summary."""
        first, last = self.metrics.reward_ends()
        summary = self.metrics.finish(self.state.doc, {"engines": self.engine_info})
        if first is not None:
            log.info("mean reward: first %d steps %.3f, last %d steps %.3f (%d steps, %.0f s); summary %s",
                     summary["reward_window"], first, summary["reward_window"], last, summary["steps"],
                     summary["wall_time_s"], self.run.path / "summary.json")
        self.state.progress(reward_first10=first, reward_last10=last, phase="finished")
        self.broker.close()
        return summary
