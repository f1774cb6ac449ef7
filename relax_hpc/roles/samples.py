"""Rollout samples ↔ chunk files ↔ the actor's training batch (colocate mode).

The rollout role writes one step's samples as one chunk (:mod:`relax_hpc.exchange.chunk`) in
``RUN_DIR/exchange/step_<N>/``; the chunk's ref (path, checksum, size, ...) travels to the actor in its
``train`` task through the controller, and the actor reads it back, checksum verified, into the batch
format of :mod:`relax_hpc.train.batch`. Only this module knows which sample fields make the trip.

Fields (one value per sample; Relax's names where Relax has them):

=====================  ========  ==========================================================================
``tokens``             ragged    prompt + response token ids (int64)
``response_length``    fixed     response tokens (the last ones of ``tokens``)
``loss_mask``          ragged    over the response (0/1)
``rollout_log_probs``  ragged    the engine's log-prob of each response token (float32)
``rewards``            fixed     R̃: the reward after group normalization (the advantage before broadcast)
``raw_reward``         fixed     R: the scalar reward
``index``              fixed     ``sample.index`` (group_index in ``group_index``)
``weight_version``     json      the engine's weight version when it finished the sample
``status``             json      completed / truncated / aborted / failed
``prompt``, ``response``, ``label``  json  for people reading the files
``ref_log_probs``      ragged    side file of the reference role: π_ref of each response token (float32)
``log_probs``          ragged    side file of the actor_fwd role: π_old of each response token (float32)
=====================  ========  ==========================================================================

The last two are optional (:data:`FORWARD_FIELDS`): a chunk has them once those roles added them
(:mod:`relax_hpc.roles.forward`), and a caller that wants them passes them in ``read_samples``'s ``fields``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from relax_hpc.exchange.chunk import ChunkRef, DamagedChunk, read_chunk, write_chunk

PRODUCER = "rollout"
TRAIN_FIELDS = ("tokens", "response_length", "loss_mask", "rollout_log_probs", "rewards", "raw_reward", "index",
                "weight_version")
FORWARD_FIELDS = ("ref_log_probs", "log_probs")  # optional side fields: to_train_batch → ref_/old_log_probs


def exchange_root(run_path: str | os.PathLike) -> str:
    return os.path.join(str(run_path), "exchange")


def write_step(run_path: str | os.PathLike, step: int, result: Any, seq: int = 0) -> ChunkRef:
    """Write a :class:`~relax_hpc.rollout.driver.RolloutResult` as the chunk of rollout step ``step``."""
    s = result.samples
    root = exchange_root(run_path)
    os.makedirs(os.path.join(root, f"step_{int(step)}"), exist_ok=True)
    fields = {
        "tokens": [np.asarray(x.tokens, dtype=np.int64) for x in s],
        "response_length": np.asarray([x.response_length for x in s], dtype=np.int64),
        "loss_mask": [np.asarray(x.loss_mask if x.loss_mask is not None else [1] * x.response_length,
                                 dtype=np.float32) for x in s],
        "rollout_log_probs": [np.asarray(x.rollout_log_probs or [], dtype=np.float32) for x in s],
        "rewards": np.asarray(result.rewards, dtype=np.float32),
        "raw_reward": np.asarray(result.raw_rewards, dtype=np.float32),
        "index": np.asarray([-1 if x.index is None else x.index for x in s], dtype=np.int64),
        "group_index": np.asarray([-1 if x.group_index is None else x.group_index for x in s], dtype=np.int64),
        "weight_version": [x.weight_version for x in s],
        "status": [x.status.value for x in s],
        "prompt": [x.prompt for x in s],
        "response": [x.response for x in s],
        "label": [x.label for x in s],
    }
    return write_chunk(root, step, PRODUCER, seq, fields, attrs={"group_size": result.group_size})


def read_samples(refs: Sequence[dict | ChunkRef], fields: Sequence[str] = TRAIN_FIELDS, *,
                 agree: bool = False) -> list[dict[str, Any]]:
    """The samples of these chunks (in order) as dicts of ``fields``; raises DamagedChunk on a bad file.

    ``agree``: a collective of the role's ranks (each reads the same chunks): if any rank could not read, every
    rank raises DamagedChunk, so none goes on into a collective that the others never join."""
    out: list[dict[str, Any]] = []
    damage = None
    try:
        for r in refs:
            ref = r if isinstance(r, ChunkRef) else ChunkRef.from_dict(r)
            cols = read_chunk(ref, list(fields))
            out += [{k: cols[k][i] for k in fields} for i in range(ref.n)]
    except DamagedChunk as e:
        damage = e
    if agree and _any_rank(damage is not None) and damage is None:
        first = refs[0] if refs else None
        path = (first.path if isinstance(first, ChunkRef) else (first or {}).get("path")) if first else "?"
        damage = DamagedChunk(path, "another rank of this role could not read this task's chunks")
    if damage is not None:
        raise damage
    return out


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the role's process group (just ``flag`` without one)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def to_train_batch(samples: list[dict[str, Any]], algo_cfg: Any, process_group: Any = None) -> list[dict[str, Any]]:
    """The actor's batch (:mod:`relax_hpc.train.batch`): tokens, response_start, per-token advantages
    (R̃ broadcast over the loss mask, whitened if ``algorithm.normalize_advantages``), loss_mask and
    rollout_log_probs; ``ref_log_probs`` and ``old_log_probs`` from a sample's ``ref_log_probs`` and
    ``log_probs`` when it has them."""
    import torch

    from relax_hpc.algo.advantages import broadcast_advantages

    lens = [int(s["response_length"]) for s in samples]
    T = max(lens)
    mask = torch.zeros(len(samples), T)
    for i, s in enumerate(samples):
        mask[i, : lens[i]] = torch.as_tensor(np.asarray(s["loss_mask"], dtype=np.float32))
    rewards = torch.as_tensor(np.asarray([float(s["rewards"]) for s in samples], dtype=np.float32))
    adv = broadcast_advantages(algo_cfg, rewards, mask, process_group=process_group)
    batch = []
    for i, s in enumerate(samples):
        tokens = torch.as_tensor(np.asarray(s["tokens"], dtype=np.int64))
        r = lens[i]
        item = {"tokens": tokens, "response_start": int(tokens.numel() - r), "advantages": adv[i, :r].clone(),
                "loss_mask": mask[i, :r].clone()}
        lp = np.asarray(s["rollout_log_probs"], dtype=np.float32)
        if lp.size == r:
            item["rollout_log_probs"] = torch.as_tensor(lp)
        for name, key in (("ref_log_probs", "ref_log_probs"), ("log_probs", "old_log_probs")):
            if name in s and np.size(s[name]) == r:
                item[key] = torch.as_tensor(np.asarray(s[name], dtype=np.float32))
        batch.append(item)
    return batch
