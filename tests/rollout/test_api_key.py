"""The run's engine API key: made once in the run directory, given to every engine, sent by every client."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import httpx
import pytest

from relax_hpc.rollout.client import EngineClient, EngineError
from relax_hpc.rollout.engines import _masked, launch_engine, sglang_command
from relax_hpc.rundir import RunDir

KEY = "test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_engine(tiny_llama, tmp_path_factory):
    h = launch_engine("cpu", tiny_llama, log_path=tmp_path_factory.mktemp("keyed") / "engine.log", ready_timeout=120,
                      extra_args=["--threads", "1", "--seed", "0"], api_key=KEY)
    try:
        yield h
    finally:
        h.stop()


def test_run_api_key_is_made_once_private_and_shared(tmp_path):
    rd = RunDir(tmp_path)
    keys: list[str] = []
    threads = [threading.Thread(target=lambda: keys.append(rd.api_key())) for _ in range(8)]  # ranks racing
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and len(keys[0]) >= 32
    assert stat.S_IMODE(os.stat(rd.api_key_file).st_mode) == 0o600
    assert RunDir(tmp_path).api_key() == keys[0]  # a requeued job / restarted engine gets the same key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine_api_key"]  # no temporary files left


def test_sglang_gets_the_key_on_its_command_line_and_the_log_does_not():
    cmd = sglang_command("python", "/m", "0.0.0.0", 30000, 2, ["--mem-fraction-static", "0.8"], api_key=KEY)
    assert cmd[cmd.index("--api-key") + 1] == KEY
    assert KEY not in _masked(cmd) and "--api-key ***" in _masked(cmd)
    assert "--api-key" not in sglang_command("python", "/m", "h", 1, 1)


def test_keyed_cpu_engine_refuses_requests_without_the_key(keyed_engine):
    url = keyed_engine.url
    with httpx.Client(timeout=30) as h:
        for method, path, body in (("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
                                   ("GET", "/model_info", None), ("POST", "/update_weight_version", {"new_version": "x"})):
            r = h.request(method, url + path, json=body)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, path
            r = h.request(method, url + path, json=body, headers={"Authorization": "Bearer wrong" + KEY})
            assert r.status_code == 401, path
        assert h.get(url + "/health_generate").status_code == 200  # open, as in SGLang
        ok = h.get(url + "/model_info", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["weight_version"] == "default"
    with EngineClient(url, retries=0) as anonymous:
        with pytest.raises(EngineError) as ei:
            anonymous.model_info()
        assert ei.value.status == 401 and "API key" in str(ei.value)
    with keyed_engine.client() as c:  # the handle's client sends the key
        assert len(c.generate([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True}).output_ids) == 3


def test_the_cpu_engine_key_is_not_on_its_command_line(keyed_engine):
    cmdline = Path(f"/proc/{keyed_engine.pid}/cmdline").read_bytes().decode(errors="replace")
    assert "cpu_engine" in cmdline and KEY not in cmdline
    assert KEY not in keyed_engine.log_path.read_text() and "API key required" in keyed_engine.log_path.read_text()
