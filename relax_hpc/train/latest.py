"""Where a checkpoint root's newest complete checkpoint is, without importing torch or megatron.

The layout is :mod:`relax_hpc.train.checkpoint`'s (``ROOT/latest`` names ``step_NNNNNNNN``, whose
``meta.json`` is written last); this module only reads it, so the controller can decide to resume on a
login-node-light process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def resolve(path: str | os.PathLike) -> Path:
    """A step directory, from a root (through ``latest``) or a step directory itself."""
    p = Path(path)
    if (p / "meta.json").exists():
        return p
    latest = p / LATEST
    if not latest.exists():
        raise FileNotFoundError(f"no checkpoint at {p}: neither {latest} nor {p / 'meta.json'} exists")
    step_dir = p / latest.read_text().strip()
    if not (step_dir / "meta.json").exists():
        raise FileNotFoundError(f"{latest} names {step_dir}, which is not a complete checkpoint")
    return step_dir


def read_latest(root: str | os.PathLike) -> tuple[Path, dict] | None:
    """``(step_dir, meta)`` of the newest complete checkpoint under ``root``; None if there is none yet."""
    try:
        step_dir = resolve(root)
    except FileNotFoundError:
        return None
    return step_dir, json.loads((step_dir / "meta.json").read_text())
