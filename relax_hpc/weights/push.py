"""The actor's side of one weight sync: push to the engines and followers, check, push again without an engine
that left mid-push, and the verdict (``docs/weights.md``).

:class:`ActorSync` holds what lasts between syncs: rank 0's :class:`~relax_hpc.weights.sync.WeightSender` and its
group, the engines and followers in it ({name: url}) and an :class:`~relax_hpc.weights.check.EngineChecker`.
:meth:`ActorSync.sync` is collective over the actor's ranks (each walks the bridge's gather):

1. rank 0 leaves out the engines that no longer answer ``/health`` (died after their last request), on every rank;
2. every rank walks the stream (:func:`~relax_hpc.weights.sync.push_from_actor`) and each sending rank pushes, after
   a new group if the engine set changed; rank 0 keeps the first :data:`~relax_hpc.weights.check.ROWS` rows of every
   tensor;
3. after a failed push each sending rank that failed looks which of its engines are gone (again after 2 s if none),
   and every rank gets the same verdict from all of them: done, again without those (at most :data:`SYNC_TRIES`
   pushes), or failed (none gone: a retry would change nothing);
4. a barrier; then rank 0 checks each member's spot fingerprint and version (``check``: the recipe's
   ``logging.check_weight_sync``); an engine that no longer answers then is reported dead, not a failed sync.

With engines on the actor's GPU (the sender's tensor path; ``rollout.engine.offload``) they hand their memory over:
:meth:`ActorSync.release` before the actor trains, and step 1 of the next sync resumes them first.

On several actor nodes (multi-node colocate) each node's engines get their weights on their own node: the bridge's
export gives every rank every full tensor (TP all-gathered, PP broadcast), so the first actor rank of each node (its
leader, :func:`plan_nodes`) holds a sender of its own for the engines the controller placed on that node (``nodes``:
{engine: node}), and releases and resumes them; rank 0 keeps the others (its own node's, engines on nodes of their
own, the followers). Every leader pushes the same stream at once; the sync is done when every leader's is (the
verdict is gathered from every rank), and rank 0 checks every engine.

Behind the next train (``train.overlap_sync``): :func:`take_snapshot` packs the export into host buckets (collective
walk, rank 0 keeps them), and :class:`BackgroundPush` runs a solo :meth:`ActorSync.sync` of that :class:`Snapshot`
(rank 0 alone, no collective: only where rank 0 sends to every member, :meth:`ActorSync.solo_ok`) in a thread while
the actor trains on; each bucket goes out as it lies in the snapshot.

With ``freeze_vision`` (``model.freeze_vision``: the actor does not train a VLM's vision tower) the vision tower's
tensors (:func:`vision_weight`) are left out of every push: the engines keep the ones they loaded, which are the
actor's too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from relax_hpc.engines import bucket_wire
from relax_hpc.threads import daemon_call
from relax_hpc.weights.buckets import DEFAULT_BUCKET_BYTES, Bucket, PackedBuckets
from relax_hpc.weights.check import ROWS, EngineChecker
from relax_hpc.weights.lora import sync_weights
from relax_hpc.weights.sync import WeightSender, WeightSyncError, WeightSyncRefused, push_from_actor

# the HF names of a vision-language model's vision tower: Qwen2-VL/2.5-VL's checkpoints (and the bridge's export)
# say visual.*, transformers 4.57's modules (and Qwen3-VL's checkpoints) model.visual.*
VISION_PREFIXES = ("visual.", "model.visual.")
SYNC_TRIES = 3  # pushes of one sync: an engine that leaves mid-push (scancel, preemption) costs one more
log = logging.getLogger("relax_hpc.actor")  # the actor role's log: its lines kept their logger when they moved here


@dataclass
class Synced:
    """One sync's verdict, the fields of the controller's ``SyncResult``; ranks other than 0 fill only ``metrics``."""

    metrics: dict[str, Any]
    engine_versions: dict[str, str | None] = field(default_factory=dict)  # the version each engine reports
    checks: dict[str, dict] = field(default_factory=dict)  # per engine: the spot fingerprint check
    dead_engines: dict[str, str] = field(default_factory=dict)  # found dead at the sync: {name: why}
    follower_versions: dict[str, str | None] = field(default_factory=dict)  # {role: the version it holds}


def plan_nodes(rank_nodes: Sequence[str], engines: dict[str, str], nodes: dict[str, str]) -> dict[int, dict[str, str]]:
    """Which actor rank sends to which engines ({rank: {name: url}}): an engine the controller placed on an actor node
    (``nodes``: {name: node}; ``rank_nodes``: each actor rank's node) gets its weights from that node's first rank, which
    holds every full tensor as rank 0 does; every other engine (on rank 0's node, on nodes of its own, or of no known
    node) from rank 0, as on one node."""
    leaders: dict[str, int] = {}
    for rank, node in enumerate(rank_nodes):
        leaders.setdefault(node, rank)
    out: dict[int, dict[str, str]] = {}
    for name, url in engines.items():
        out.setdefault(leaders.get(nodes.get(name, ""), 0), {})[name] = url
    return out


class ActorSync:
    """The actor's weight-sync group and its syncs. ``backend``: the group's (``"nccl"``, ``"gloo"``, or None: one
    every member serves); ``api_key``: the run's engine key; ``address``: rank 0's address for the engines, asked at
    the first connect. ``offload`` (``rollout.engine.offload``): the engines hand their GPU memory over while the
    actor trains (:meth:`release`; the sync takes it back first) and get the weights by ``/update_weights_from_tensor``;
    None: when they share the actor's GPU (the sender's path); False: never. ``freeze_vision``
    (``model.freeze_vision``): the vision tower's tensors are not pushed (the actor does not train them). ``node``: this
    rank's node (the engines on it get their weights from its first rank: :func:`plan_nodes`); None: every engine
    from rank 0."""

    def __init__(self, rank: int, backend: str | None, api_key: str | None, address: Callable[[], str], *,
                 offload: bool | None = None, freeze_vision: bool = False, node: str | None = None):
        self.rank, self.backend, self.api_key, self.address = rank, backend, api_key, address
        self.node = node
        self.rank_nodes: list[str] | None = None  # every actor rank's node, gathered at the first connect
        self.nodes: dict[str, str] = {}  # each engine's node, as the controller placed it {name: node}
        self.plan: dict[int, dict[str, str]] = {}  # which rank sends to which engines (plan_nodes)
        self.mine: dict[str, str] = {}  # the engines this rank sends to (its node's, as leader; rank 0: the rest)
        self.offload = offload
        self.freeze_vision = freeze_vision
        self.sender: WeightSender | None = None  # a sending rank's (rank 0, a node's leader), once connected
        self.engines: dict[str, str] = {}  # the weight-sync group's engines {name: url}
        self.followers: dict[str, str] = {}  # forward roles that get every sync too {role: url}
        self.checker = EngineChecker(api_key)
        self.released: dict[str, str] = {}  # engines whose memory is handed over to the actor now {name: url}

    @property
    def hands_over(self) -> bool:
        """Whether the engines give their memory up while the actor trains (each sending rank knows, for its own
        engines, once connected)."""
        return self.sender is not None and self.sender.path == "tensor"

    def connect(self, engines: dict[str, str], followers: dict[str, str], nodes: dict[str, str] | None = None, *,
                solo: bool = False) -> None:
        """Every rank (collective): these are the members now (``nodes``: each engine's node, kept from the last call
        when None); each sending rank builds its group (a new one if its set changed: a group's size is fixed). A
        failure on any rank raises on every rank. ``solo``: rank 0 alone, after the first call (a solo sync)."""
        self.engines, self.followers = dict(engines), dict(followers)
        if nodes is not None:
            self.nodes = dict(nodes)
        if self.rank_nodes is None:  # the ranks stay where they are: asked once
            self.rank_nodes = _gathered(self.node or "")
        self.plan = plan_nodes(self.rank_nodes, self.engines, self.nodes)
        self.mine = self.plan.get(self.rank, {})
        members = [*self.mine.values(), *(self.followers.values() if self.rank == 0 else ())]
        err: BaseException | None = None
        try:
            if not members:  # nothing to send from here (any more)
                if self.sender is not None:
                    self.sender.close()
                    self.sender = None
            elif self.sender is None:
                path = None if self.offload is None else "tensor" if self.offload else "distributed"
                self.sender = WeightSender(backend=self.backend, api_key=self.api_key, path=path)
                self.sender.connect(members, self.address())
            else:  # the engine set changed (an engine died)
                self.sender.reconnect(members)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it (below), or the others wait in a collective
            err = e
        _agreed(err, "connecting the weight sync", solo)
        # an engine still released by an actor before this one (restarted mid-step) takes its memory back at the
        # next sync, before the weights come
        if self.sender is not None:
            self.released.update({n: u for n, u in self.mine.items()
                                  if (self.sender.infos.get(u) or {}).get("memory_released")})

    def close(self) -> None:
        self.checker.close()
        if self.sender is not None:  # the engines are going away too: leave without asking them
            self.sender.close(destroy_on_engines=False)

    def route(self) -> str:
        """How the weights travel, in words (rank 0; others ""): for the run's events and the user."""
        s = self.sender
        if self.rank != 0:
            return ""
        if s is None:
            how = "from their nodes' actor ranks"
        elif s.path == "tensor":
            how = (f"to {len(s.engines)} engine(s) on the actor's {s.device.type.upper()} by /update_weights_from_tensor "
                   f"({'CUDA IPC' if s.device.type == 'cuda' else 'shared memory'}); they hand their memory over while "
                   "the actor trains (rollout.engine.offload)")
        else:
            how = f"to {len(s.engines)} member(s) over a {s.backend} group, sent from {s.device.type.upper()} memory"
        if len(self.plan) > 1 or any(r != 0 for r in self.plan):  # several nodes: who sends to whom
            how += "; per node: " + "; ".join(
                f"{(self.rank_nodes or [''])[r] or '?'} <- actor rank {r}: {', '.join(sorted(e))}"
                for r, e in sorted(self.plan.items()))
        return how

    def solo_ok(self, engines: dict[str, str] | None = None, nodes: dict[str, str] | None = None) -> bool:
        """Whether rank 0 alone sends to every member of a sync to ``engines`` (default: the group's) placed on
        ``nodes`` (added to those known): what a solo sync (:meth:`sync`) needs. The same on every rank."""
        plan = plan_nodes(self.rank_nodes or [self.node or ""], dict(engines or self.engines),
                          {**self.nodes, **(nodes or {})})
        return set(plan) <= {0}

    def release(self) -> dict[str, float]:
        """Each sending rank (rank 0; a node's leader: its node's engines), before the actor trains, when the engines
        hand over (:attr:`hands_over`): each engine releases its weights and KV cache (``/release_memory_occupation``;
        generation is done in colocate mode), so the actor has the GPU. Returns ``perf/engine_release_time``; other
        ranks and other runs get ``{}``."""
        if not self.hands_over or self.released:
            return {}
        t0 = time.monotonic()
        failed = self._on_engines(self.mine, "release_memory_occupation")
        for n, e in failed.items():  # still busy or gone: it keeps its memory this step (the actor may run short)
            log.warning("engine %s (%s) did not release its memory before training: %s", n, self.mine[n], e)
        self.released = {n: u for n, u in self.mine.items() if n not in failed}
        return {"perf/engine_release_time": time.monotonic() - t0}

    def resume(self, alive: dict[str, str]) -> dict[str, float]:
        """Each sending rank, before a push: its released engines still alive take their memory back (the actor's
        cached blocks are returned to the GPU first). Their weights are undefined until the push that follows."""
        back = {n: u for n, u in self.released.items() if n in alive}
        self.released = {}
        if not back:
            return {}
        t0 = time.monotonic()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        failed = self._on_engines(back, "resume_memory_occupation")
        if failed:  # an engine without its memory cannot take the weights nor generate
            raise WeightSyncError("/resume_memory_occupation failed on " + "; ".join(
                f"{n} ({back[n]}): {e}" for n, e in failed.items()), [back[n] for n in failed])
        return {"perf/engine_resume_time": time.monotonic() - t0}

    def _on_engines(self, engines: dict[str, str], call: str) -> dict[str, BaseException]:
        """``call`` on every engine at once (its memory hand-over); the engines it failed on, with why."""
        clients = {n: self.checker.client(u) for n, u in engines.items()}
        futs = {n: daemon_call(getattr(c, call), thread_name=f"weight-{call}") for n, c in clients.items()}
        wait(list(futs.values()))
        return {n: f.exception() for n, f in futs.items() if f.exception() is not None}

    def sync(self, version: str, engines: dict[str, str] | None, model: Any, *, progress: Callable[[], None],
             check: bool, nodes: dict[str, str] | None = None, solo: bool = False) -> Synced:
        """Every rank: push ``model``'s weights (``named_hf_weights()``, a collective; ``in_place()``) as
        ``version`` to ``engines`` (default: the group's; ``nodes``: where each is) and the followers, check them on
        rank 0 with ``check``. ``progress`` is called once per tensor. Raises :class:`WeightSyncError` when the push
        fails for good. ``solo``: rank 0 alone, no collective (a :class:`Snapshot` pushed behind the next train by
        :class:`BackgroundPush`; only where rank 0 sends to every member, :meth:`solo_ok`)."""
        t0 = time.monotonic()
        engines = dict(engines or self.engines)
        if nodes:
            self.nodes.update(nodes)
        # died after its last request: left out, on every rank alike (rank 0 looks; the ranks re-plan the same way)
        dead = _from_rank0(self.checker.unreachable(engines) if self.rank == 0 else {}, solo)
        resumed, err = {}, None
        try:  # each sending rank resumes its own engines
            resumed = self.resume({n: u for n, u in engines.items() if n not in dead})
        except WeightSyncError as e:
            err = e
        _agreed(err, "resuming the engines' memory", solo)
        out, engines, heads = self._push(version, engines, dead, model, progress, solo)
        out.update(resumed)
        if not solo:
            dist.barrier()
        out["perf/weight_sync_time"] = time.monotonic() - t0
        if self.rank != 0:
            return Synced(metrics=out)
        return self._checked(version, engines, dead, heads, out, check)

    def _push(self, version: str, engines: dict[str, str], dead: dict[str, str], model: Any,
              progress: Callable[[], None], solo: bool = False) -> tuple[dict, dict, dict]:
        """Every rank: push the weights to ``engines`` less ``dead``; an engine that dies during the push is added
        to ``dead`` and the push goes again to the others, up to ``SYNC_TRIES`` times. (The sender's metrics, the
        engines pushed to, and rank 0's first rows of every tensor for the check.)"""
        heads: dict[str, Any] = {}

        def stream():  # every rank walks the collective gather; rank 0 keeps each tensor's first rows
            for name, t in sync_weights(model):  # LoRA's adapter mode: the adapters only (weights/lora.py)
                if self.freeze_vision and vision_weight(name):  # unchanged since the engines loaded it
                    continue
                if self.rank == 0:
                    heads[name] = t[:ROWS].detach().clone()
                progress()
                yield name, t

        for attempt in range(1, SYNC_TRIES + 1):
            engines = {n: u for n, u in engines.items() if n not in dead}
            if not engines:
                raise WeightSyncError(f"no rollout engine left to sync: {dead}")
            # an engine died, joined or left since the last sync (rank 0's view: a solo push changed only its own)
            if _from_rank0(engines != self.engines, solo):
                self.connect(engines, self.followers, solo=solo)
            err: WeightSyncError | None = None
            out: dict[str, Any] = {}
            try:  # every sending rank pushes to its own engines (rank 0: and the followers)
                if isinstance(model, Snapshot):  # rank 0 alone: the buckets as they lie, no walk over the tensors
                    heads.update(model.heads)
                    progress()
                    out = dict(push_from_actor(model.buckets, self.sender, version))
                else:
                    out = dict(push_from_actor(stream(), self.sender, version, in_place=model.in_place()))
            except WeightSyncError as e:
                err = e
            # every rank the same verdict, from every sending rank's: done, again without the engines that are gone
            # now (each looks at its own), or failed
            # (rank 0 looks at the followers too: actor_fwd restarted alone is a follower gone, not a failed sync)
            looked = {**(self.mine or engines), **(self.followers if self.rank == 0 else {})}
            said = _gathered(None if err is None else (str(err), _gone(self.checker, looked)), solo)
            failed = [v for v in said if v is not None]
            if not failed:
                return out, engines, heads
            why = "; ".join(w for w, _ in failed)
            lost = {n: y for _, gone in failed for n, y in gone.items()}
            if not lost or attempt == SYNC_TRIES:
                raise err if err is not None else WeightSyncError(why)
            log.warning("step sync %s: %s left during the push (%s); pushing again to the others", version,
                        ", ".join(sorted(lost)), why)
            left = {f for f in lost if f in self.followers}  # a follower gone: the controller re-follows its new ranks
            if left:
                self.connect({n: u for n, u in engines.items() if n not in lost},
                             {f: u for f, u in self.followers.items() if f not in left}, solo=solo)
            dead.update({n: y for n, y in lost.items() if n not in left})
        raise AssertionError("unreachable: the last try returns or raises")

    def _checked(self, version: str, engines: dict[str, str], dead: dict[str, str], heads: dict,
                 out: dict[str, Any], check: bool) -> Synced:
        """Rank 0, after the push: each engine's and follower's spot fingerprint and version (with ``check``),
        and the engines that left right after it."""
        followers = self.followers
        checks = self.checker.check({**engines, **followers}, heads, version) if check else {}
        fchecks = {f: checks.pop(f) for f in followers if f in checks}
        held = {f: fchecks[f].get("version") if f in fchecks else version for f in followers}
        for name in [n for n, c in checks.items() if "unreachable" in c]:  # left right after the push
            dead[name] = checks.pop(name)["unreachable"]
            engines.pop(name)
        every = [c for c in (*checks.values(), *fchecks.values()) if "unreachable" not in c]
        if every:  # the followers' weights are checked like the engines'
            out["weights/fingerprint_match"] = float(all(c["fingerprint_equal"] for c in every))
            out["weights/engine_max_abs_diff"] = max(c["max_abs_diff"] for c in every)
            out["weights/versions_ok"] = float(all(c["version_ok"] for c in every))
        # the versions the engines report (the check asks them); unchecked, the version every engine of the push got
        versions = {n: c["version"] for n, c in checks.items()} if checks else {n: version for n in engines}
        return Synced(metrics=out, engine_versions=versions, checks=checks, dead_engines=dead,
                      follower_versions=held)


def _gathered(mine: Any, solo: bool = False) -> list[Any]:
    """Every actor rank's ``mine``, in rank order (a collective; ``[mine]`` with one rank, or ``solo``)."""
    if solo or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _from_rank0(value: Any, solo: bool = False) -> Any:
    """Rank 0's ``value`` on every rank (a collective; ``value`` itself with one rank, or ``solo``)."""
    if solo or not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agreed(err: BaseException | None, what: str, solo: bool = False) -> None:
    """Every rank raises when one did (a collective): the ranks go on together or not at all. The rank's own error
    where it has one, else a :class:`WeightSyncError` with what every failing rank said (and its engines): a
    :class:`WeightSyncRefused` when one of them was refused (a restart would meet the same members)."""
    said = _gathered(None if err is None else (str(err), list(getattr(err, "engines", [])),
                                               bool(getattr(err, "restartable", True))), solo)
    failed = [(r, v) for r, v in enumerate(said) if v is not None]
    if not failed:
        return
    if err is not None:
        raise err
    kind = WeightSyncError if all(again for _, (_, _, again) in failed) else WeightSyncRefused
    raise kind(f"{what} failed on actor rank(s) {', '.join(str(r) for r, _ in failed)}: "
               + "; ".join(w for _, (w, _, _) in failed), [u for _, (_, us, _) in failed for u in us])


def vision_weight(name: str) -> bool:
    """Whether the HF tensor ``name`` belongs to a vision-language model's vision tower."""
    return name.startswith(VISION_PREFIXES)


def _gone(checker: EngineChecker, engines: dict[str, str], settle_s: float = 2.0) -> dict[str, str]:
    """The engines that no longer answer after a failed push; a second look after ``settle_s`` catches one that
    was signalled and is still exiting (a failure with every engine answering fails the sync)."""
    lost = checker.unreachable(engines)
    if not lost:
        time.sleep(settle_s)
        lost = checker.unreachable(engines)
    return lost


# ------------------------------------------------------------------ the push behind the next train (train.overlap_sync)

class Snapshot:
    """Step N's exported weights, packed into the buckets the push sends (host memory), for a push that runs while step
    N+1 trains: the copy the overlap needs anyway is the pack copy, so the push sends each bucket as it lies (one
    broadcast of a ready buffer per bucket, as a raw broadcast of the same bytes), cut once here, off the push's path.
    Stands in for the model in :meth:`ActorSync.sync`. ``named``: the tensors, views of the buckets; ``heads``: the
    first rows of each, for the check (views too: nothing writes a snapshot)."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = PackedBuckets(buckets)
        self.named = [nt for b in buckets for nt in b.unpack()]
        self.heads = {n: t[:ROWS] for n, t in self.named}
        self.nbytes = sum(b.nbytes for b in buckets)

    @property
    def flats(self) -> list[torch.Tensor]:
        return [b.flat for b in self.buckets]

    def named_hf_weights(self):
        return iter(self.named)


def take_snapshot(model: Any, rank: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, freeze_vision: bool = False,
                  progress: Callable[[], None] = lambda: None) -> Snapshot | None:
    """Every rank (collective: the bridge's gather): walk what a sync sends of ``model``; rank 0 packs it into
    buckets of at most ``bucket_bytes`` per dtype (a larger tensor alone), as the sender would, each a fresh buffer
    moved to host memory (others: None). Without the copy the push would read parameters the next train updates."""
    buckets: list[Bucket] = []
    open_: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    size: dict[torch.dtype, int] = {}

    def flush(items: list[tuple[str, torch.Tensor]]) -> None:
        total = sum(t.numel() for _, t in items)
        flat, meta = bucket_wire.pack(items, out=torch.empty(total, dtype=items[0][1].dtype, device=items[0][1].device))
        flat = flat.cpu() if flat.device.type != "cpu" else flat  # a fresh buffer (out=): never the parameters
        buckets.append(Bucket(flat, meta, in_place=True))

    for name, t in sync_weights(model):
        progress()
        if rank != 0 or (freeze_vision and vision_weight(name)):
            continue
        nb, d = t.numel() * t.element_size(), t.dtype
        if d in open_ and size[d] + nb > bucket_bytes:
            flush(open_.pop(d))
            del size[d]
        open_.setdefault(d, []).append((name, t.detach()))
        size[d] = size.get(d, 0) + nb
    for items in open_.values():
        flush(items)
    return Snapshot(buckets) if rank == 0 else None


class BackgroundPush:
    """Rank 0's one push in flight behind the actor's next train: ``start(fn, report)`` runs ``fn()`` (the sync of a
    :class:`Snapshot`, solo) in a thread and hands its outcome to ``report(outcome, seconds)`` there, the moment it
    lands: ``("ok", value)`` or ``("error", exception)``. :meth:`wait` joins it (every task that uses the sender or
    stops the actor calls it first) and raises the push's error, so nothing goes on from engines in doubt. At most one
    push at a time: the next sync waits for this one, so the engines' version only rises."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn: Callable[[], Any], report: Callable[[tuple[str, Any], float], None]) -> None:
        self.wait()

        def run() -> None:
            t0 = time.monotonic()
            try:
                outcome: tuple[str, Any] = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - reported to the controller, raised again by wait()
                self._error = e
                outcome = ("error", e)
            try:
                report(outcome, time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - the controller never heard: the actor must fail
                log.error("could not report the weight push's landing: %s", e)
                self._error = self._error or e

        self._thread = threading.Thread(target=run, name="weight-push-behind", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise WeightSyncError(f"the weight push behind the last train failed: {type(err).__name__}: {err}") from err
