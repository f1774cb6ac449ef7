"""Training checkpoints with megatron-core ``dist_checkpointing`` (torch_dist format), resumable at any TP/PP.

Layout of a checkpoint root::

    ROOT/step_00000012/            one complete checkpoint
        .metadata, __*_*.distcp, common.pt, metadata.json   model + optimizer (dist_checkpointing)
        rng/rank_00000.pt ...      per-rank python/numpy/torch RNG states
        meta.json                  step, extra_state, layout; written after everything above
    ROOT/latest                    "step_00000012": written last, atomically (tmp + fsync + rename), once
                                   every file and directory of the step dir is fsynced (:func:`fsync_tree`)

Why these choices:
* The DistributedOptimizer state is saved ``fully_reshardable`` (not ``dp_reshardable``): a TP=2
  checkpoint then resumes at TP=1 (measured bit-exact, with the fixes in :mod:`.cpu_compat`).
* ``latest`` is the only thing a resumer trusts: a save killed half way (preemption) leaves a step dir
  without ``meta.json`` and ``latest`` still names the previous complete checkpoint.
* RNG states are per rank and do not reshard; on a different layout each rank takes rank 0's state
  (dropout is 0 in training, so the model's numbers do not depend on it).
* Saves are synchronous. Upstream then still starts a ``spawn`` multiprocessing Manager (2-3 s per
  process, and a hang forever if the entry script lacks ``if __name__ == "__main__":``) only to pass
  write results from one function to another *in the same process*; :func:`_in_process_results_queue`
  hands it a plain ``queue.Queue`` instead. The writer still forks worker processes, which need psutil.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from relax_hpc.rundir import fsync_dir as _fsync_dir
from relax_hpc.train.latest import LATEST, complete, resolve, step_dir_name  # noqa: F401 - the layout, shared

OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _in_process_results_queue() -> None:
    """Give dist_checkpointing's sync save an in-process results queue instead of a spawned Manager.

    In a synchronous save, ``write_preloaded_data_multiproc`` runs in the calling process and puts the
    merged results on this queue, which ``retrieve_write_results`` reads right after in the same
    process (``get_nowait``: a ``queue.Queue``'s put is synchronous; an ``mp.Queue``'s is not).
    Async saves would need the Manager; this module never makes them.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _unwrapped(model: list) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def _sharded_state_dict(model: list, optimizer, *, is_loading: bool) -> dict:
    chunks = _unwrapped(model)
    if len(chunks) == 1:
        model_sd = chunks[0].sharded_state_dict()
    else:  # virtual pipeline chunks, Megatron-LM's naming
        model_sd = {}
        for i, c in enumerate(chunks):
            model_sd.update({f"model{i}": c.sharded_state_dict()})
    sd = {"model": model_sd}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_METADATA)
    return sd


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"world": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}


def save(root: str | os.PathLike, model: list, optimizer, *, step: int, extra_state: dict | None = None,
         keep: int | None = None) -> Path:
    """Collective: every rank calls it. Returns the step directory. ``keep`` prunes older complete ones."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    out = root / step_dir_name(step)
    rank = dist.get_rank()
    if rank == 0:
        if out.exists():  # a stale or half-written save of the same step
            shutil.rmtree(out)
        out.mkdir(parents=True)
    dist.barrier()
    _in_process_results_queue()
    dist_checkpointing.save(_sharded_state_dict(model, optimizer, is_loading=False), str(out))
    (out / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), out / "rng" / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0 or _local_rank() == 0:  # one rank per node: every file written there is durable before latest
        fsync_tree(out)
    dist.barrier()
    if rank == 0:
        extra = dict(extra_state or {})
        meta = {"step": step, "layout": _layout(), "time": time.time()}
        try:
            json.dumps(extra)
            meta["extra_state"] = extra
        except (TypeError, ValueError):  # not JSON: keep it as a pickle beside meta.json
            _fsync_write(out / "extra_state.pkl", pickle.dumps(extra))
            meta["extra_state_pickle"] = "extra_state.pkl"
        _fsync_write(out / "meta.json", json.dumps(meta, indent=1).encode())
        _fsync_dir(out)
        tmp = root / f".{LATEST}.tmp"
        _fsync_write(tmp, (step_dir_name(step) + "\n").encode())
        os.replace(tmp, root / LATEST)
        _fsync_dir(root)
        if keep:
            _prune(root, keep)
    dist.barrier()
    return out


def _local_rank() -> int | None:
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def fsync_tree(path: str | os.PathLike) -> int:
    """fsync every file and directory under ``path`` (``path`` included): dist_checkpointing writes its files
    itself, without fsync. Returns how many files were synced."""
    n = 0
    for d, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            n += 1
        _fsync_dir(d)
    return n


def _prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints up to the one ``latest`` names, which is never deleted.
    Ones after it (an earlier life of a run resumed from an older checkpoint) are left for the resumed run to
    overwrite as it reaches their steps."""
    target = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
    done = [p for p in complete(root) if target is None or p.name <= target]
    for p in done[:-keep]:
        if p.name != target:
            shutil.rmtree(p, ignore_errors=True)


def load(path: str | os.PathLike, model: list, optimizer, *, load_optimizer: bool = True) -> tuple[int, dict]:
    """Collective. Loads model (+ optimizer, RNG) at any TP/PP; returns (step, extra_state)."""
    from megatron.core import dist_checkpointing

    step_dir = resolve(path)
    meta = json.loads((step_dir / "meta.json").read_text())
    opt = optimizer if load_optimizer else None
    sd = _sharded_state_dict(model, opt, is_loading=True)
    state = dist_checkpointing.load(sd, str(step_dir))
    chunks = _unwrapped(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"], strict=True)
    else:
        for i, c in enumerate(chunks):
            c.load_state_dict(state["model"][f"model{i}"], strict=True)
    if opt is not None:
        opt.load_state_dict(state["optimizer"])
    same_layout = meta.get("layout") == _layout()
    rng_file = step_dir / "rng" / f"rank_{(dist.get_rank() if same_layout else 0):05d}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    if "extra_state_pickle" in meta:
        extra = pickle.loads((step_dir / meta["extra_state_pickle"]).read_bytes())
    else:
        extra = meta.get("extra_state", {})
    dist.barrier()
    return int(meta["step"]), extra
