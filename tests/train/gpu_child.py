"""The child process of the one-GPU tests (tests/train/test_gpu.py, tests/recipe/test_memory_plan_gpu.py): the test
file runs itself as ``python FILE JOBS_JSON OUT_DIR`` in a session of its own, on a one-rank group (NCCL on a GPU:
megatron's parallel state is process-wide), every job in that one process (imports cost ~15 s a process); each
job's failure is its own entry of the result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[2]


def run_child(script: str, jobs: dict, out_dir: Path, timeout: float) -> dict:
    """Run ``jobs`` ({name: [job, args]}) in ``python script`` (a test file whose ``__main__`` is
    :func:`child_main`); killed with its session on timeout. The child's ``result.json``: {name: result, name_s:
    seconds}."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    log = out_dir / "child.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, script, json.dumps(jobs), str(out_dir)], env=env, cwd=REPO,
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:  # a timeout, or pytest interrupted by tools/gpu-check: never leave it on the GPU
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    result = out_dir / "result.json"
    if p.returncode != 0 or not result.exists():
        raise AssertionError(f"child (exit {p.returncode}) wrote no result:\n{log.read_text()[-8000:]}")
    return json.loads(result.read_text())


def child_main(table: dict[str, Callable[[dict, Path], dict]]) -> None:
    """Every job of argv[1], each ``table[job](args, out_dir)``, on a one-rank group; ``result.json`` in argv[2].
    Exits without teardown (megatron + transformers take seconds)."""
    import torch.distributed as dist

    from relax_hpc.train import cpu_compat

    jobs, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    cpu_compat.compile_eagerly()  # as the roles do (nothing on a GPU)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group(cpu_compat.backend(), store=store, rank=0, world_size=1)
    res = {}
    for name, (job, args) in jobs.items():
        t0 = time.time()
        try:
            res[name] = table[job](args, out)
        except Exception:
            traceback.print_exc()
            res[name] = {"error": traceback.format_exc()}
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():  # the next job starts from a clean parallel state
                ps.destroy_model_parallel()
        res[name + "_s"] = time.time() - t0
    (out / "result.json").write_text(json.dumps(res))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
