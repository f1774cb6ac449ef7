"""Helpers of the SGLang contract tests (a module of its own: ``conftest`` is a name every test folder has)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SIDE = Path(__file__).parent / "sglang_side"  # the programs run by SGLang's interpreter


def run_sglang(python: str, script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``sglang_side/SCRIPT ARGS`` under SGLang's interpreter; its stdout/stderr come back (not raised on)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)  # nothing of the project's environment leaks into SGLang's
    return subprocess.run([python, str(SIDE / script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@dataclass
class Recorder:
    """SGLang's HTTP application with a recording engine side (sglang_side/recorder_server.py), on a real port."""

    url: str
    api_key: str
    record: Path
    proc: subprocess.Popen

    def take(self) -> list[dict]:
        """The requests recorded since the last take (one dict each, see recorder_server.py)."""
        if not self.record.exists():
            return []
        lines = self.record.read_text().splitlines()
        self.record.write_text("")
        return [json.loads(x) for x in lines if x.strip()]


def served_recorder(python: str, script: str, directory: Path, key: str):
    """A fixture's body: ``sglang_side/SCRIPT`` (SGLang's HTTP application with a recording side: recorder_server.py,
    lora_recorder.py) started under SGLang's interpreter with API key ``key``, its :class:`Recorder` yielded once it
    listens (it writes its URL to a file then), the process stopped afterwards."""
    ready, record, log = directory / "url", directory / "record.jsonl", directory / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([python, str(SIDE / script), "--record", str(record), "--ready", str(ready),
                                 "--api-key", key], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
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
