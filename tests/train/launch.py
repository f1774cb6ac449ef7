"""Run ``worker.py`` as N ranks (gloo on CPU), torchrun-style, and return rank 0's result.

Rendezvous: this (pytest) process holds a ``TCPStore`` bound to port 0, so the kernel picks a free
port and two test runs on one machine never collide. Every rank runs in its own session with a hard
timeout; on timeout the whole process group of each rank is killed (by its pid) and the test fails
with the ranks' output tails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"


def run_job(job: str, args: dict, *, nproc: int, out_dir: Path, timeout: float = 180) -> dict:
    import torch.distributed as dist

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        WORLD_SIZE=str(nproc), RELAX_TEST_STORE=f"127.0.0.1:{store.port}", MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1" if nproc > 1 else "2"),
        PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false",
    )
    procs, logs = [], []
    for rank in range(nproc):
        log = tempfile.TemporaryFile(mode="w+")
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), job, str(out_dir), json.dumps(args)],
                                      env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO))
        logs.append(log)
    failed, deadline, grace_until = None, time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                failed = f"timed out after {timeout} s"
                break
            if grace_until is None and any(p.returncode for p in procs if p.poll() is not None):
                grace_until = now + 15  # a rank died: its peers are likely stuck in a collective
            if grace_until is not None and now > grace_until:
                failed = "a rank failed and the others did not finish"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # each rank leads its own session: kills it and its helpers
                p.wait()
    tails = []
    for rank, log in enumerate(logs):
        log.seek(0)
        tails.append(f"--- rank {rank} (rc={procs[rank].returncode}) ---\n" + log.read()[-6000:])
        log.close()
    if os.environ.get("RELAX_TEST_SHOW_LOGS"):
        print("\n".join(tails))
    if failed is None and any(p.returncode for p in procs):
        failed = "a rank failed"
    result_file = out_dir / "result.json"
    if failed or not result_file.exists():
        raise AssertionError(f"{job} ({nproc} ranks): {failed or 'no result'}\n" + "\n".join(tails))
    return json.loads(result_file.read_text())
