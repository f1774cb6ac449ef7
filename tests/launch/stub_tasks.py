"""Callables submitted through the executors in tests (importable in the child: tests/ is on PYTHONPATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def write_env(path: str, *names: str) -> dict:
    """Record some environment variables; return them (the job's result)."""
    values = {n: os.environ.get(n) for n in names}
    Path(path).write_text(repr(values))
    return values


def fail(message: str) -> None:
    raise RuntimeError(message)


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
