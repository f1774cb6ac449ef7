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


class BrokenLatest(RuntimeError):
    """``ROOT/latest`` exists but names no complete checkpoint: resuming would silently start from step 0."""


def complete(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints (``step_*`` with ``meta.json``) under ``root``, oldest first."""
    return sorted(p for p in Path(root).glob("step_*") if (p / "meta.json").exists())


def read_latest(root: str | os.PathLike) -> tuple[Path, dict] | None:
    """``(step_dir, meta)`` of the checkpoint ``ROOT/latest`` names; None if there is no ``latest`` (no checkpoint
    yet). A ``latest`` that names a missing or incomplete directory, or an unreadable ``meta.json``, raises
    :class:`BrokenLatest` naming the file and the fix: never a silent restart at step 0."""
    root = Path(root)
    latest = root / LATEST
    try:
        name = latest.read_text().strip()
    except FileNotFoundError:
        return None
    step_dir = root / name
    meta_path = step_dir / "meta.json"
    if not name or "/" in name or not step_dir.is_dir() or not meta_path.exists():
        what = ("is empty" if not name else f"names {name!r}, which does not exist" if not step_dir.is_dir()
                else f"names {name!r}, which is not a complete checkpoint (no meta.json)")
        raise BrokenLatest(_broken(latest, what, root))
    try:
        return step_dir, json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise BrokenLatest(_broken(latest, f"names {name!r}, whose meta.json cannot be read ({e})", root)) from None


def run_step(meta: dict) -> int:
    """The run's step a checkpoint was taken after: the controller saves it in ``extra_state["step"]``; the
    checkpoint's own ``step`` counts optimizer steps, which differ with ``train.num_steps_per_rollout`` > 1."""
    extra = meta.get("extra_state") or {}
    return int(extra["step"] if extra.get("step") is not None else meta["step"])


def _broken(latest: Path, what: str, root: Path) -> str:
    done = [p.name for p in complete(root)]
    fix = (f"write the name of a complete one into {latest} (complete here: {', '.join(done)}; e.g. "
           f"`echo {done[-1]} > {latest}`)" if done else "there is no complete checkpoint here")
    return (f"{latest} {what}: refusing to resume, which would start again from step 0 and drop the run's "
            f"metrics and exchange. Fix: {fix}, or delete {latest} to start the run again from step 0")
