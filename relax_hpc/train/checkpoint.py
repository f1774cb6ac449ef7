"""Training checkpoints with megatron-core ``dist_checkpointing`` (torch_dist format), resumable at any TP/PP.

Layout of a checkpoint root::

    ROOT/step_00000012/            one complete checkpoint
        .metadata, __*_*.distcp, common.pt, metadata.json   model + optimizer (dist_checkpointing)
        rng/rank_00000.pt ...      per-rank python/numpy/torch RNG states
        manifest.sha256            sha256 of every file above (:mod:`.manifest`), once they are fsynced
        meta.json                  step, extra_state, layout, "manifest"; written after everything above
    ROOT/latest                    "step_00000012": written last, atomically (tmp + fsync + rename), once
                                   every file and directory of the step dir is fsynced (:func:`fsync_tree`)

Why these choices:
* The DistributedOptimizer state is saved ``fully_reshardable`` (not ``dp_reshardable``): a TP=2
  checkpoint then resumes at TP=1 (measured bit-exact, with the fixes in :mod:`.cpu_compat`).
* ``latest`` is the only thing a resumer trusts: a save killed half way (preemption) leaves a step dir
  without ``meta.json`` and ``latest`` still names the previous complete checkpoint.
* Nothing is read that the save did not write: :func:`load` checks every file against the manifest first (each
  rank a share of the files), and refuses a damaged checkpoint naming the file (:class:`CheckpointDamaged`, a
  permanent error: a restart reads the same bytes); one saved before manifests loads with a warning after a
  size check of its shards against ``.metadata`` (a truncated file is named, not an ``EOFError``).
* RNG states are per rank and do not reshard; on a different layout each rank takes rank 0's state
  (dropout is 0 in training, so the model's numbers do not depend on it).
* Saves are synchronous. Upstream then still starts a ``spawn`` multiprocessing Manager (2-3 s per
  process, and a hang forever if the entry script lacks ``if __name__ == "__main__":``) only to pass
  write results from one function to another *in the same process*; :func:`_in_process_results_queue`
  hands it a plain ``queue.Queue`` instead. The writer still forks worker processes, which need psutil.
"""

from __future__ import annotations

import json
import logging
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
from relax_hpc.train import manifest
from relax_hpc.train.latest import LATEST, complete, resolve, step_dir_name  # noqa: F401 - the layout, shared
from relax_hpc.train.manifest import CheckpointDamaged  # noqa: F401 - what load raises

log = logging.getLogger("relax_hpc.checkpoint")
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


def _chunk_state(chunk) -> dict:
    from relax_hpc.train import lora

    sd = chunk.sharded_state_dict()
    if lora.has_lora([chunk]):  # the adapters only: the frozen base is the model it records (meta.json "lora")
        sd = {k: v for k, v in sd.items() if lora.is_adapter_key(k)}
    return sd


def _sharded_state_dict(model: list, optimizer, *, is_loading: bool) -> dict:
    chunks = _unwrapped(model)
    if len(chunks) == 1:
        model_sd = _chunk_state(chunks[0])
    else:  # virtual pipeline chunks, Megatron-LM's naming
        model_sd = {}
        for i, c in enumerate(chunks):
            model_sd.update({f"model{i}": _chunk_state(c)})
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
    # Every rank hashes the files it wrote (still in its page cache); rank 0 the rest, then writes the manifest.
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, manifest.hash_files(out, manifest.own_files(out, rank)))
    if rank == 0:
        extra = dict(extra_state or {})
        meta = {"step": step, "layout": _layout(), "time": time.time(), "manifest": manifest.MANIFEST}
        from relax_hpc.train.lora import has_lora

        rec = has_lora(model)
        if rec:  # the adapters' setting and the base model they adapt: load refuses another
            meta["lora"] = rec
        try:
            json.dumps(extra)
            meta["extra_state"] = extra
        except (TypeError, ValueError):  # not JSON: keep it as a pickle beside meta.json
            _fsync_write(out / "extra_state.pkl", pickle.dumps(extra))
            meta["extra_state_pickle"] = "extra_state.pkl"
        listed = {k: v for d in digests for k, v in d.items()}
        listed.update(manifest.hash_files(out, [n for n in manifest.listing(out) if n not in listed]))
        manifest.write(out, listed)
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


def load(path: str | os.PathLike, model: list, optimizer, *, load_optimizer: bool = True,
         verify: bool = True) -> tuple[int, dict]:
    """Collective. Loads model (+ optimizer, RNG) at any TP/PP; returns (step, extra_state).

    First every file is checked against the checkpoint's manifest (:func:`verify_collective`; ``verify=False``
    only where the caller just did, as relax-export). A damaged checkpoint raises :class:`CheckpointDamaged`
    naming the file and the fix, on every rank."""
    from megatron.core import dist_checkpointing

    step_dir = resolve(path)
    meta = json.loads((step_dir / "meta.json").read_text())
    if verify:
        verify_collective(step_dir, meta)
    from relax_hpc.train.lora import check_base

    check_base(meta.get("lora"), model, str(step_dir))
    opt = optimizer if load_optimizer else None
    sd = _sharded_state_dict(model, opt, is_loading=True)
    try:
        state = dist_checkpointing.load(sd, str(step_dir))
    except Exception as e:  # CheckpointException is a BaseException: caught below
        raise _load_failed(step_dir, e) from e
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _load_failed(step_dir, e) from e
    chunks = _unwrapped(model)
    for i, c in enumerate(chunks):
        _load_chunk(c, state["model"] if len(chunks) == 1 else state["model"][f"model{i}"], bool(meta.get("lora")))
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


def _load_chunk(chunk, state: dict, adapters_only: bool) -> None:
    """Load one chunk's state; a LoRA checkpoint's adapters only (the base stays as built from model.path, which
    :func:`relax_hpc.train.lora.check_base` checked), and every adapter must be there."""
    if not adapters_only:
        chunk.load_state_dict(state, strict=True)
        return
    from relax_hpc.train.lora import is_adapter_key

    missing, unexpected = chunk.load_state_dict(state, strict=False)
    missing = [k for k in missing if is_adapter_key(k)]
    if missing or unexpected:
        raise RuntimeError(f"LoRA checkpoint does not fit the model: adapters missing {missing[:3]}, "
                           f"unexpected keys {list(unexpected)[:3]}")


RESUME_FIX = ("resume from an earlier complete checkpoint (write its name into the checkpoint root's `latest`, "
              "e.g. `echo step_00000010 > RUN_DIR/checkpoints/latest`), or put back the files from a copy")
NO_MANIFEST = ("checkpoint {} has no {} (saved before checkpoints carried checksums): its bytes cannot be checked, "
               "only the sizes of its files")


def problems(step_dir: str | os.PathLike, meta: dict, rank: int = 0, world: int = 1) -> tuple[list[str], str | None]:
    """(what is wrong with this rank's share of a checkpoint's files, a warning): the manifest's check, or for a
    checkpoint saved before manifests, its shards' sizes against ``.metadata`` and a warning. Never raises."""
    found, has = manifest.check(step_dir, meta, rank, world)
    if has:
        return found, None
    return (short_files(step_dir) if rank == 0 else []), NO_MANIFEST.format(step_dir, manifest.MANIFEST)


def verify_collective(step_dir: str | os.PathLike, meta: dict, fix: str = RESUME_FIX) -> None:
    """Collective: each rank checks its share of the files; if any rank found damage, every rank raises
    :class:`CheckpointDamaged` with all of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, warning = problems(step_dir, meta, rank, world)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    found = [p for ps in everyone for p in ps]
    if found:
        raise manifest.damaged(step_dir, found, fix)
    if warning and rank == 0:
        log.warning("%s", warning)


def short_files(step_dir: str | os.PathLike) -> list[str]:
    """The shards of a torch_dist checkpoint shorter than its ``.metadata`` says (a copy or a save cut short),
    each named; an unreadable ``.metadata`` is named too."""
    from torch.distributed.checkpoint import FileSystemReader

    root = Path(step_dir)
    try:
        storage = FileSystemReader(str(root)).read_metadata().storage_data
    except BaseException as e:  # an unpickling error of a damaged file can be anything
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return [f"{root / '.metadata'} cannot be read ({type(e).__name__}: {_first_line(e)})"]
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    bad = []
    for rel, n in sorted(need.items()):
        try:
            size = (root / rel).stat().st_size
        except FileNotFoundError:
            bad.append(f"{root / rel} is missing")
            continue
        if size < n:
            bad.append(f"{root / rel} is truncated ({size} bytes, .metadata says at least {n})")
    return bad


def _load_failed(step_dir: Path, e: BaseException) -> BaseException:
    """What dist_checkpointing raised, as one line naming the checkpoint: torch's ``CheckpointException`` carries
    each rank's error with a traceback in its text; a bare ``EOFError`` names nothing."""
    failures = getattr(e, "failures", None)
    inner = list(failures.values()) if isinstance(failures, dict) else [e]
    inner = [x[0] if isinstance(x, tuple) else x for x in inner]
    what = "; ".join(f"{type(x).__name__}: {_first_line(x)}" if str(x).strip() else type(x).__name__ for x in inner)
    if all(isinstance(x, OSError) and not isinstance(x, FileNotFoundError) for x in inner):
        return RuntimeError(f"checkpoint {step_dir} could not be read ({what}); a filesystem error may pass: "
                            "try again")
    short = short_files(step_dir)
    named = f" ({'; '.join(short)})" if short else ""
    return CheckpointDamaged(f"checkpoint {step_dir} cannot be loaded: {what}{named}: its files are damaged or "
                             "were not all written", RESUME_FIX)


def _first_line(e: BaseException, limit: int = 300) -> str:
    """An error's first line, printable ASCII only: an unpickling error may quote the damaged bytes."""
    line = "".join(c if " " <= c <= "~" else "?" for c in (str(e).strip().splitlines() or [""])[0])
    return line if len(line) <= limit else line[:limit] + "…"
