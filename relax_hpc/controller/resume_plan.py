"""Where an attempt starts: from ``checkpoints/latest`` (step K) or from scratch, and which steps after K it keeps.

Read once, before the loop's first task (:func:`plan_resume`): the checkpoint's directory (the actor loads it in
``connect``), its step K, the data cursor saved with it (rollout's first ``generate`` starts there), and, with
``staleness_mode: fixed``, the steps K+1..G generated before the checkpoint on weights older than K's, which a
resume no longer has: they are kept and trained, not generated again (``extra_state["kept"]``, written by the
loop's checkpoint), but only while the exchange holds them whole and untrained. :meth:`ResumePlan.rewind` then voids
the exchange's partitions after G (an earlier attempt's steps after its last checkpoint: produced again) and hands
out again the leases that attempt left open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.controller.state import RunState
from relax_hpc.exchange.broker import Broker, ExchangeError
from relax_hpc.train.latest import read_latest, run_step

log = logging.getLogger("relax_hpc.controller")


@dataclass(frozen=True)
class ResumePlan:
    path: str | None  # the checkpoint's directory; None: a fresh start
    step: int  # K: the checkpoint's step (0: a fresh start)
    generated: int  # G: the steps generated so far (K, or the last one kept)
    data: dict | None  # the data cursor after step K
    kept: dict[str, Any] | None = None  # fixed: {"generated": G, "data": cursor after G, "metrics": {"n": row}}
    unfixed_upto: int = 0  # fixed: the steps up to this one are generated on step K's weights (older ones are gone)

    @property
    def checkpoint(self) -> int | None:
        """The step of the checkpoint resumed from (None: a fresh start)."""
        return self.step if self.path is not None else None

    def kept_rows(self) -> dict[int, dict[str, float]]:
        """The kept steps' generate metrics (they came with the checkpoint), by step."""
        if not self.kept:
            return {}
        return {n: {key: float(v) for key, v in self.kept["metrics"][str(n)].items()}
                for n in range(self.step + 1, self.generated + 1)}

    def rewind(self, broker: Broker) -> None:
        """The exchange as of G: later partitions voided (produced again), an earlier attempt's leases (a kept step's)
        handed out again."""
        if broker.rewind(self.generated):  # steps an earlier attempt did after its last checkpoint
            log.info("exchange: partitions after step %d voided; they are produced again", self.generated)
        for lease in broker.outstanding():
            broker.release(lease.id, "an earlier attempt")


def plan_resume(run_path: Path, broker: Broker, state: RunState, *, fixed: bool, max_staleness: int,
                total: int) -> ResumePlan:
    """The plan for this attempt; ``fixed``: ``staleness_mode: fixed`` is in effect (``max_staleness`` > 0)."""
    latest = read_latest(run_path / "checkpoints")
    if not latest:
        return ResumePlan(path=None, step=0, generated=0, data=None)
    k = run_step(latest[1])
    extra = latest[1].get("extra_state") or {}
    kept = extra.get("kept") if fixed else None
    if kept and not _keepable(broker, state, k, int(kept["generated"])):
        kept = None
    g = int(kept["generated"]) if kept else k
    # fixed, resumed without the steps generated before the checkpoint: those are made on step k's weights
    unfixed_upto = min(k + max_staleness, total) if fixed and k else 0
    if unfixed_upto <= g:  # every step that needed older weights was kept
        unfixed_upto = 0
    return ResumePlan(path=str(latest[0]), step=k, generated=g, data=extra.get("data"), kept=kept,
                      unfixed_upto=unfixed_upto)


def _keepable(broker: Broker, state: RunState, k: int, g: int) -> bool:
    """Whether steps k+1..g are in the exchange, whole and untrained. Not so when the earlier attempt trained one
    after the checkpoint and then crashed: those steps are generated again, on step k's weights (the trajectory
    leaves that of the run uninterrupted; a stop with a checkpoint, a requeue, never gets here)."""
    try:
        ok = all((p := broker.progress("train", n)).get("ended") and not p["cleared"] for n in range(k + 1, g + 1))
    except ExchangeError:
        ok = False
    if not ok:
        log.warning("staleness_mode fixed: steps %d-%d, generated before the checkpoint of step %d, were trained "
                    "(or lost) after it; they are generated again on step %d's weights", k + 1, g, k, k)
        state.event("fixed_staleness_broken", f"steps {k + 1}-{g} generated again on step {k}'s weights")
    return ok
