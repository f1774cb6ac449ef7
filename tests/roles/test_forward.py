"""The forward-only roles (reference, actor_fwd): log-probs written as side fields of a chunk equal the
actor's own forward and transformers' log-softmax; ``load`` refreshes the weights from a checkpoint; and the
actor's batch picks the side fields up.

Megatron runs in a child process (this file run as a script, one rank, gloo on CPU), as tests/train do:
its parallel state and the CPU layer's process-wide torch function mode must stay out of pytest's process.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
# (prompt, response): tokens from the tiny model's vocab (128), responses of 2+ tokens
SAMPLES = [([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14, 15]), ([20, 21, 22, 23], [100, 101, 127]),
           ([30], [40, 41, 42, 43, 44, 45])]


def _chunk_fields(samples=SAMPLES) -> dict:
    return {
        "tokens": [np.asarray(p + r, dtype=np.int64) for p, r in samples],
        "response_length": np.asarray([len(r) for _, r in samples], dtype=np.int64),
        "loss_mask": [np.ones(len(r), dtype=np.float32) for _, r in samples],
        "rollout_log_probs": [np.full(len(r), -1.0, dtype=np.float32) for _, r in samples],
        "raw_reward": np.asarray([1.0, 0.0, 1.0, 0.0], dtype=np.float32)[: len(samples)],
        "index": np.arange(len(samples), dtype=np.int64),
        "weight_version": ["0"] * len(samples),
    }


def _write_chunk(root: Path, step: int = 1):
    from relax_hpc.exchange.chunk import write_chunk

    (root / f"step_{step}").mkdir(parents=True, exist_ok=True)
    return write_chunk(root, step, "rollout", 0, _chunk_fields())


def test_train_batch_picks_up_forward_log_probs(tmp_path):
    import torch

    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.exchange.chunk import write_fields
    from relax_hpc.train import plan as P
    from relax_hpc.train.samples import read_columns

    ref = _write_chunk(tmp_path)
    lens = [len(r) for _, r in SAMPLES]
    refl = [np.arange(n, dtype=np.float32) - 9.0 for n in lens]  # log-probs: <= 0
    old = [np.arange(n, dtype=np.float32) - 7.0 for n in lens]
    ref = ref.with_side(write_fields(ref, "reference", {"ref_log_probs": refl}))
    ref = ref.with_side(write_fields(ref, "actor_fwd", {"log_probs": old[:3] + [np.zeros(1, np.float32)]}))
    batch, _ = P.read_train_batch([ref.to_dict()], AlgorithmConfig(), group_size=1)  # picks up the side fields
    for i, b in enumerate(batch):
        assert b.ref_log_probs.dtype == torch.float32 and torch.equal(b.ref_log_probs, torch.as_tensor(refl[i]))
    assert all(torch.equal(batch[i].old_log_probs, torch.as_tensor(old[i])) for i in range(3))
    assert batch[3].old_log_probs is None  # not the response's length: left out, as rollout_log_probs is
    plain, _ = P.train_batch(read_columns([ref]), AlgorithmConfig(), 1)  # not asked for: not on the batch
    assert all(b.ref_log_probs is None and b.old_log_probs is None for b in plain)


def test_forward_logprobs_match_megatron_and_transformers(tmp_path):
    tool = _tiny_model_tool()
    model = tool.make_tiny_model(tmp_path / "qwen3", arch="qwen3", seed=0)
    ref = _write_chunk(tmp_path / "exchange")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, __file__, str(model), json.dumps(ref.to_dict()), str(tmp_path)], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    res = json.loads((tmp_path / "result.json").read_text())
    print(f"child: {time.monotonic() - t0:.1f} s; {res}")
    assert res["lengths"] == [len(r) for _, r in SAMPLES]
    assert res["side"]["writer"] == "reference" and res["side"]["fields"] == ["ref_log_probs"]
    assert res["dtype"] == "float32"
    assert res["vs_megatron"] <= 1e-6, res
    assert res["vs_hf"] <= 1e-4, res
    assert max(res["values_range"]) < 0  # real log-probs
    assert res["again_same_side"]  # a retried task finds the side it wrote
    assert res["perturbed_diff"] > 1e-3  # the perturbation moved the log-probs ...
    assert res["after_load_diff"] <= 1e-6 and res["loaded_step"] == 0  # ... and `load` brought them back


def _tiny_model_tool():
    path = REPO / "tools" / "make-tiny-model"
    loader = importlib.machinery.SourceFileLoader("make_tiny_model", str(path))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("make_tiny_model", loader))
    loader.exec_module(mod)
    return mod


def _child(model: str, ref_json: str, out: Path) -> dict:
    """One rank: build as the role does, compute_and_write, read back, compare; then save, perturb, load."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from relax_hpc.exchange.chunk import ChunkRef, read_chunk
    from relax_hpc.recipe.schema import Recipe
    from relax_hpc.roles import forward as F
    from relax_hpc.train.batch import TrainingSample
    from relax_hpc.train.build import build_megatron
    from relax_hpc.train import cpu_compat

    tm: dict[str, float] = {}
    t = time.monotonic()
    dist.init_process_group(cpu_compat.backend(), store=dist.HashStore(), rank=0, world_size=1)
    recipe = Recipe()
    recipe.roles.reference.cpus_per_task = 2
    recipe.model.path = str(model)
    actor = build_megatron(recipe, "reference", str(model), forward_only=True)
    tm["build_s"] = time.monotonic() - t
    ref = ChunkRef.from_dict(json.loads(ref_json))
    t = time.monotonic()
    (side,) = F.compute_and_write(actor, [ref.to_dict()], "ref_log_probs", "reference", rank=0)  # a SideRef
    tm["logprobs_s"] = time.monotonic() - t
    got = read_chunk(ref.with_side(side), ["ref_log_probs"])["ref_log_probs"]
    (again,) = F.compute_and_write(actor, [ref.with_side(side)], "ref_log_probs", "reference", 0)

    cols = read_chunk(ref, ["tokens", "response_length"])
    batch = [TrainingSample.of(tk, len(tk) - int(n)) for tk, n in zip(cols["tokens"], cols["response_length"])]
    meg = actor.compute_log_probs(batch)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    vs_meg = vs_hf = 0.0
    for g, m, b in zip(got, meg, batch):
        tk, s = b.tokens, b.response_start
        with torch.no_grad():
            full = torch.log_softmax(hf(tk[None]).logits[0].float(), -1)
        want = full[s - 1: -1].gather(-1, tk[s:, None])[:, 0]
        vs_meg = max(vs_meg, (torch.as_tensor(g) - m).abs().max().item())
        vs_hf = max(vs_hf, (torch.as_tensor(g) - want).abs().max().item())

    t = time.monotonic()
    actor.save_checkpoint(out / "ckpt")
    tm["save_s"] = time.monotonic() - t
    with torch.no_grad():
        for p in actor.model[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = actor.compute_log_probs(batch)
    t = time.monotonic()
    step = F.load_weights(actor, str(out / "ckpt"))
    tm["load_s"] = time.monotonic() - t
    back = actor.compute_log_probs(batch)
    return {"lengths": [len(g) for g in got], "dtype": str(got[0].dtype), "side": side.to_dict(), "vs_megatron": vs_meg,
            "vs_hf": vs_hf, "values_range": [float(min(g.min() for g in got)), float(max(g.max() for g in got))],
            "again_same_side": again == side, "loaded_step": step,
            "perturbed_diff": max((a - b).abs().max().item() for a, b in zip(moved, meg)),
            "after_load_diff": max((a - b).abs().max().item() for a, b in zip(back, meg)), "timings": tm}


if __name__ == "__main__":  # the child (the guard is needed: dist_checkpointing's writer re-imports __main__)
    result = _child(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    (Path(sys.argv[3]) / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (seconds with megatron and transformers loaded)
