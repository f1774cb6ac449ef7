"""Contract tests against SGLang's own code (marker ``sglang_contract``): the programs under ``sglang_side/`` run
under SGLang's interpreter (``RELAX_SGLANG_PYTHON``, as ``tools/install --sglang DIR`` writes it) and import SGLang's
own classes; nothing of SGLang is re-typed here. Without that interpreter the tests skip, saying so; with
``RELAX_REQUIRE_SGLANG=1`` (CI) they fail instead."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # contract_support.py, beside this file
from contract_support import SIDE, Recorder  # noqa: E402

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
    d = tmp_path_factory.mktemp("sglang-recorder")
    key = "relax-contract-key"
    ready, record, log = d / "url", d / "record.jsonl", d / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sglang_python, str(SIDE / "recorder_server.py"), "--record", str(record),
                                 "--ready", str(ready), "--api-key", key], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():  # the server writes its URL once it listens
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"SGLang's app did not start (exit {proc.poll()}); log:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield Recorder(ready.read_text().strip(), key, record, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


