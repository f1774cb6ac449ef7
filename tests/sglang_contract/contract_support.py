"""Helpers of the SGLang contract tests (a module of its own: ``conftest`` is a name every test folder has)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

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
