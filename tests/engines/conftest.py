"""Engine fixtures for the engine tests: the rollout tests' (tests/rollout/conftest.py), one CPU engine per module."""

from __future__ import annotations

from pathlib import Path

from tests.rollout.conftest import client, engine_fixtures, tiny_llama, vlm_engine  # noqa: F401 - fixtures, used by name

_prestarted_engines, cpu_engine = engine_fixtures(Path(__file__).resolve().parent)
