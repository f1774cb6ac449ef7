"""Launch inference engines: real SGLang servers on GPU nodes, relax_hpc's reference engine elsewhere (on the
CPU, or on one GPU: its ``--device``/``--dtype`` go through ``extra_args``).

The rollout role calls :func:`launch_engine` (or :func:`start_engine` for many, then
:meth:`EngineHandle.wait_ready` on each, so N engines load their weights in parallel). Either kind comes
back as an :class:`EngineHandle` with a URL that :class:`~relax_hpc.engines.client.EngineClient` talks to.

Why it looks like this:

* **Ports from the kernel.** Two runs on one node must never collide on a port (a top complaint about
  peers). The CPU engine binds port 0 itself and reports its URL through a ready-file. SGLang needs
  ``--port``, so we bind port 0, read the number, release it and pass it; if SGLang then loses the race
  ("address already in use") we relaunch on a fresh port.
* **Own Python.** SGLang pins its own torch/transformers, so it runs from the interpreter the recipe names
  (``python=``, e.g. a venv or container wrapper), never imported here.
* **Readiness = ``/health_generate``** (a real 1-token generation), with a deadline; if the process dies
  first, the error carries the tail of its log.
* **An API key, never on a command line.** Started with ``api_key=`` (the rollout role passes the run's,
  ``RunDir.api_key()``), an engine answers only requests carrying ``Authorization: Bearer KEY``. The key goes
  through the engine's environment, which other users cannot read (``ps`` shows every user's command lines):
  the CPU engine reads ``RELAX_ENGINE_API_KEY``. SGLang takes its key only as ``--api-key`` (its ``ServerArgs``
  reads no environment variable for it), so SGLang is started through a few lines of Python run by its own
  interpreter (:data:`SGLANG_LAUNCHER`): they take ``RELAX_SGLANG_API_KEY`` out of the environment, append
  ``--api-key KEY`` to ``sys.argv`` inside the process (``/proc/PID/cmdline`` keeps the command as it was
  started) and run ``sglang.launch_server`` as ``python -m`` would. SGLang's own processes, started after, never
  see it in their environment either.
* **Stop by PID.** Each engine runs in its own session (process group = its PID), so :meth:`EngineHandle.stop`
  signals exactly that group — SGLang's scheduler/detokenizer children included — and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from relax_hpc import forkserver
from relax_hpc.engines.client import EngineClient

KINDS = ("sglang", "reference")
KIND_ALIASES = {"cpu": "reference"}  # the reference engine's former name
API_KEY_ENV = "RELAX_ENGINE_API_KEY"  # the CPU engine's API key
SGLANG_KEY_ENV = "RELAX_SGLANG_API_KEY"  # SGLang's, turned into --api-key inside its process by SGLANG_LAUNCHER
# run as `python -c SGLANG_LAUNCHER ARGS...` by SGLang's interpreter: nothing of relax_hpc is imported there
SGLANG_LAUNCHER = (
    "import os, runpy, sys\n"
    f"key = os.environ.pop({SGLANG_KEY_ENV!r}, None)\n"
    "if key:\n"  # one `--api-key=KEY` word: a key starting with '-' (token_urlsafe: 1 in 64) is not an option
    "    sys.argv.append('--api-key=' + key)\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n")
_PORT_IN_USE = ("address already in use", "errno 98", "port is in use", "already in use")


class EngineLaunchError(RuntimeError):
    """An engine did not become ready: it died, or missed the deadline. The message ends with its log tail."""


def free_port(host: str = "") -> int:
    """A port the kernel says is free right now (bind port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _advertised(host: str) -> str:
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def sglang_command(python: str, model_path: str, host: str, port: int, tp: int,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The ``sglang.launch_server`` command line (extra_args from the recipe go last, so they can override),
    through :data:`SGLANG_LAUNCHER`: the API key comes from ``RELAX_SGLANG_API_KEY`` in its environment."""
    return [python, "-c", SGLANG_LAUNCHER, "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--tp-size", str(tp), *extra_args]


def sglang_lora_args(rank: int, hf_targets: Sequence[str]) -> list[str]:
    """SGLang's launch flags for ``train.lora.mode: adapter``: LoRA on, its memory pool sized for adapters of
    ``rank`` on ``hf_targets`` (HF module names, SGLang's choices), as it needs them when no adapter is given at
    launch (the actor loads them at run time: /load_lora_adapter)."""
    return ["--enable-lora", "--max-lora-rank", str(int(rank)), "--lora-target-modules", *hf_targets]


def _masked(command: Sequence[str]) -> str:
    """The command line for the log: the launcher's code named, not quoted; any value after ``--api-key`` hidden."""
    out: list[str] = []
    for c in command:
        if c == SGLANG_LAUNCHER and out and out[-1] == "-c":
            out[-1] = "-m sglang.launch_server (through relax_hpc's launcher: the API key from the environment)"
        elif out and out[-1] == "--api-key":
            out.append("***")
        elif c.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(c)
    return " ".join(out)


def cpu_engine_command(python: str, model_path: str, host: str, ready_file: str,
                       extra_args: Sequence[str] = ()) -> list[str]:
    return [python, "-m", "relax_hpc.engines.cpu_engine", "--model", str(model_path), "--host", host,
            "--port", "0", "--ready-file", ready_file, *extra_args]


@dataclass
class EngineHandle:
    """A launched engine process. ``url`` is empty until the reference engine reports it (see :meth:`wait_ready`).
    ``kind`` is ``"sglang"`` or ``"reference"`` (a ``"cpu"`` asked for is the reference engine)."""

    kind: str
    model_path: str
    url: str
    pid: int
    log_path: Path
    command: list[str]
    host: str
    tp: int = 1
    python: str = sys.executable
    env: dict = field(default_factory=dict, repr=False)
    extra_args: tuple = ()
    ready_file: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    _proc: forkserver.Process | None = field(default=None, repr=False)
    _log_offset: int = field(default=0, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def client(self, **kwargs) -> EngineClient:
        """A client for this engine, sending its API key unless ``api_key=`` says otherwise."""
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = self.api_key
        return EngineClient(self.url, **kwargs)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log at {self.log_path}: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def _launch_error(self, what: str) -> EngineLaunchError:
        return EngineLaunchError(f"{self.kind} engine (pid {self.pid}, model {self.model_path}) {what}; "
                                 f"log {self.log_path}, last lines:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 600.0, poll: float = 0.25) -> "EngineHandle":
        """Block until ``/health_generate`` answers 200. Raises EngineLaunchError (with the log tail) if the
        process exits or ``timeout`` passes; in both cases the process group is stopped first."""
        deadline = time.monotonic() + timeout
        port_retries = 3
        probe: EngineClient | None = None
        try:
            while True:
                rc = self.returncode()
                if rc is not None:
                    if self.kind == "sglang" and port_retries > 0 and self._lost_port_race():
                        port_retries -= 1  # another process took the port we picked: same engine, fresh port
                        try:  # the dead attempt's children (SGLang starts its scheduler before binding HTTP)
                            os.killpg(self.pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                        self._spawn(free_port(self.host if self.host not in ("0.0.0.0", "::") else ""))
                        probe = None
                        continue
                    self.stop()
                    raise self._launch_error(f"exited with code {rc} before it was ready")
                if not self.url and self.ready_file is not None and self.ready_file.exists():
                    self.url = self.ready_file.read_text().strip()
                if self.url:
                    probe = probe or EngineClient(self.url, retries=0, api_key=self.api_key)
                    if probe.is_healthy(timeout=max(1.0, min(30.0, deadline - time.monotonic()))):
                        return self
                if time.monotonic() > deadline:
                    self.stop()
                    raise self._launch_error(
                        f"was not ready after {timeout:.0f} s (url {self.url or 'not reported yet'})")
                time.sleep(poll)
        finally:
            if probe is not None:
                probe.close()

    def _lost_port_race(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace").lower()
        except OSError:
            return False
        return any(s in text for s in _PORT_IN_USE)

    def _spawn(self, port: int | None = None) -> None:
        if self.kind == "sglang":
            self.command = sglang_command(self.python, self.model_path, self.host, port, self.tp, self.extra_args)
            self.url = f"http://{_advertised(self.host)}:{port}"
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"\n==== relax_hpc launch {stamp}: {_masked(self.command)}\n".encode())
            log.flush()
            # its own session (a signal to the rank's group does not reach it), and SIGTERM when this process
            # ends: a rank killed with kill -9 used to leave its engine running, holding its port and its GPU,
            # after the run had restarted or ended. SIGTERM, not SIGKILL: SGLang then stops the processes it
            # started itself. Under Popen that is PR_SET_PDEATHSIG, sent when the *thread* that started the engine
            # ends: start engines from a thread that lives as long as they do (the roles and the tests use the
            # main thread). EngineHandle.stop remains the normal way out.
            self._proc = forkserver.popen(self.command, env=env, stdout=log, dies_with=os.getpid())
        self.pid = self._proc.pid
        self._stopped = False

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the engine's process group (its PID), SIGKILL after ``timeout``; returns the exit code."""
        if self._proc is None:
            return None
        if self._stopped:  # never signal a process group id twice: once empty, the id may be reused
            return self._proc.poll()
        self._stopped = True
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)  # the group we created with start_new_session: pgid == pid
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self._proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children (SGLang's scheduler, detokenizer) may outlive the leader briefly
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self._proc.poll()


def start_engine(kind: str, model_path: str | os.PathLike, *, python: str | None = None, tp: int = 1,
                 host: str = "127.0.0.1", env: dict | None = None, log_path: str | os.PathLike | None = None,
                 extra_args: Sequence[str] = (), api_key: str | None = None) -> EngineHandle:
    """Start an engine process and return at once (call :meth:`EngineHandle.wait_ready`).

    ``api_key``: the engine then refuses (HTTP 401) requests without ``Authorization: Bearer KEY``; the
    handle's :meth:`~EngineHandle.client` sends it. It reaches the engine through its environment, never its
    command line.

    kind: ``"sglang"`` (``python`` must be an interpreter with SGLang; ``tp`` GPUs per engine, which ones via
    ``env={"CUDA_VISIBLE_DEVICES": ...}``) or ``"reference"`` (``"cpu"`` is the same: TP must be 1; ``python``
    defaults to this one; ``extra_args`` such as ``--device cuda --dtype bfloat16`` go to
    :mod:`relax_hpc.engines.cpu_engine`).
    """
    kind = KIND_ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ValueError(f"engine kind must be one of {KINDS} (or 'cpu', the reference engine), not {kind!r}")
    if kind == "reference" and tp != 1:
        raise ValueError(f"the reference engine serves TP=1 only, got tp={tp}")
    if kind == "sglang" and not python:
        python = os.environ.get("RELAX_SGLANG_PYTHON")
        if not python:
            raise ValueError("kind='sglang' needs python= (the interpreter of an SGLang environment), "
                             "or RELAX_SGLANG_PYTHON in the environment")
    python = python or sys.executable
    if kind == "reference" and not (Path(model_path) / "config.json").is_file():  # now, not after a torch import
        raise EngineLaunchError(f"reference engine: no HF model at {model_path} (config.json missing)")
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"relax-{kind}-engine-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(env or {})
    ready_file = None
    command: list[str] = []
    if kind == "reference":
        ready_file = log_path.with_name(log_path.name + f".{os.getpid()}.{time.monotonic_ns()}.url")
        ready_file.unlink(missing_ok=True)
        command = cpu_engine_command(python, str(model_path), host, str(ready_file), extra_args)
        pkg_root = str(Path(__file__).resolve().parents[2])  # importable even when relax_hpc is not installed
        old = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, old) if p)
    if api_key:
        env[API_KEY_ENV if kind == "reference" else SGLANG_KEY_ENV] = api_key
    h = EngineHandle(kind=kind, model_path=str(model_path), url="", pid=-1, log_path=log_path, command=command,
                     host=host, tp=tp, python=python, env=env, extra_args=tuple(extra_args), ready_file=ready_file,
                     api_key=api_key)
    h._spawn(free_port(host if host not in ("0.0.0.0", "::") else "") if kind == "sglang" else None)
    return h


def launch_engine(kind: str, model_path: str | os.PathLike, *, python: str | None = None, tp: int = 1,
                  host: str = "127.0.0.1", env: dict | None = None, log_path: str | os.PathLike | None = None,
                  extra_args: Sequence[str] = (), ready_timeout: float = 600.0,
                  api_key: str | None = None) -> EngineHandle:
    """Start an engine and wait until it answers ``/health_generate``; see :func:`start_engine`."""
    return start_engine(kind, model_path, python=python, tp=tp, host=host, env=env, log_path=log_path,
                        extra_args=extra_args, api_key=api_key).wait_ready(ready_timeout)
