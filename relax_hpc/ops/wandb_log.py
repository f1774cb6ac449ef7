"""Weights & Biases, beside TensorBoard: the run's metrics under the same names (``logging.wandb``, docs/metrics.md).

Every scalar the controller writes to TensorBoard goes to W&B too, with one extra key, ``rollout/step``, that
every other metric is plotted against (``define_metric``, as Relax and slime do). Logging against our own step
rather than W&B's keeps a resumed run one run: a requeued job opens the same W&B run (its id is derived from the
run directory, ``resume="allow"``) and logs the steps it does again under their own ``rollout/step``.

Offline mode writes ``RUN_DIR/wandb/offline-run-*/run-*.wandb``, sent later with ``wandb sync`` from a machine
that reaches the server: compute nodes often do not. W&B is a view, never the record: if it cannot start (no
network, a bad key), the run goes on with TensorBoard and ``metrics.jsonl`` and says why in its log and events.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import netrc
import os
import re
from pathlib import Path
from typing import Any

from relax_hpc.ops.config import WandbConfig

log = logging.getLogger("relax_hpc.metrics")

STEP = "rollout/step"  # the x-axis of every metric
DEFAULT_HOST = "https://api.wandb.ai"


def run_id(run_dir: str | os.PathLike) -> str:
    """The W&B run id of a run directory: the same across requeues and restarts (so they resume one W&B run),
    different for two runs of one name in two places. W&B ids are [a-z0-9_-], at most 64 characters."""
    path = Path(run_dir).resolve()
    name = re.sub(r"[^a-z0-9_-]+", "-", path.name.lower()).strip("-")[:48] or "run"
    return f"{name}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def check(cfg: WandbConfig) -> list[tuple[str, Any, str]]:
    """Problems of a ``logging.wandb`` section that hold anywhere (the key, the value, the fix)."""
    key = "logging.wandb"
    out: list[tuple[str, Any, str]] = []
    if not cfg.project:
        out.append((f"{key}.project", cfg.project, "is required. Fix: name the W&B project, or remove logging.wandb"))
    if cfg.host is not None and not re.match(r"^https?://[^\s/]+", cfg.host):
        out.append((f"{key}.host", cfg.host, "is not an http(s) URL. Fix: the server's URL, e.g. https://wandb.example.org"))
    if not cfg.init_timeout_s > 0:
        out.append((f"{key}.init_timeout_s", cfg.init_timeout_s, "must be more than 0 seconds"))
    if cfg.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        out.append((f"{key}.mode", cfg.mode, "needs the wandb package, which is not installed here. Fix: tools/install "
                                             "(installs it), pip install wandb, or mode: disabled"))
    return out


def credential_problems(cfg: WandbConfig, env: dict[str, str] | None = None, home: str | None = None) -> list[tuple[str, Any, str]]:
    """Before submitting an online run: is there an API key the job will see? Without one, ``wandb.init`` would
    fail on the compute node, minutes into the job (the run goes on without W&B, but the user asked for it)."""
    if cfg.mode != "online":
        return []
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return []
    host = re.sub(r"^https?://", "", (cfg.host or env.get("WANDB_BASE_URL") or DEFAULT_HOST)).split("/")[0]
    path = Path(home or env.get("HOME") or Path.home()) / ".netrc"
    try:
        if netrc.netrc(str(path)).authenticators(host):
            return []
    except (OSError, netrc.NetrcParseError):
        pass
    return [("logging.wandb.mode", "online",
             f"no W&B API key: WANDB_API_KEY is not set and {path} has no entry for {host}. Fix: `wandb login` here, "
             "export WANDB_API_KEY before relax-submit, or mode: offline (then `wandb sync RUN_DIR/wandb/offline-run-*` "
             "from a machine that reaches the server)")]


def public_config(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe as the W&B config, without its secrets: an online run uploads it, and an offline one keeps it in
    its files. The recipe's secrets (:func:`relax_hpc.rundir.split_secrets`: ``slurm.env``'s values, a container
    variable named like a token, the Apprise URLs) are masked; of an Apprise URL only the scheme is kept, as the
    validator shows them; any other URL loses its user:password.
    """
    from relax_hpc.rundir import mask_secrets

    def clean(v: Any, key: str = "") -> Any:
        if isinstance(v, dict):
            return {k: clean(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x, key) for x in v]
        if isinstance(v, str) and "://" in v:
            scheme, rest = v.split("://", 1)
            if key == "notify_urls":
                return f"{scheme}://..."
            host, sep, path = rest.partition("/")
            return f"{scheme}://{host.rsplit('@', 1)[-1]}{sep}{path}"
        return v

    return clean(mask_secrets(recipe))


class WandbWriter:
    """One W&B run for one relax_hpc run; the controller's :class:`~relax_hpc.ops.metrics.RunMetrics` feeds it."""

    def __init__(self, cfg: WandbConfig, run_dir: str | os.PathLike, run_name: str, config: dict[str, Any] | None = None):
        import wandb

        settings = {"silent": True, "console": "off", "x_disable_stats": True,  # our logs are the run's log
                    "init_timeout": float(cfg.init_timeout_s)}
        if cfg.host:
            settings["base_url"] = cfg.host
        self.dir = Path(run_dir)
        self._run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or run_name, group=cfg.group,
                               tags=list(cfg.tags) or None, mode=cfg.mode, dir=str(self.dir), id=run_id(self.dir),
                               resume="allow", config=config, settings=wandb.Settings(**settings))
        self._run.define_metric(STEP)
        self._run.define_metric("*", step_metric=STEP)

    @property
    def files(self) -> str | None:
        """Where this attempt's W&B files are (offline: what ``wandb sync`` takes)."""
        d = getattr(self._run, "dir", None)
        return str(Path(d).parent) if d else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if values:
            self._run.log({**values, STEP: int(step)})

    def summary(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            if isinstance(v, (int, float, str)) and not isinstance(v, bool):
                self._run.summary[k] = v

    def close(self, exit_code: int = 0) -> None:
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None
