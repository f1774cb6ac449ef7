"""Fixtures for relax_hpc.train tests: tiny HF models made offline by tools/make-tiny-model, and the
multi-process runs (one launch serves several tests: importing megatron + the bridge costs ~8 s a process)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

from train.launch import run_job

REPO = Path(__file__).resolve().parents[2]

# One GRPO setting for every layout, so TP=1, TP=2, DP=2 and PP=2 runs can be compared number by number.
TRAIN_ARGS = {"n": 8, "steps": 5, "lr": 1e-4, "algo": {"eps_clip": 0.2}}
# job_equal: 8 samples of 3-6 prompt + 4-40 response tokens, 2 steps, fp32; variants against micro_batch_size 2
EQUAL_ARGS = {"n": 8, "lengths": [4, 40], "steps": 2, "lr": 1e-4, "base": {"micro_batch_size": 2, "max_seq_len": 64}}
PACKED_VARIANTS = {"packed": {"max_tokens_per_micro_batch": 96},
                   "packed_logprob": {"max_tokens_per_micro_batch": 64, "logprob_max_tokens_per_micro_batch": 200}}
MEMORY_VARIANTS = {"selective": {"recompute": "selective"},
                   "full_uniform": {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
                   "full_block": {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 1}}
TP2_VARIANTS = {"sp": {"sequence_parallel": True}, "packed": PACKED_VARIANTS["packed"],
                "packed_sp": {"sequence_parallel": True, **PACKED_VARIANTS["packed"]}}
# Checkpoint runs: K steps, save, N more; data independent of the model (fixed old log-probs).
RESUME_ARGS = {"k": 3, "n": 3, "lr": 2e-4, "n_samples": 4, "algo": {"eps_clip": 0.5}}


def resume_layouts(root: Path) -> list[dict]:
    return [
        {"name": "dp2", "tp": 1, "distopt": True, "ckpt": str(root / "ck_dp2")},  # optimizer state sharded over DP
        {"name": "tp2", "tp": 2, "distopt": True, "ckpt": str(root / "ck_tp2")},
    ]


def load_tiny_model_tool():
    """tools/make-tiny-model as a module (it has no .py suffix)."""
    path = REPO / "tools" / "make-tiny-model"
    loader = importlib.machinery.SourceFileLoader("make_tiny_model", str(path))
    spec = importlib.util.spec_from_loader("make_tiny_model", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_tool():
    return load_tiny_model_tool()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tool) -> dict[str, str]:
    """{"qwen3": dir, "llama": dir}: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: str(tiny_tool.make_tiny_model(root / arch, arch=arch, seed=0)) for arch in ("qwen3", "llama")}


def part(res: dict, name: str) -> dict:
    """One job's result from a suite run; fails the calling test with the job's traceback."""
    r = res[name]
    assert "error" not in r, f"job {name} failed in the worker:\n{r['error']}"
    return r


@pytest.fixture(scope="session")
def single_run(tiny_models, tmp_path_factory) -> dict:
    """One process (TP=1): bridge parity for both archs, GRPO training on the fixed batch, non-finite steps."""
    jobs = {
        "parity": ["parity", {"tp": 1, "models": tiny_models}],
        "train": ["train", dict(TRAIN_ARGS, hf=tiny_models["qwen3"], layouts=[{"tp": 1}])],
        "nonfinite": ["nonfinite", {"hf": tiny_models["qwen3"], "layouts": [{"tp": 1}]}],
        "attention": ["attention", {}],
        "kernels": ["kernels", {"hf": tiny_models["qwen3"]}],
        # padded micro-batches against packed ones (token budget), and activation recompute against none
        "equal_packed": ["equal", dict(EQUAL_ARGS, hf=tiny_models["qwen3"], variants=PACKED_VARIANTS)],
        "equal_memory": ["equal", dict(EQUAL_ARGS, hf=tiny_models["qwen3"], variants=MEMORY_VARIANTS)],
    }
    return run_job("suite", jobs, nproc=1, out_dir=tmp_path_factory.mktemp("single"), timeout=360)


@pytest.fixture(scope="session")
def multi_run(tiny_models, tmp_path_factory) -> dict:
    """Two processes: parity at TP=2; the same training at TP=2, DP=2 (DistributedOptimizer) and PP=2;
    then the uninterrupted checkpoint runs (train K, save, train N) that test_checkpoint resumes; non-finite steps
    at DP=2 and PP=2."""
    root = tmp_path_factory.mktemp("multi")
    jobs = {
        "parity": ["parity", {"tp": 2, "models": tiny_models}],
        "train": ["train", dict(TRAIN_ARGS, hf=tiny_models["qwen3"],
                                layouts=[{"tp": 2}, {"tp": 1}, {"tp": 1, "pp": 2}])],
        "resume_save": ["resume", dict(RESUME_ARGS, mode="save", hf=tiny_models["qwen3"],
                                       layouts=resume_layouts(root))],
        # DP=2 with the optimizer state sharded, and PP=2 (the loss lives on the last stage only)
        "nonfinite": ["nonfinite", {"hf": tiny_models["qwen3"], "layouts": [{"tp": 1}, {"tp": 1, "pp": 2}]}],
        # sequence parallel and packing at TP=2; packing with PP=2 (a fixed token budget) and with DP=2
        "equal_tp2": ["equal", dict(EQUAL_ARGS, hf=tiny_models["qwen3"], layout={"tp": 2}, variants=TP2_VARIANTS)],
        "equal_pp2": ["equal", dict(EQUAL_ARGS, hf=tiny_models["qwen3"], layout={"tp": 1, "pp": 2},
                                    variants={"packed": PACKED_VARIANTS["packed"]})],
        "equal_dp2": ["equal", dict(EQUAL_ARGS, hf=tiny_models["qwen3"], layout={"tp": 1},
                                    variants={"packed": PACKED_VARIANTS["packed"], "balanced": {"balance_data": True}})],
        # LoRA (test_lora.py): training at TP 1 × DP 2, TP 2 and PP 2; resume; memory; what each sync mode sends
        "lora": ["lora", {"hf": tiny_models["qwen3"], "other_hf": tiny_models["llama"], "n": 8, "steps": 2,
                          "lr": 1e-2, "layouts": [{"tp": 1}, {"tp": 2}, {"tp": 1, "pp": 2}]}],
    }
    res = run_job("suite", jobs, nproc=2, out_dir=root, timeout=480)
    res["ckpt_root"] = str(root)
    return res
