"""The run directory: the one place a run's state lives, on the shared filesystem.

Everything that must survive a crash or be read by another process (the login node's ``relax-status``,
a requeued job, a role on another node) is a file here, written atomically. Owner-only permissions:
the token in it is what lets a process talk to the controller.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDir:
    path: Path

    # files (each written by exactly one party)
    @property
    def recipe(self) -> Path:  # resolved recipe, by relax-submit
        return self.path / "recipe.yaml"

    @property
    def script(self) -> Path:  # rendered sbatch script, by relax-submit
        return self.path / "job.sbatch"

    @property
    def job(self) -> Path:  # {run, run_dir, job_id, executor, submitted_at, ...}, by relax-submit
        return self.path / "job.json"

    @property
    def token_file(self) -> Path:  # shared secret for the control socket, by relax-submit
        return self.path / "token"

    @property
    def api_key_file(self) -> Path:  # the run's inference-engine API key, by the first caller of api_key()
        return self.path / "engine_api_key"

    @property
    def state(self) -> Path:  # controller's view of the run, for relax-status
        return self.path / "state.json"

    @property
    def controller_addr(self) -> Path:  # {host, port} of the control socket, by the controller
        return self.path / "controller.json"

    @property
    def draining(self) -> Path:  # JSON list of the engines leaving (no new requests), by the controller
        return self.path / "draining"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def rendezvous(self) -> Path:  # local-mode handshake files
        return self.path / "rendezvous"

    @property
    def name(self) -> str:
        return self.path.name

    def token(self) -> str:
        return self.token_file.read_text().strip()

    def api_key(self) -> str:
        """The run's API key for its inference engines (``Authorization: Bearer KEY``): without it anyone on
        the cluster's network could generate with, or overwrite the weights of, a run's engines.

        Generated once, on first use, and kept (mode 0600) in the run directory, so every rank, a requeued job
        and a restarted engine agree on it. Ranks on several nodes may ask at once: the file is written
        whole under a private name and linked into place, and a rank that loses the race reads the winner's."""
        try:
            return self.api_key_file.read_text().strip()
        except FileNotFoundError:
            pass
        tmp = self.api_key_file.with_name(f".{self.api_key_file.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        write_private(tmp, secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, self.api_key_file)  # atomic, and fails if another rank got there first
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return self.api_key_file.read_text().strip()

    def read_json(self, which: Path, default: Any = None) -> Any:
        try:
            return json.loads(which.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return default


def create_run_dir(runs_root: str | Path, name: str) -> RunDir:
    """A new, private run directory ``<runs_root>/<name>-<timestamp>`` with a fresh token."""
    root = Path(runs_root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = root / (f"{name}-{stamp}" if i == 0 else f"{name}-{stamp}-{i}")
        try:
            path.mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover
        raise RuntimeError(f"could not make a new run directory under {root}")
    os.chmod(path, 0o700)  # mkdir's mode is masked by umask
    rd = RunDir(path)
    for sub in (rd.logs, rd.rendezvous):
        sub.mkdir(mode=0o700)
    write_private(rd.token_file, secrets.token_hex(32) + "\n")
    return rd


def write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically (tmp + fsync + rename), readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries durable (a create, rename or unlink in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range  # ctypes drops the GIL in the call
    except (AttributeError, OSError, TypeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return f


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the device now, without waiting
    for it (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; the call itself may block while the device's queue is
    full). A large file written piece by piece, each piece started as it lands, then overlaps the device's
    writing with the copying of the rest, and the closing ``fsync`` waits only for the tail: 14 MB went from
    10.6 to 7 ms here. Durability is still the ``fsync``'s job; where the call is
    missing (not Linux) or fails, this does nothing. Returns whether the kernel took the request (if not,
    ``ctypes.get_errno()`` says why)."""
    f = _sync_file_range()
    return f is not None and f(fd, offset, nbytes, 2) == 0  # SYNC_FILE_RANGE_WRITE


def write_json(path: Path, data: Any) -> None:
    write_private(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
