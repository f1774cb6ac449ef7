"""Engines from anywhere: a running engine (SGLang, or relax_hpc's reference engine) that somebody else started
serves a run (docs/elastic.md, "External engines").

Why a part of its own: the run does not own such an engine. It never joins the actor's weight-sync group (it may
be across a network no NCCL or gloo group crosses), it is never stopped or killed, and it has a key of its own.
So, unlike the engines :mod:`.elastic` starts:

- **Joining.** ``relax-scale RUN --attach-url URL --key-file FILE`` (or ``rollout.external_engines`` in the
  recipe, joined once the run's own engines are up) asks the controller, which reads the key (mode 0600,
  :func:`~relax_hpc.engines.keys.read_key_file`), asks the engine ``/model_info`` with it, and registers it
  (origin ``external``, named ``ext0``, ``ext1`` …) as ``syncing``.
- **Weights, without a group.** While any external engine is registered, every sync of the actor also writes the
  step's weights as an HF directory, ``RUN_DIR/weights/step-N`` (:meth:`External.snapshot_for`). Once the sync is
  done each external engine loads it with ``/update_weights_from_disk`` tagged ``N`` (SGLang's and the reference
  engine's call), in a thread of its own; the version it then reports must be ``N``, or it is dropped with both
  versions named. Only then is its registered version ``N``, which is what the staleness gate routes by.
  A new run's engine first loads ``model.path`` as version 0 when no step was synced yet.
- **Keys.** ``RUN_DIR/external_engines.json`` (mode 0600) maps each live external engine's URL to its key file
  and the weight versions sent to it; the rollout role reads it, sends each engine its own key, and checks every
  answer's weight version against the versions sent (:func:`relax_hpc.engines.pool.as_client`).
- **Leaving.** Drained on request (``relax-scale RUN --drain URL``) and at the end of the run: no new requests,
  then ``gone`` with why, still running. One that stops answering ``/health`` twice in a row, or that a
  request or load finds dead, is dropped (``gone``, with the reason); the run goes on with the others.
- **Requeue, resume, restart.** The engines attached with ``relax-scale`` and still there at the end of an attempt
  are in ``state.json`` (``attached_engines``: url, key file, who attached it; never the key itself). The next
  attempt (a requeue, ``relax-submit --resume``, a restart of every step) attaches them again once its own engines are
  up, as ``rollout.external_engines``: each is probed with its key file and loads the weights from disk; one that is
  not reachable (or whose key file is gone) is dropped, with the reason in an ``engine_external`` event
  (``relax-status``) and the log. At the end of an attempt they are drained, never stopped: the run does not own
  them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.rollout import external as X
from relax_hpc.rundir import RunDir

log = logging.getLogger("relax_hpc.controller")
HEALTH_EVERY_S = 5.0  # how often each external engine's /health is asked
HEALTH_MISSES = 2  # unanswered /health in a row: dropped
KEEP_SNAPSHOTS = 2  # the newest step-N directories kept (one may be loading while the next is written)
SENT_KEPT = 8  # versions per engine listed as sent (answers carry one of those)


def external_file(run: RunDir) -> Path:
    """``RUN_DIR/external_engines.json``: the live external engines, for the rollout role."""
    return run.path / "external_engines.json"


class External:
    """The run's external engines. Called from the controller's loop only (:class:`~.elastic.Elastic` owns it);
    the engines' HTTP calls run in threads whose outcomes :meth:`tick` applies."""

    def __init__(self, run: RunDir, registry: EngineRegistry, *, model_path: str, event: Callable[[str, str], None],
                 on_change: Callable[[], None], configured: list[dict] | None = None,
                 attached: list[dict] | None = None, persist: Callable[[list[dict]], None] | None = None):
        """``attached``: the engines an earlier attempt had attached with relax-scale (``state.json``'s
        ``attached_engines``), joined again like ``configured``; ``persist(list)`` keeps that list in the state."""
        self.run, self.registry, self.model_path = run, registry, model_path
        self.event, self.on_change = event, on_change
        # rollout.external_engines, then the earlier attempt's attached engines: joined once the run's engines are up
        self.configured = list(configured or []) + [{**a, "again": True} for a in attached or []
                                                     if isinstance(a, dict) and {"url", "key_file"} <= set(a)]
        self.persist = persist or (lambda attached: None)
        self.attached: dict[str, dict] = {}  # engine → {url, key_file, by}: attached with relax-scale (persisted)
        self.ending = False  # the attempt's end: its engines stay in attached_engines for the next attempt
        self.keys: dict[str, str] = {}  # engine → its key file
        self.sent: dict[str, list[str]] = {}  # engine → the weight versions sent to it (the newest last)
        self.loads: dict[str, Future] = {}  # engine → its /update_weights_from_disk in flight
        self.loading: dict[str, str] = {}  # engine → the version being loaded
        self.health: dict[str, Future] = {}
        self.misses: dict[str, int] = {}
        self.last_health = 0.0
        self.snapshots: dict[int, Path] = {}  # step → its HF directory (written by the actor's sync)
        self.latest: tuple[str, Path] | None = None  # (version, directory) the newest complete weights
        self.synced_any = False

    # -- joining
    def names(self) -> list[str]:
        return [n for n, e in self.registry.engines.items()
                if e.origin == "external" and e.state not in ("gone", "dead")]

    def add(self, url: str, key_file: str, by: str, keep: bool = False) -> tuple[str | None, str]:
        """Register the engine at ``url`` with the key in ``key_file``; (its name, a sentence) or (None, why not).
        ``keep``: attached with relax-scale, so a later attempt attaches it again (``attached_engines``)."""
        try:
            url = X.check_url(url)
            X.read_key_file(key_file)
        except (ValueError, X.KeyFileError) as e:
            return None, str(e)
        same = [n for n in self.names() if self.registry.engines[n].url == url]
        if same:
            return None, f"the engine at {url} serves this run already, as {same[0]}"
        try:
            info = X.probe(url, key_file)
        except X.ExternalEngineError as e:
            return None, str(e)
        k = 0
        while f"ext{k}" in self.registry.engines:
            k += 1
        name = f"ext{k}"
        version = info.get("weight_version")
        self.registry.add(name, url, origin="external", state="syncing", node=urlsplit(url).hostname, job_id="external",
                          weight_version=None if version is None else str(version))
        self.keys[name] = str(Path(key_file).expanduser().resolve())
        self.sent[name] = []
        self._write()
        if keep:
            self.attached[name] = {"url": url, "key_file": self.keys[name], "by": by}
            self._persist()
        self.event("engine_external", f"{name} at {url} joins (by {by}, model {info.get('model_path')}); it takes "
                                      "requests once it has loaded the run's current weights from disk")
        self.on_change()
        self._load_latest(name)
        return name, f"{name}: the engine at {url} joined; it takes requests once it has the current weights"

    def join_configured(self) -> None:
        """``rollout.external_engines`` and the earlier attempt's attached engines, once: each joins, or is dropped
        with why (the run goes on without it)."""
        todo, self.configured = self.configured, []
        for ext in todo:
            again = bool(ext.get("again"))
            by = f"{ext.get('by') or 'relax-scale'}, attached again after the attempt it joined" if again \
                else "rollout.external_engines"
            name, why = self.add(ext["url"], ext["key_file"], by, keep=again)
            if name is None:
                what = "attached with relax-scale before this attempt" if again else "rollout.external_engines"
                log.error("%s: %s: not used: %s", what, ext["url"], why)
                self.event("engine_external", f"{ext['url']} ({what}) not used: {why}")
        self._persist()  # the earlier attempt's that could not join are dropped from attached_engines

    # -- weights
    def snapshot_for(self, step: int) -> str | None:
        """The directory the actor writes step ``step``'s weights to with its sync, when an external engine needs
        them (one is registered or about to join); else None: no cost for runs without."""
        if not self.names() and not self.configured:
            return None
        path = self.run.path / "weights" / f"step-{step}"
        self.snapshots[step] = path
        return str(path)

    def synced(self, step: int) -> None:
        """The actor's sync of step ``step`` is done, its snapshot (if one was asked) written: every external
        engine loads it."""
        self.synced_any = True
        path = self.snapshots.get(step)
        if path is None or not path.is_dir():
            return
        self.latest = (str(step), path)
        for name in self.names():
            self._load_latest(name)
        self._prune()

    def _load_latest(self, name: str) -> None:
        latest = self.latest
        if latest is None and not self.synced_any:  # a new run before its first sync: the model on disk is step 0's
            latest = ("0", Path(self.model_path))
        e = self.registry.engines.get(name)
        if latest is None or e is None or name in self.loads or self.loading.get(name) == latest[0]:
            return
        if e.weight_version == latest[0] and e.state == "ready":
            return
        version, path = latest
        self.loading[name] = version
        self.sent[name] = (self.sent.get(name, []) + [version])[-SENT_KEPT:]
        self._write()
        self.loads[name] = X.in_thread(X.load_from_disk, e.url, self.keys[name], str(path), version,
                                       name=f"external-load-{name}")

    # -- every turn of the loop
    def tick(self, lost: Callable[[str, str], None]) -> None:
        """Apply finished loads and health checks; ``lost(name, why)`` drops an engine (``Elastic.lost``)."""
        for name, fut in list(self.loads.items()):
            if not fut.done():
                continue
            del self.loads[name]
            version = self.loading.pop(name)
            e = self.registry.engines.get(name)
            if e is None or e.state in ("gone", "dead"):
                continue
            err = fut.exception()
            if err is not None:
                cause = getattr(err, "cause", None) or f"{type(err).__name__}: {err}"
                lost(name, f"/update_weights_from_disk of weight version {version} failed: {cause}")
                continue
            got = fut.result()
            if got != version:  # what it serves is not what was sent: its answers could not be trusted
                lost(name, f"it reports weight version {got!r} after loading version {version} from disk")
                continue
            log.info("external engine %s loaded the weights of step %s", name, version)
            e.weight_version = version
            if e.state == "syncing":
                self.registry.move(name, "ready")
            self.on_change()
            self._load_latest(name)  # a newer snapshot may have come meanwhile
        now = time.time()
        for name, fut in list(self.health.items()):
            if fut.done():
                del self.health[name]
                err = fut.exception()
                dead = err is not None and getattr(err, "status", None) is None  # a 503 (busy) is alive
                self.misses[name] = self.misses.get(name, 0) + 1 if dead else 0
                if self.misses[name] >= HEALTH_MISSES and name in self.names():
                    lost(name, f"it no longer answers /health: {err}")
        if now - self.last_health >= HEALTH_EVERY_S:
            self.last_health = now
            for name in self.names():
                if name not in self.health:
                    self.health[name] = X.in_thread(X.health, self.registry.engines[name].url,
                                                    name=f"external-health-{name}")

    def dropped(self, name: str) -> None:
        """``name`` left the registry (drained, lost): no longer in the rollout role's key file, nor (unless the
        attempt is ending) attached again by a later attempt."""
        self.keys.pop(name, None)
        self.sent.pop(name, None)
        self.misses.pop(name, None)
        self._write()
        if not self.ending and self.attached.pop(name, None) is not None:
            self._persist()

    def finish(self) -> list[str]:
        """The end of the attempt: the external engines still registered; the caller declares them gone (drained,
        never stopped). Those attached with relax-scale stay in ``attached_engines``: a requeue or resume attaches
        them again."""
        names = self.names()
        self.ending = True
        self.configured = []
        return names

    # -- helpers
    def _persist(self) -> None:
        self.persist([dict(a) for a in self.attached.values()])

    def _write(self) -> None:
        """``RUN_DIR/external_engines.json`` (0600): ``{url: {"name", "key_file", "sent"}}``."""
        doc = {self.registry.engines[n].url: {"name": n, "key_file": k, "sent": self.sent.get(n, [])}
               for n, k in self.keys.items() if n in self.registry.engines}
        path = external_file(self.run)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)

    def _prune(self) -> None:
        """Keep the newest :data:`KEEP_SNAPSHOTS` snapshots (and any being loaded)."""
        keep = set(sorted(self.snapshots)[-KEEP_SNAPSHOTS:])
        busy = {self.loading[n] for n in self.loading}
        for step in sorted(self.snapshots):
            if step not in keep and str(step) not in busy:
                shutil.rmtree(self.snapshots.pop(step), ignore_errors=True)
