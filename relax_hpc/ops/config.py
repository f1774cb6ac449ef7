"""The recipe's ``logging.wandb`` section, read by :mod:`relax_hpc.ops.wandb_log` (which also checks it).

Pure Python (no wandb import): the recipe's schema imports this on the login node; ops/ imports nothing of the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class WandbConfig:
    """Weights & Biases, beside TensorBoard (docs/metrics.md): the same metric names, against ``rollout/step``."""

    project: str = ""  # required (Relax --wandb-project)
    entity: str | None = None  # team or user (Relax --wandb-team); None: the API key's default
    name: str | None = None  # the W&B run's display name; None: the run's name
    group: str | None = None  # Relax --wandb-group
    tags: list[str] = field(default_factory=list)
    # online: to the server (WANDB_API_KEY or ~/.netrc needed); offline: files in RUN_DIR/wandb, sent later with
    # `wandb sync` (compute nodes without internet); disabled: nothing
    mode: Literal["online", "offline", "disabled"] = "online"
    host: str | None = None  # a self-hosted server's URL (Relax --wandb-host); None: api.wandb.ai
    init_timeout_s: float = 90.0  # online: give up on the server after this long (the run goes on without W&B)
