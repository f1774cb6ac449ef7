"""Contract tests against SGLang's own code (marker ``sglang_contract``): the programs under ``sglang_side/`` run
under SGLang's interpreter (``RELAX_SGLANG_PYTHON``, as ``tools/install --sglang DIR`` writes it) and import SGLang's
own classes; nothing of SGLang is re-typed here. Without that interpreter the tests skip, saying so; with
``RELAX_REQUIRE_SGLANG=1`` (CI) they fail instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # contract_support.py, beside this file
from contract_support import served_recorder  # noqa: E402

SGLANG_VERSION = "0.5.23"  # requirements-pins.txt's
_checked: dict[str, str | None] = {}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.sglang_contract)


def _problem(python: str | None) -> str | None:
    """Why ``python`` cannot run the contract tests, or None."""
    if not python:
        return "RELAX_SGLANG_PYTHON is not set (install SGLang with tools/install --sglang DIR, then source " \
               "DIR/relax-sglang.env)"
    if python not in _checked:
        r = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                           capture_output=True, text=True, timeout=120)
        have = r.stdout.strip()
        _checked[python] = (None if r.returncode == 0 and have == SGLANG_VERSION else
                            f"RELAX_SGLANG_PYTHON={python} has sglang {have or '(none: ' + r.stderr.strip()[-200:] + ')'}"
                            f", not {SGLANG_VERSION}")
    return _checked[python]


@pytest.fixture(scope="session")
def sglang_python() -> str:
    python = os.environ.get("RELAX_SGLANG_PYTHON")
    why = _problem(python)
    if why is not None:
        if os.environ.get("RELAX_REQUIRE_SGLANG") == "1":
            pytest.fail(f"RELAX_REQUIRE_SGLANG=1 but {why}")
        pytest.skip(why)
    return python


@pytest.fixture(scope="session")  # one SGLang app for the requests and the responses tests (each take() clears)
def recorder(sglang_python, tmp_path_factory):
    yield from served_recorder(sglang_python, "recorder_server.py", tmp_path_factory.mktemp("sglang-recorder"),
                               "relax-contract-key")


