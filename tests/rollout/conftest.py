"""Engine fixtures for the rollout tests (and, through :func:`engine_fixtures`, the engine tests): a tiny HF model made offline, and CPU engine processes stopped by PID.

One engine per test module (module scope): starting one costs a few seconds (python + torch + transformers
import), and modules that change weights must not leak them into others.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


def _tiny_model_maker():
    """tools/make-tiny-model's make_tiny_model() (tests/conftest.py loads it)."""
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Llama, hidden 64, 2 layers, vocab 128, max_pos 512, random weights (seed 0)."""
    out = tmp_path_factory.mktemp("engine-model") / "tiny-llama"
    return _tiny_model_maker()(out, arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, seed=0)


ENGINE_ARGS = ["--threads", "1", "--seed", "0"]


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm, tmp_path_factory):
    """A CPU engine serving ``tiny_vlm`` (tests/conftest.py), ready (its client); stopped afterwards."""
    from relax_hpc.engines.launcher import start_engine

    yield from served(start_engine("cpu", tiny_vlm, log_path=tmp_path_factory.mktemp("vlm-engine") / "engine.log",
                                   extra_args=ENGINE_ARGS))


def served(handle):
    """A fixture's body for a started engine: its client once ready, the engine stopped afterwards."""
    try:
        yield handle.wait_ready(120)
    finally:
        handle.stop()


def import_source(tmp_path, monkeypatch, name: str, source: str):
    """``source`` written as module ``name`` in ``tmp_path`` and imported afresh (a user's plugin file: reward,
    generate function, filter), importable by path for this test only."""
    import importlib
    import sys
    import textwrap

    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def engine_fixtures(here: Path):
    """``_prestarted_engines`` and ``cpu_engine`` for the test modules under ``here`` (a conftest's folder)."""

    @pytest.fixture(scope="session")
    def _prestarted_engines(request, tiny_llama, tmp_path_factory):
        """Start the engine of every collected module under ``here`` that uses ``cpu_engine`` at once, without
        waiting. Start-up is mostly importing torch and transformers; overlapping it across modules saves most of
        it. Each module still gets its own engine process."""
        from relax_hpc.engines.launcher import start_engine

        modules = sorted({item.module.__name__ for item in request.session.items
                          if "cpu_engine" in item.fixturenames and here in Path(item.path).parents})
        logs = tmp_path_factory.mktemp("engine-logs")
        handles = {m: start_engine("cpu", tiny_llama, log_path=logs / f"{m}.log", extra_args=ENGINE_ARGS)
                   for m in modules}
        try:
            yield handles
        finally:
            for h in handles.values():
                h.stop()

    @pytest.fixture(scope="module")
    def cpu_engine(request, _prestarted_engines, tiny_llama, tmp_path_factory):
        """This module's CPU engine serving ``tiny_llama``, ready; stopped (its PID's process group) afterwards."""
        from relax_hpc.engines.launcher import start_engine

        handle = _prestarted_engines.get(request.module.__name__)
        if handle is None:  # not seen at collection (e.g. requested dynamically): start one now
            handle = start_engine("cpu", tiny_llama, log_path=tmp_path_factory.mktemp("engine-log") / "cpu-engine.log",
                                  extra_args=ENGINE_ARGS)
        yield from served(handle)

    return _prestarted_engines, cpu_engine


_prestarted_engines, cpu_engine = engine_fixtures(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def client(cpu_engine):
    from relax_hpc.engines.client import EngineClient

    c = EngineClient(cpu_engine.url, timeout=60)
    yield c
    c.close()
