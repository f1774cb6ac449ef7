"""The run's state as the controller knows it, and ``state.json``, its only on-disk form.

The controller is the only writer (atomic, mode 0600); ``relax-status`` and tests read it. Rules that decide
a role's fate live here, in one place: a role fails on its first ``error`` message, a non-zero step exit,
a step that ends before all its ranks said ``done``, a rank silent for longer than the heartbeat
timeout, or a role whose rank 0 holds a task that made no progress for ``logging.task_timeout_s`` (its
heartbeat thread alive, its work hung). The first failure wins and names role, rank, node and the error's
last line.

What a heartbeat's ``info`` says is checked by :func:`protocol.validate`; a value of the wrong type that
got here anyway is ignored, never raised on: the loop that reads it is the run's only loop.

Times are Unix epoch seconds (floats). Phases only move forward (a late heartbeat cannot undo ``done``).

A run lives through attempts (a requeued or continued job, a local requeue) and, inside one, restarts of
its steps; ``state.json`` is carried across both: ``attempt``, ``restarts``, ``history`` (how each earlier
try ended), ``last_checkpoint``, ``last_failure`` and ``events`` survive, the per-role view starts anew.

Which failures a restart may fix is decided here too (:class:`Failure`'s ``kind``; only ``role`` restarts), and
which tier of recovery acts (docs/reliability.md, "Two tiers of recovery"): a role other than the actor that dies,
goes silent or hangs is started again alone (:meth:`RunState.take_alone`; the loop does it) while the others keep
their processes, at most ``health.max_role_restarts`` times per try; the actor's failure, or a role failing again
within ``health.window_s`` of its restart alone, fails the try, and every step restarts from the checkpoint.
``state.json``'s ``health`` says which tier acted, why, and how long each recovery took.
A full disk fails the run at once, naming the mount point: a role's report says so, a write of ``state.json``
that fails for want of space writes the failure into the run directory's reserve, and any failure seen
while the run directory's filesystem is full is taken for one (docs/reliability.md, "A full disk").
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.backends import Backend
from relax_hpc.controller.protocol import PHASES
from relax_hpc.errors import NO_SPACE, PERMANENT, no_space
from relax_hpc.identity import cross_members
from relax_hpc.recipe import Recipe, RoleStep
from relax_hpc.rundir import (FULL_BYTES, RunDir, free_bytes, json_text, mount_point, no_space_message, no_space_reason,
                              write_json)

log = logging.getLogger("relax_hpc.controller")

ORDER = {p: i for i, p in enumerate(PHASES)}
RUNNING, COMPLETED, FAILED, CANCELLED = "RUNNING", "COMPLETED", "FAILED", "CANCELLED"
REQUEUED = "REQUEUED"  # this attempt ended to come back (time limit, relax-cancel --requeue); the run goes on
CARRIED = ("history", "restarts", "last_checkpoint", "last_failure", "events", "started_at", "reward_first10", "health",
           "attached_engines")  # attached_engines: relax-scale --attach-url's, attached again by the next attempt
MAX_RECOVERIES = 20  # recoveries kept in state.json's health
MAX_EVENTS = 50


@dataclass
class Rank:
    phase: str = "starting"
    last: float | None = None  # time of the last message from this rank
    node: str | None = None
    pid: int | None = None
    info: dict = field(default_factory=dict)
    task: tuple | None = None  # (task id, progress) of the task in hand, from its heartbeats; None: idle
    task_since: float | None = None  # when ``task`` last changed


@dataclass
class Failure:
    role: str
    rank: int | None
    node: str | None
    message: str
    # role: a step crashed, hung or raised (a restart may help); task: the role's verdict on its work; permanent:
    # a role's error that will repeat (bad data, a user function that does not load); no_space: a full disk;
    # controller: the controller's own error. Only ``role`` is restarted.
    kind: str = "role"

    def reason(self) -> str:
        who = self.role + (f" rank {self.rank}" if self.rank is not None else "")
        return f"{who}{f' on {self.node}' if self.node else ''} failed: {self.message}"


def _flag(v: Any) -> bool | None:
    """A check's verdict: True or False; anything else (not yet known, or malformed) is None."""
    return v if isinstance(v, bool) else None


def _get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, or None where a level is missing or not a dict."""
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


class RunState:
    def __init__(self, run: RunDir, recipe: Recipe, steps: list[RoleStep], backend: Backend,
                 env: dict[str, str] | None = None, restart: bool = False):
        """``backend``: the run's backend. ``restart``: the steps are being restarted inside this
        attempt (not a new attempt of the job)."""
        env = os.environ if env is None else env
        prev = run.read_json(run.state, {}) or {}
        self.run, self.steps = run, {s.role: s for s in steps}
        self.ranks = {s.role: [Rank() for _ in range(s.ntasks)] for s in steps}
        self.launched: dict[str, float] = {}
        self.exit_codes: dict[str, int] = {}
        self.failure: Failure | None = None
        self.members = cross_members(recipe)
        self.task_timeout_s = float(recipe.logging.task_timeout_s)
        self.max_restarts = int(recipe.checkpoint.max_restarts)
        self.max_alone, self.window_s = int(recipe.health.max_role_restarts), float(recipe.health.window_s)
        self.alone: dict[str, Failure] = {}  # roles to start again alone (the loop takes them: take_alone)
        self.alone_at: dict[str, float] = {}  # role -> when it was last started again alone, in this try
        self.alone_done: dict[str, int] = {}  # role -> its restarts alone in this try
        self.fresh: set[tuple[str, int]] = set()  # ranks started again alone that have not said hello yet
        self.recovering: dict[str, float] = {}  # role -> when its failure was seen (until it works again)
        self.recover_on_ready = False  # no training loop: a role restarted alone has recovered once it is ready
        self._unlogged_recovery = 0.0  # seconds of recoveries ended since the last metrics row
        now = time.time()
        job = run.read_json(run.job, {}) or {}
        self.doc: dict[str, Any] = {
            "run": run.name, "job_id": env.get("SLURM_JOB_ID") or job.get("job_id"), "executor": backend.name,
            "state": RUNNING, "reason": None, "attempt": int(prev.get("attempt", -1)) + (0 if restart else 1),
            "slurm_restart_count": int(env.get("SLURM_RESTART_COUNT") or 0), "restarts": 0, "history": [],
            "last_checkpoint": None, "last_failure": None, "events": [],
            "step": 0, "total_steps": recipe.run.steps, "started_at": now, "updated_at": now,
            "roles": {s.role: {
                "het_group": s.het_group,
                "het_nodelist": backend.nodelist(s.het_group, env),
                "nodes": [None] * s.ntasks, "ranks": s.ntasks, "ranks_ready": 0, "phase": "starting",
                "last_heartbeat": None, "collective_ok": None, "error": None, "pids": [None] * s.ntasks,
                "exit_code": None,
            } for s in steps},
            "cross_group": {"world": len(self.members), "ok": None},
            # which tier of recovery acted, why, and how long it took (role_restarts: restarts of a role alone,
            # in the run; global_restarts: restarts of every step; pending: a global restart not yet recovered)
            "health": {"role_restarts": 0, "global_restarts": 0, "recoveries": [], "pending": None},
        }
        if prev:
            self.doc.update({k: prev[k] for k in CARRIED if prev.get(k) is not None})
            self.doc["restarts"] += 1 if restart else 0
            ended = {k: prev.get(k) for k in ("attempt", "job_id", "state", "reason", "step", "updated_at")}
            if prev.get("restarting"):  # published as RUNNING while it restarted: the try itself FAILED
                ended.update(state=FAILED, reason=prev["restarting"])
            self.doc["history"] = (self.doc["history"] + [ended])[-MAX_EVENTS:]
        self.dirty, self.urgent, self._last_write = True, True, 0.0
        self.on_event = None  # called with (name, detail) for each event (the controller notifies)

    @property
    def running(self) -> bool:
        return self.doc["state"] == RUNNING

    @property
    def will_restart(self) -> bool:
        """This try FAILED of a step's failure a restart may fix (``role``), and a restart is left
        (``checkpoint.max_restarts``): the controller restarts every step from the latest checkpoint."""
        f = self.failure
        return (self.doc["state"] == FAILED and f is not None and f.kind == "role"
                and self.doc["restarts"] < self.max_restarts)

    def public(self) -> dict[str, Any]:
        """``state.json`` as written: the doc, except while a failure is being restarted (:attr:`will_restart`),
        which is no end of the run and must not read as one (a watcher takes FAILED for the end): RUNNING, phase
        ``restarting``, the failure in ``restarting`` (and ``last_failure``); FAILED only once no restart is left."""
        if not self.will_restart:
            return self.doc
        return {**self.doc, "state": RUNNING, "reason": None, "phase": "restarting", "restarting": self.doc["reason"]}

    # -- inputs
    def step_started(self, role: str, now: float) -> None:
        self.launched[role] = now

    def apply(self, now: float, msg: dict) -> None:
        role, rank = msg.get("role"), msg.get("rank")
        if role not in self.ranks or not isinstance(rank, int) or not 0 <= rank < len(self.ranks[role]):
            return  # publish/lookup, or a rank this run does not have
        if role in self.alone or ((role, rank) in self.fresh and msg["type"] != "hello"):
            return  # the late words of a rank of the step being restarted alone, not of its new ranks
        self.fresh.discard((role, rank))
        r = self.ranks[role][rank]
        r.last, r.node = now, msg.get("node", r.node)
        kind = msg["type"]
        if kind == "hello":
            r.pid = msg["pid"]
            self._advance(r, "bootstrap")
        elif kind == "heartbeat":
            r.info.update(msg["info"] if isinstance(msg.get("info"), dict) else {})
            self._advance(r, msg["phase"])
            self._track_task(r, now)
        elif kind == "error":
            lines = [ln for ln in msg["traceback"].strip().splitlines() if ln.strip()]
            reason = msg.get("reason") if isinstance(msg.get("reason"), str) and msg["reason"].strip() else None
            verdict = msg.get("verdict")
            self.fail(role, rank, r.node, reason or (lines[-1].strip() if lines else "error (no message)"),
                      kind=verdict if verdict in (PERMANENT, NO_SPACE) else "role")
        self._refresh(role)

    def step_exited(self, role: str, code: int, hint: str = "") -> None:
        if role in self.exit_codes or role in self.alone:
            return
        self.exit_codes[role] = code
        self.doc["roles"][role]["exit_code"] = code
        self.dirty = True
        if code != 0:
            self.fail(role, None, None, f"step exited with code {code}{': ' + hint if hint else ''}")
        elif any(r.phase != "done" for r in self.ranks[role]):
            self.fail(role, None, None, "step ended before all its ranks reported done")

    def check_silence(self, now: float, timeout_s: float) -> None:
        for role, ranks in self.ranks.items():
            if role not in self.launched or role in self.exit_codes:
                continue
            for i, r in enumerate(ranks):
                since = r.last if r.last is not None else self.launched[role]
                if r.phase not in ("done", "failed") and now - since > timeout_s:
                    what = "no heartbeat" if r.last is not None else "never reported"
                    self.fail(role, i, r.node, f"{what} for {now - since:.0f}s (heartbeat_timeout_s={timeout_s:g})")
                    return
        self.check_hung(now)

    def check_hung(self, now: float) -> None:
        """Fail a role whose rank 0 holds a task that made no progress for ``task_timeout_s`` (0: never).

        A hung role still heartbeats (its heartbeat thread is fine), so silence never catches it; its task's
        progress counter does. A role with no task (idle, long-polling) is never hung. Called by
        :meth:`check_silence`, so the loop's tick covers both."""
        if self.task_timeout_s <= 0:
            return
        for role, ranks in self.ranks.items():
            r = ranks[0]
            if role not in self.launched or role in self.exit_codes or r.phase in ("done", "failed"):
                continue
            if r.task is not None and r.task_since is not None and now - r.task_since > self.task_timeout_s:
                self.fail(role, 0, r.node, self._hung_message(r, now))
                return

    def _hung_message(self, r: Rank, now: float) -> str:
        task = r.info.get("task") if isinstance(r.info.get("task"), dict) else {}
        at = f"step {task['step']}" if task.get("step") is not None else f"id {task.get('id')}"
        return (f"task {task.get('kind')} ({at}) made no progress for {now - r.task_since:.0f}s "
                f"(logging.task_timeout_s={self.task_timeout_s:g}); look at this rank's log for where it "
                f"hangs, or raise logging.task_timeout_s if the task is only slow (0 turns the check off)")

    @staticmethod
    def _track_task(r: Rank, now: float) -> None:
        """Note when the (task id, progress) pair of the task in hand last changed."""
        task = r.info.get("task")
        key = (task.get("id"), task.get("progress")) if isinstance(task, dict) else None
        if key != r.task or r.task_since is None:
            r.task, r.task_since = key, now

    # -- outcomes
    def fail(self, role: str, rank: int | None, node: str | None, message: str, kind: str = "role",
             alone: bool = True) -> None:
        """``role`` failed; ``alone``: the role's own process failed (died, silent, hung, its error), so it may be
        started again alone (role tier); False for a task's restartable error, which may lie elsewhere (a dead
        teacher engine seen by rollout's generate): every step restarts."""
        if role in self.alone:
            return  # being started again alone: what its old ranks say or do on the way out is no news
        if self.running and kind in ("role", "task", "controller"):
            kind, message = self._full_disk(kind, message)
        if self.running and kind == "role" and alone:
            message, alone = self._tier(role, message)
            if alone:
                self.alone[role] = Failure(role, rank, node, message, kind)
                self.recovering[role] = time.time()
                self.doc["last_failure"] = self.alone[role].reason()
                self.dirty = self.urgent = True
                return
        self.urgent = True
        if role in self.doc["roles"]:
            self.doc["roles"][role]["error"] = self.doc["roles"][role]["error"] or message
            self.doc["roles"][role]["phase"] = "failed"
            if rank is not None:
                self.ranks[role][rank].phase = "failed"
        if self.running:
            self.failure = Failure(role, rank, node, message, kind)
            self._finish(FAILED, self.failure.reason())
            self.doc["last_failure"] = self.failure.reason()
            self.doc["last_failure_at"] = time.time()
        self.dirty = True

    def _tier(self, role: str, message: str) -> tuple[str, bool]:
        """Which tier recovers from ``role``'s failure (kind ``role``): alone (True) or every step (False, the
        message then says why, when it is not the actor's)."""
        if role == "actor" or role not in self.steps:
            return message, False
        if self.max_alone <= 0:
            return f"{message} (health.max_role_restarts is 0: every step restarts)", False
        if role in self.members and _get(self.ranks[role][0].info, "cross_group", "ok") is not True:
            # the others may wait in the start's check for this role's old rank 0
            return message, False  # at the run's start: nothing to keep yet
        done = sum(self.alone_done.values())
        if done >= self.max_alone:
            return (f"{message} (restarted alone {done} time(s) in this try, health.max_role_restarts="
                    f"{self.max_alone}: every step restarts)"), False
        last = self.alone_at.get(role)
        if last is not None and time.time() - last < self.window_s:
            return (f"{message} (again {time.time() - last:.0f}s after its restart alone, within health.window_s="
                    f"{self.window_s:g}: every step restarts)"), False
        return message, True

    @property
    def _try(self) -> tuple[int, int]:
        return (int(self.doc["attempt"]), int(self.doc["restarts"]))

    def take_alone(self) -> dict[str, Failure]:
        """The roles to start again alone now (role tier), each with its failure; the loop starts them."""
        out, self.alone = self.alone, {}
        return out

    def restarted_alone(self, role: str, failure: Failure, now: float) -> None:
        """``role``'s step was started again alone: its ranks start anew (their old ones' late words are dropped
        until each new rank's hello), the failure is recorded with the role tier, the others go on."""
        old = self.ranks[role][0].info.get("cross_group")  # checked at the run's start; the new ranks do not rejoin
        self.ranks[role] = [Rank() for _ in self.ranks[role]]
        if old is not None:
            self.ranks[role][0].info["cross_group"] = old
        self.fresh |= {(role, i) for i in range(len(self.ranks[role]))}
        self.exit_codes.pop(role, None)
        self.launched[role] = self.alone_at[role] = now
        d = self.doc["roles"][role]
        d.update(phase="starting", ranks_ready=0, error=None, exit_code=None, last_heartbeat=None,
                 pids=[None] * len(self.ranks[role]), collective_ok=None)
        h = self.doc["health"]
        h["role_restarts"] += 1
        self.alone_done[role] = self.alone_done.get(role, 0) + 1
        n = sum(self.alone_done.values())
        h["recoveries"] = (h["recoveries"] + [{"tier": "role", "role": role, "why": failure.reason(),
                                               "at": self.recovering.get(role, now), "recovery_s": None,
                                               "try": list(self._try)}])[-MAX_RECOVERIES:]
        self.event("role_restarted", f"{failure.reason()}; {role} started again alone ({n}/{self.max_alone}), the "
                                     f"other roles and the engines go on")
        self._refresh(role)

    def recovered(self, role: str, now: float) -> None:
        """``role``, restarted alone, works again (its first task done; without a training loop: ready)."""
        if role in self.alone or any(r == role for r, _ in self.fresh):
            return  # not started again yet, or its new ranks not all up: what its old ranks did is no recovery
        since = self.recovering.pop(role, None)
        if since is None:
            return
        took = now - since
        for r in reversed(self.doc["health"]["recoveries"]):
            if r.get("tier") == "role" and r.get("role") == role and r.get("recovery_s") is None:
                r["recovery_s"] = round(took, 3)
                break
        self._unlogged_recovery += took
        self.event("role_recovered", f"{role} works again {took:.1f}s after its failure (role tier)")

    def restarting_all(self, now: float) -> None:
        """This try failed and every step restarts (global tier): remembered (in ``health.pending``, carried to the
        next try) until :meth:`recovered_all`."""
        h = self.doc["health"]
        f = self.failure
        h["global_restarts"] += 1
        h["pending"] = {"tier": "global", "role": f.role if f else None, "why": self.doc["reason"],
                        "at": self.doc.get("last_failure_at", now), "recovery_s": None}

    def recovered_all(self, now: float) -> None:
        """After a global restart: the training loop works again (the engines have the checkpoint's weights; without
        one: every role ready)."""
        h = self.doc["health"]
        p = h.get("pending")
        if not p:
            return
        took = now - float(p.get("at") or now)
        done = {**p, "recovery_s": round(took, 3), "try": list(self._try)}
        h["recoveries"] = (h["recoveries"] + [done])[-MAX_RECOVERIES:]
        h["pending"] = None
        self._unlogged_recovery += took
        log.info("every step restarted from the checkpoint; working again %.1fs after the failure (global tier)", took)

    def health_metrics(self) -> dict[str, float]:
        """``health/role_restarts`` (restarts of a role alone so far in the run) and, when a recovery ended since the
        last call, ``health/recovery_time`` (its seconds, summed): for the step's metrics row."""
        out = {"health/role_restarts": float(self.doc["health"]["role_restarts"])}
        if self._unlogged_recovery:
            out["health/recovery_time"] = self._unlogged_recovery
            self._unlogged_recovery = 0.0
        return out

    def _full_disk(self, kind: str, message: str) -> tuple[str, str]:
        """A failure seen while the run directory's filesystem is full is taken for the full disk's doing (a
        writer may have lost the errno, e.g. torch's "file write failed"): no restart, the mount point named."""
        free = free_bytes(self.run.path)
        if free is None or free >= FULL_BYTES or "no space left on" in message:
            return kind, message
        return NO_SPACE, f"{message}; {no_space_message(self.run, what=f'{free} bytes free')}"

    def out_of_space(self, error: BaseException, path: Any = None, role: str = "controller") -> None:
        """A write of the controller's failed for want of space (``error``): fail the run naming the disk (if it is
        still running); :meth:`write` puts that in ``state.json`` through the run directory's reserve."""
        log.error("no space left on %s (%s); the run fails, recorded in the run directory's reserve",
                  _mount(self.run.path), error)
        self.fail(role, None, None, no_space_reason(self.run, error, path), kind=NO_SPACE)

    def progress(self, **fields: Any) -> None:
        """Training progress for state.json (``step``, ``phase``, ``reward``, ``engines``, ...), written at once."""
        self.doc.update(fields)
        self.dirty = self.urgent = True

    def cancel(self, reason: str) -> None:
        if self.running:
            self._finish(CANCELLED, reason)

    def give_up(self, reason: str) -> None:
        """FAILED, whatever the state was (an attempt that ended REQUEUED but cannot come back)."""
        self._finish(FAILED, reason)
        self.doc["last_failure"] = reason

    def requeue(self, reason: str) -> None:
        if self.running:
            self._finish(REQUEUED, reason)

    def event(self, name: str, detail: str = "") -> None:
        """A line in ``state.json``'s ``events`` (what ``relax-status`` shows of the run's life)."""
        self.doc["events"] = (self.doc["events"] + [{"time": time.time(), "event": name, "detail": detail}])[-MAX_EVENTS:]
        self.dirty = self.urgent = True
        if self.on_event is not None:
            self.on_event(name, detail)

    def check_complete(self) -> None:
        if self.running and len(self.exit_codes) == len(self.ranks) and \
                all(d["phase"] == "done" for d in self.doc["roles"].values()):
            self._finish(COMPLETED, None)

    def _finish(self, state: str, reason: str | None) -> None:
        self.doc["state"], self.doc["reason"] = state, reason
        self.dirty = self.urgent = True

    # -- derived fields
    def _advance(self, r: Rank, phase: str) -> None:
        if ORDER.get(phase, -1) > ORDER[r.phase]:  # an unknown phase moves nothing
            r.phase = phase

    def _refresh(self, role: str) -> None:
        d, ranks = self.doc["roles"][role], self.ranks[role]
        before = (d["phase"], d["ranks_ready"], d["collective_ok"], self.doc["cross_group"]["ok"])
        phases = {r.phase for r in ranks}
        if d["phase"] != "failed":
            d["phase"] = ("done" if phases == {"done"} else
                          "ready" if phases <= {"ready", "done"} else
                          "bootstrap" if phases != {"starting"} else "starting")
        d["ranks_ready"] = sum(r.phase in ("ready", "done") for r in ranks)
        d["pids"] = [r.pid for r in ranks]
        gathered = ranks[0].info.get("nodes")
        ok_nodes = isinstance(gathered, list) and gathered and all(isinstance(n, str) for n in gathered)
        d["nodes"] = list(gathered) if ok_nodes else [r.node for r in ranks]
        oks = [_flag(r.info.get("collective_ok")) for r in ranks]
        d["collective_ok"] = None if None in oks else all(oks)
        heard = [r.last for r in ranks if r.last is not None]
        d["last_heartbeat"] = min(heard) if heard else None  # the stalest rank's: old means someone is silent
        cross = [_flag(_get(self.ranks[m][0].info, "cross_group", "ok")) for m in self.members if m in self.ranks]
        self.doc["cross_group"]["ok"] = None if None in cross else all(cross)
        if self.recover_on_ready and role in self.recovering and d["phase"] in ("ready", "done"):
            self.recovered(role, time.time())
        self.dirty = True
        self.urgent |= before != (d["phase"], d["ranks_ready"], d["collective_ok"], self.doc["cross_group"]["ok"])

    def write(self, now: float | None = None, every_s: float = 0.0) -> None:
        """Write ``state.json`` at once on a change of phase or state; heartbeat-only news at most every ``every_s``."""
        now = time.time() if now is None else now
        if self.dirty and (self.urgent or now - self._last_write >= every_s):
            self.doc["updated_at"] = now
            try:
                write_json(self.run.state, self.public())
            except OSError as e:
                if no_space(e) is None:
                    raise
                self.out_of_space(e, self.run.state)  # the failure in the doc, then in the reserve's blocks
                if not self.run.write_in_reserve(self.run.state, json_text(self.public())):
                    try:
                        write_json(self.run.state, self.public())
                    except OSError as again:  # no reserve left: the log says it, a later write tries again
                        log.error("could not write %s: %s", self.run.state, again)
                        return
            self.dirty, self.urgent, self._last_write = False, False, now


def _mount(path: Any) -> str:
    try:
        return str(mount_point(path))
    except OSError:
        return str(path)
