"""A producer killed (SIGKILL, a real process) while it writes leaves no visible partial chunk."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relax_hpc.exchange import Broker
from relax_hpc.exchange.chunk import is_tmp, partition_dir, read_header, sweep_tmp, verify_file, visible_chunks

from .helpers import produce

REPO = Path(__file__).resolve().parents[2]

# The child writes one big chunk slowly: os.pwritev is slowed per 64 KiB block, and it says (by a marker
# file) when the first block is out; with FSYNC_HANG it instead hangs inside the fsync before the link.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from relax_hpc.exchange import chunk
    root, marker, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    chunk._WRITE_BLOCK = 1 << 16
    real_write, real_fsync = os.pwritev, os.fsync
    def slow_write(fd, data, offset):
        n = real_write(fd, data, offset)
        if not os.path.exists(marker):
            open(marker, "w").close()
        time.sleep(0.002)
        return n
    def hanging_fsync(fd):
        real_fsync(fd)
        open(marker, "w").close()
        time.sleep(60)
    if mode == "slow":
        os.pwritev = slow_write
    elif mode == "fsync_hang":
        os.fsync = hanging_fsync
    if mode == "loop":
        open(marker, "w").close()
        rng = np.random.default_rng(int(sys.argv[4]))
        for seq in range(10**6):  # a new incarnation starts at seq 0 again: taken names must be skipped
            n = int(rng.integers(1, 64))
            toks = [rng.integers(0, 32000, size=int(rng.integers(1, 4096)), dtype=np.int32) for _ in range(n)]
            try:
                chunk.write_chunk(root, 0, "rollout", seq, {"tokens": toks, "reward": rng.random(n)})
            except chunk.ChunkExists:
                pass
    else:
        toks = [np.full(8192, i, dtype=np.int64) for i in range(256)]  # 16 MiB: 256 blocks of 64 KiB
        chunk.write_chunk(root, 0, "rollout", 0, {"tokens": toks})
        print("FINISHED", flush=True)
    """
)


def _spawn(root: Path, marker: Path, mode: str, seed: int = 0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(marker), mode, str(seed)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(marker: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("child never started writing")
        time.sleep(0.005)


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read()


@pytest.mark.parametrize("mode", ["slow", "fsync_hang"])
def test_killed_mid_write_leaves_no_visible_chunk(xroot, tmp_path, mode):
    partition_dir(xroot, 0).mkdir()
    marker = tmp_path / "marker"
    proc = _spawn(xroot, marker, mode)
    _wait_for(marker, proc)
    time.sleep(random.uniform(0, 0.1))
    _kill(proc)
    names = os.listdir(partition_dir(xroot, 0))
    assert visible_chunks(xroot, 0) == [], names
    assert len(names) == 1 and is_tmp(names[0]), names  # only the hidden temporary file
    # a broker restarted on this exchange sees nothing; the producer that replaces the dead one gets its seq back
    with Broker(xroot, tasks={"train": ["tokens"]}) as b:
        b.start_step(0)
        assert b.chunks() == [] and b.orphans() == []
        ref = produce(b, xroot, "rollout", 0, {"tokens": [[1, 2, 3]]})
        assert ref.name == "chunk_rollout_0"
        assert [p.name for p in b.sweep(older_than_s=0)] == names
    assert os.listdir(partition_dir(xroot, 0)) == ["chunk_rollout_0.h5"]


def test_killed_at_random_times_only_complete_chunks_are_visible(xroot, tmp_path):
    partition_dir(xroot, 0).mkdir()
    for i in range(3):
        marker = tmp_path / f"marker{i}"
        before = {p.name: read_header(p)["checksum"] for p in visible_chunks(xroot, 0)}
        proc = _spawn(xroot, marker, "loop", seed=i)
        _wait_for(marker, proc)
        time.sleep(random.uniform(0.05, 0.4))
        _kill(proc)
        for p in visible_chunks(xroot, 0):
            meta = verify_file(p)  # complete: size and checksum from its own header hold
            assert meta["kind"] == "chunk" and meta["n"] >= 1
        assert sum(is_tmp(n) for n in os.listdir(partition_dir(xroot, 0))) <= 1
        sweep_tmp(xroot, older_than_s=0)
        after = {p.name: read_header(p)["checksum"] for p in visible_chunks(xroot, 0)}
        assert before.items() <= after.items()  # nothing that was visible was replaced or removed
    assert all(not is_tmp(n) for n in os.listdir(partition_dir(xroot, 0)))
    assert all(read_header(p)["size"] == p.stat().st_size for p in visible_chunks(xroot, 0))
