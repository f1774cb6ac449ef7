"""Engine launch: the CPU engine (launch, readiness, stop by PID, failure with the log tail, a dead engine's
error) and, on GPU machines with an SGLang environment, a real SGLang server driven by the same client."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from relax_hpc.engines.client import EngineClient, EngineError, SamplingParams
from relax_hpc.engines.launcher import (SGLANG_LAUNCHER, EngineLaunchError, cpu_engine_command, free_port,
                                       launch_engine, sglang_command, start_engine)


def test_commands_and_argument_checks(monkeypatch, tmp_path):
    cmd = sglang_command("/envs/sgl/bin/python", "/m", "0.0.0.0", 31000, 2, ["--mem-fraction-static", "0.7"])
    assert cmd[:3] == ["/envs/sgl/bin/python", "-c", SGLANG_LAUNCHER] and "sglang.launch_server" in cmd[2]
    assert cmd[cmd.index("--port") + 1] == "31000" and cmd[cmd.index("--tp-size") + 1] == "2"
    assert cmd[-2:] == ["--mem-fraction-static", "0.7"]
    cpu = cpu_engine_command("py", "/m", "127.0.0.1", "/r")
    assert cpu[1:3] == ["-m", "relax_hpc.engines.cpu_engine"] and cpu[cpu.index("--port") + 1] == "0"
    assert 0 < free_port() < 65536
    with pytest.raises(ValueError, match="TP=1"):
        start_engine("cpu", tmp_path, tp=2)
    with pytest.raises(ValueError, match="kind"):
        start_engine("vllm", tmp_path)
    monkeypatch.delenv("RELAX_SGLANG_PYTHON", raising=False)
    with pytest.raises(ValueError, match="RELAX_SGLANG_PYTHON"):
        start_engine("sglang", tmp_path)


def test_killed_engine_gives_connection_refused(cpu_engine):
    """The module's CPU engine (launched and made ready by the fixture), killed by PID like a crash."""
    h = cpu_engine
    assert h.alive() and h.url.startswith("http://127.0.0.1:") and h.pid > 0
    c = EngineClient(h.url, retries=1, backoff=0.05)
    assert len(c.generate([1, 2, 3], SamplingParams(max_new_tokens=2)).output_ids) == 2
    os.kill(h.pid, signal.SIGKILL)
    h._proc.wait(10)
    with pytest.raises(EngineError) as e:
        c.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    msg = str(e.value)
    assert h.url in msg and "/generate" in msg and "connection refused" in msg and e.value.status is None
    with pytest.raises(EngineError, match="connection refused"):
        c.server_info()  # idempotent: retried, then the same clear error
    assert not c.is_healthy(timeout=2)
    h.stop()
    assert not h.alive()


def test_launch_failure_reports_log_tail(tmp_path):
    """An engine that dies before it is ready: here "SGLang" from an interpreter without it."""
    with pytest.raises(EngineLaunchError) as e:
        launch_engine("sglang", tmp_path, python=sys.executable, log_path=tmp_path / "bad.log", ready_timeout=60)
    msg = str(e.value)
    assert "exited with code 1" in msg and str(tmp_path / "bad.log") in msg
    assert "No module named 'sglang'" in msg  # the engine's own words, from its log
    with pytest.raises(EngineLaunchError, match="config.json"):
        launch_engine("cpu", tmp_path / "no-such-model")


# ---------------------------------------------------------------------------- real SGLang (GPU only)

def _sglang_python() -> str | None:
    py = os.environ.get("RELAX_SGLANG_PYTHON")
    if not py or not (shutil.which(py) or os.access(py, os.X_OK)):
        return None
    try:
        ok = subprocess.run([py, "-c", "import sglang"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return py if ok else None


@pytest.mark.gpu
def test_real_sglang_engine(tiny_llama, tmp_path):
    """The client's calls against `python -m sglang.launch_server` (set RELAX_SGLANG_PYTHON to its interpreter;
    RELAX_SGLANG_TP for TP, default 1)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    py = _sglang_python()
    if py is None:
        pytest.skip("needs RELAX_SGLANG_PYTHON: an interpreter that can `import sglang`")
    tp = int(os.environ.get("RELAX_SGLANG_TP", "1"))
    key = "sglang-test-key-0123456789"
    h = launch_engine("sglang", tiny_llama, python=py, tp=tp, log_path=tmp_path / "sglang.log", ready_timeout=900,
                      extra_args=["--mem-fraction-static", "0.3", "--disable-cuda-graph"], api_key=key)
    try:
        # the key reached SGLang through its environment (the launcher), not its command line
        assert key not in open(f"/proc/{h.pid}/cmdline", "rb").read().decode(errors="replace")
        with pytest.raises(EngineError) as e:
            EngineClient(h.url, retries=0).model_info()
        assert e.value.status == 401
        c = h.client()
        g = c.generate([1, 10, 11, 12],
                       SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, sampling_seed=3))
        assert len(g.output_ids) == len(g.output_logprobs) == 8 and g.finish_reason.type == "length"
        ref = c.generate([1, 10, 11, 12], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        k = ref.output_ids.index(ref.output_ids[3])
        s = c.generate([1, 10, 11, 12], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[ref.output_ids[3]]))
        assert s.finish_reason.type == "stop" and s.output_ids == ref.output_ids[:k + 1]
        c.health_generate()
        assert "internal_states" in c.server_info() and c.model_info()["weight_version"] is not None
        c.pause_generation("abort")
        c.continue_generation()
        c.flush_cache()
        c.update_weights_from_disk(str(tiny_llama), weight_version="disk-1")
        assert c.weight_version() == "disk-1"
        assert c.generate([1, 2], {"max_new_tokens": 2}).weight_version == "disk-1"
        with pytest.raises(EngineError) as e:
            c.generate([1, 2], {"max_new_tokens": 2, "bogus_knob": 1})
        assert e.value.status == 400
    finally:
        t = time.monotonic()
        h.stop()
        assert time.monotonic() - t < 30 and not h.alive()


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "popen"])
def test_an_engine_dies_with_the_rank_that_started_it(tiny_llama, tmp_path, forked, _forkserver):
    """A rollout rank killed with kill -9 (a crash, the OOM killer, tools/chaos) must not leave its engine running:
    the engine has a session of its own, so only the parent-death signal reaches it (PR_SET_PDEATHSIG for the
    rank's child; a pidfd the child watches when the fork server started it: relax_hpc.forkserver)."""
    import signal as sig
    import subprocess

    import psutil

    from relax_hpc import forkserver

    if forked and _forkserver is None:
        pytest.skip("no fork server in this session")

    code = ("import sys, time; from relax_hpc.engines.launcher import start_engine; "
            "h = start_engine('cpu', sys.argv[1], log_path=sys.argv[2], extra_args=['--threads', '1']).wait_ready(300); "
            "print(h.pid, flush=True); time.sleep(600)")
    env = {**os.environ, forkserver.OFF: "0" if forked else "1"}
    rank = subprocess.Popen([sys.executable, "-c", code, str(tiny_llama), str(tmp_path / "engine.log")],
                            stdout=subprocess.PIPE, text=True, env=env)
    engine = None
    try:
        engine = psutil.Process(int(rank.stdout.readline()))  # the engine is up and serving
        assert engine.is_running() and (engine.ppid() == rank.pid) is not forked
        rank.send_signal(sig.SIGKILL)
        rank.wait(30)
        _, alive = psutil.wait_procs([engine], timeout=60)
        assert not alive, f"engine {engine.pid} outlived the rank that started it"
    finally:
        rank.kill()
        if engine is not None and engine.is_running():  # a failed test leaves nothing behind either
            engine.kill()
