"""Fixtures for the weight-sync tests: a tiny HF model made offline, CPU engine processes (stopped by PID),
and this test process as the actor's rank 0 holding an HF copy of the weights."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ["--threads", "1", "--seed", "0"]


def make_tiny_model(out: Path, **kw) -> Path:
    """tools/make-tiny-model has no .py suffix: load it as a module."""
    loader = importlib.machinery.SourceFileLoader("relax_make_tiny_model_w", str(REPO / "tools" / "make-tiny-model"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.make_tiny_model(out, **kw)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Llama, hidden 64, 2 layers, vocab 128; max_pos 2048 so a generation can outlast a weight sync."""
    return make_tiny_model(tmp_path_factory.mktemp("weights-model") / "tiny-llama", arch="llama", hidden=64,
                           layers=2, heads=4, kv_heads=2, seed=0, max_pos=2048)


@pytest.fixture(scope="module")
def engines(request, tiny_model, tmp_path_factory):
    """``N_ENGINES`` (module attribute, default 2) CPU engines started together, so their imports overlap."""
    from relax_hpc.engines.launcher import start_engine

    logs = tmp_path_factory.mktemp("weights-engine-logs")
    handles = [start_engine("cpu", tiny_model, log_path=logs / f"engine{i}.log", extra_args=ENGINE_ARGS)
               for i in range(getattr(request.module, "N_ENGINES", 2))]
    try:
        for h in handles:
            h.wait_ready(180)
        yield handles
    finally:
        for h in handles:
            h.stop()


@pytest.fixture()
def world():
    """A world-1 gloo default group, as the actor's rank 0 of a one-rank actor has."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture()
def hf_model(tiny_model):
    """The actor's copy of the weights (fresh per test)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def perturb(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Change every weight of ``model`` in place (deterministically); returns a copy of its new state_dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(scale * torch.randn(p.shape, generator=g))
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def teacher_forced_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax(logits) of each output token from one forward over prompt + output (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]
