"""The controller's registry of inference engines: what each one is, where it lives, and whether it may serve.

Why a registry: requests, weight syncs, ``state.json`` and ``relax-status`` must agree on which engines exist
and which may take requests. One table, owned by the controller, is that agreement; the rollout role and the
actor get their engine lists from it with each task.

An engine is an :class:`Engine`: its name and URL, ``origin`` (``initial``: started with the run's rollout role;
``step`` and ``attached``: added later as a job step or an attached job, for elastic rollout; ``external``: started
by anyone, not the run's: it gets the weights from disk, never in the weight-sync group, :mod:`.external`), the
node, Slurm job and step it runs in, its ``weight_version`` (the step whose weights it serves; ``"0"``: the model on
disk) and its ``state``:

    starting → syncing → ready → draining → gone
         any state but gone → dead

- ``syncing``: up, but its weights are not yet the run's (a resumed run's engines serve the model on disk until
  the resume sync): no requests.
- ``ready``: takes requests. :meth:`EngineRegistry.routable` is the set a generate task gets: ready engines whose
  weight version is within the run's staleness bound of the trainer's.
- ``draining`` / ``gone``: leaving (scale-in, or its job's time limit is near) / left (drained, or its capacity
  went away: scancel, preemption, a dead node), with why; ``dead``: an engine of the run's own found dead (a failed
  request or sync), with the reason, until it is started again; neither gets anything any more.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

STATES = ("starting", "syncing", "ready", "draining", "gone", "dead")
ORIGINS = ("initial", "step", "attached", "external")
_NEXT = {"starting": {"syncing", "ready"}, "syncing": {"ready"}, "ready": {"syncing", "draining"},
         "draining": {"gone"}, "gone": set(), "dead": set()}


@dataclass
class Engine:
    name: str
    url: str
    origin: str = "initial"
    node: str | None = None
    pid: int | None = None
    job_id: str | None = None  # the Slurm job (the het job's id for a component), "local" without Slurm
    step_id: str | None = None
    state: str = "starting"
    weight_version: str | None = None
    dead: str | None = None  # why, once dead
    left: str | None = None  # why, once gone (drained, or its capacity went away)
    requests: int = 0  # generate requests it was sent (the rollout driver's count, per step)
    first_step: int | None = None  # the first rollout step it served, and the weight version it had been given
    first_version: str | None = None  # for it (within the staleness bound of that step, or it was not routable)
    restarts: int = 0  # how often it was started again after it died (rollout.engine.max_restarts bounds it)
    since: float = field(default_factory=time.time)  # when it entered its state

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EngineError(ValueError):
    """A registry change that breaks the state machine (a bug in the controller, never the user's)."""


class EngineRegistry:
    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}

    def add(self, name: str, url: str, *, origin: str = "initial", state: str = "starting", **where: Any) -> Engine:
        if origin not in ORIGINS:
            raise EngineError(f"engine {name}: origin {origin!r} is not one of {ORIGINS}")
        if name in self.engines and self.engines[name].state not in ("gone", "dead"):
            raise EngineError(f"engine {name} is registered already ({self.engines[name].state})")
        e = Engine(name, url, origin, **where)
        self.engines[name] = e
        if state != "starting":
            self.move(name, state)
        return e

    def move(self, name: str, state: str, *, version: str | None = None) -> Engine:
        """Engine ``name`` enters ``state`` (a :data:`STATES` transition), serving ``version`` if given."""
        e = self.engines[name]
        if state not in _NEXT.get(e.state, set()) and state != e.state:
            raise EngineError(f"engine {name}: {e.state} → {state} is not a transition of {STATES}")
        if state != e.state:
            e.state, e.since = state, time.time()
        if version is not None:
            e.weight_version = str(version)
        return e

    def mark_dead(self, name: str, why: str) -> bool:
        """Declare ``name`` dead with ``why``; False if it was dead or gone already."""
        e = self.engines.get(name)
        if e is None or e.state in ("dead", "gone"):
            return False
        e.state, e.dead, e.since = "dead", why, time.time()
        return True

    def gone(self, name: str, why: str) -> bool:
        """``name`` left the run (drained, or its job step or attached job ended): gone from any live state;
        False if it was gone or dead already."""
        e = self.engines.get(name)
        if e is None or e.state in ("dead", "gone"):
            return False
        e.state, e.left, e.since = "gone", why, time.time()
        return True

    def synced(self, versions: dict[str, str | None]) -> None:
        """After a sync: each engine's version as it reported it; a syncing engine with a version is ready."""
        for name, v in versions.items():
            e = self.engines.get(name)
            if e is None or e.state in ("dead", "gone"):
                continue
            if v is not None:
                e.weight_version = str(v)
            if e.state == "syncing" and v is not None:
                self.move(name, "ready")

    def live(self) -> dict[str, str]:
        """Engines a weight sync goes to: every one not dead, gone or draining ``{name: url}``, but the external ones
        (they load the weights from disk, outside the group)."""
        return {n: e.url for n, e in self.engines.items()
                if e.state in ("starting", "syncing", "ready") and e.origin != "external"}

    def nodes(self, names: dict[str, str] | list[str]) -> dict[str, str]:
        """The node each of ``names`` runs on ``{name: node}`` (those with one): the actor's ranks on that node send
        it its weights in multi-node colocate (:func:`relax_hpc.weights.push.plan_nodes`)."""
        return {n: self.engines[n].node for n in names if n in self.engines and self.engines[n].node}

    def routable(self, min_version: int | None = None, max_version: int | None = None) -> dict[str, str]:
        """Engines a generate task may send requests to: ready, and serving at least step ``min_version``'s weights
        (and at most ``max_version``'s: fixed staleness), when given."""
        def fresh(e: Engine) -> bool:
            if min_version is None and max_version is None:
                return True
            if e.weight_version is None or not e.weight_version.isdigit():
                return False
            v = int(e.weight_version)
            return (min_version is None or v >= min_version) and (max_version is None or v <= max_version)
        return {n: e.url for n, e in self.engines.items() if e.state == "ready" and fresh(e)}

    def count(self, *states: str) -> int:
        return sum(1 for e in self.engines.values() if e.state in states)

    def to_state(self) -> dict[str, dict]:
        """``state.json``'s ``engines``: ``{name: Engine fields}`` (``url``, ``pid``, ``node`` and ``dead`` as before)."""
        return {n: e.to_dict() for n, e in self.engines.items()}
