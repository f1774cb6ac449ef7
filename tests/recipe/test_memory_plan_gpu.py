"""The memory plan (relax_hpc/recipe/memory_plan.py) against what a card measures: skipped without CUDA.

A one-GPU colocate recipe (the actor and relax_hpc's reference engine share the card) on a ~100M Qwen3 shape (actor_gpu.py's, 8 layers) made by
tools/make-tiny-model, bf16, packed micro-batches of ``max_tokens_per_micro_batch`` tokens. The plan comes from the
recipe and the model's config.json alone, as relax-submit --dry-run makes it; the actor then runs in a child
process (tests/train/gpu_child.py: a one-rank NCCL group, megatron's parallel state is process-wide) and
``torch.cuda.max_memory_allocated`` (reset at each phase's start) gives the actor's bytes per phase:

* ``generate``: what the actor holds between steps (the engines generate then): params, grads and optimizer state
  after a train step; and with ``train.offload`` (:class:`~relax_hpc.train.offload.TrainOffload`), what is left;
* ``train``: the peak of a train step (the optimizer state made by a first step before it);
* ``sync``: the peak while the weights are exported (``named_hf_weights``, as the push reads them; no engine, so
  the sender's two buckets are not allocated here and the plan's bucket term is shown apart).

The allocator's bytes leave out the CUDA context (the plan's ``context`` term), so that term is compared with
nothing. Checked: the state terms (params, grads, optimizer: arithmetic on the parameter count) within 10 % (and
64 MiB for small buffers) of the measure, the offloaded actor near zero, the train peak above what is held. The
activation estimate is reported (measured / planned), not enforced: docs/gpu.md says how close it came, once a
card has run it. ``RELAX_MEMORY_PLAN_OUT``: the comparison is also written there (tools/gpu-check's ``memory``
stage reads it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from train.gpu_child import child_main, run_child

SHAPE = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=3072, max_pos=2304)  # ~100M parameters
TOKENS = 4096  # train.max_tokens_per_micro_batch: 4 samples of 1024 tokens a micro-batch
SAMPLES, LENGTH, PROMPT = 8, 1024, 256
MiB = float(1 << 20)
STATE_TOLERANCE = 0.10  # the state terms are arithmetic on the parameter count: within 10 % (+ SLACK)
SLACK = 64 * MiB  # small buffers outside the plan's terms (RoPE tables, RNG states, the loss's scalars)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def recipe_data(model_dir: str, offload: bool) -> dict:
    return {"model": {"path": model_dir},
            "train": {"bf16": True, "max_seq_len": 2048, "max_tokens_per_micro_batch": TOKENS,
                      "offload": offload},
            "rollout": {"engine": {"kind": "reference"}},
            "roles": {"actor": {"gpus_per_node": 1, "tasks_per_node": 1},
                      "rollout": {"share_with": "actor", "gpus_per_node": 1}}}


def actor_terms(model_dir: str, offload: bool) -> dict[str, dict[str, float]]:
    """{phase: {term: bytes}} of the actor's terms on its card, from the plan (the engine's and context left out:
    another process's, and outside the allocator)."""
    from relax_hpc.recipe import recipe_from_dict
    from relax_hpc.recipe.memory_plan import GiB, plan

    config = json.loads((Path(model_dir) / "config.json").read_text())
    mp, _ = plan(recipe_from_dict(recipe_data(model_dir, offload)), config)
    (card,) = mp.cards
    return {p.name: {t.what: (t.gib or 0.0) * GiB for t in p.terms if t.role == "actor" and t.what != "context"}
            for p in card.phases}


def job_measure(out: Path) -> dict:
    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.recipe import recipe_from_dict
    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.batch import TrainingSample
    from relax_hpc.train.offload import TrainOffload

    from train.conftest import load_tiny_model_tool

    model_dir = str(load_tiny_model_tool().make_tiny_model(out / "model", arch="qwen3", seed=0, **SHAPE))
    cfg = recipe_from_dict(recipe_data(model_dir, False)).train
    g = torch.Generator().manual_seed(3)
    batch = [TrainingSample.of(torch.randint(6, 128, (LENGTH,), generator=g), PROMPT, advantage=[1.0, -1.0][i % 2])
             for i in range(SAMPLES)]
    init_parallel(1, 1, seed=1)
    actor = MegatronActor.from_hf(model_dir, cfg, AlgorithmConfig())
    old = actor.compute_log_probs(batch)
    data = [dataclasses.replace(s, old_log_probs=o) for s, o in zip(batch, old)]
    actor.train_step(data)  # the first step makes the optimizer state
    torch.cuda.synchronize()
    measured = {"generate": torch.cuda.memory_allocated()}
    torch.cuda.reset_peak_memory_stats()
    actor.train_step(data)
    torch.cuda.synchronize()
    measured["train"] = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _, t in actor.named_hf_weights():
        del t
    torch.cuda.synchronize()
    measured["sync"] = torch.cuda.max_memory_allocated()
    off = TrainOffload(actor.model, actor.optimizer)
    held = off.device_bytes()
    off.offload()
    torch.cuda.synchronize()
    measured["generate_offloaded"] = torch.cuda.memory_allocated()
    off.reload()
    return {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "model_dir": model_dir,
            "params": sum(p.numel() for m in actor.model for p in m.parameters()), "measured": measured,
            "held_by_kind": held}


def compare(res: dict) -> dict:
    """The plan beside the measure, per phase, in MiB, and measured / planned."""
    plan = {False: actor_terms(res["model_dir"], False), True: actor_terms(res["model_dir"], True)}
    m = res["measured"]
    state = sum(plan[False]["generate"].values())
    rows = {
        "generate": (m["generate"], state),
        "generate (train.offload)": (m["generate_offloaded"], sum(plan[True]["generate"].values())),
        "train": (m["train"], sum(plan[False]["train"].values())),
        "sync (export, no buckets)": (m["sync"], sum(v for k, v in plan[False]["sync"].items() if k != "buckets")),
    }
    acts = plan[False]["train"]["activations"]
    return {"card": res["card"], "torch": res["torch"], "params": res["params"],
            "phases": {k: {"measured_mib": round(a / MiB, 1), "planned_mib": round(b / MiB, 1),
                           "ratio": round(a / b, 3) if b else None} for k, (a, b) in rows.items()},
            "activations": {"measured_mib": round((m["train"] - m["generate"]) / MiB, 1),
                            "planned_mib": round(acts / MiB, 1),
                            "ratio": round((m["train"] - m["generate"]) / acts, 3)},
            "state_planned_mib": {k: round(v / MiB, 1) for k, v in plan[False]["generate"].items()},
            "state_measured_mib": {k: round(v / MiB, 1) for k, v in res["held_by_kind"].items()}}


@pytest.mark.timeout(600)
def test_the_memory_plan_against_measured_peaks(tmp_path):
    res = run_child(__file__, {"measure": ["measure", {}]}, tmp_path, timeout=540)["measure"]
    assert "error" not in res, res.get("error")
    cmp = compare(res)
    if os.environ.get("RELAX_MEMORY_PLAN_OUT"):
        Path(os.environ["RELAX_MEMORY_PLAN_OUT"]).write_text(json.dumps(cmp, indent=1) + "\n")
    ph = cmp["phases"]
    held, planned = ph["generate"]["measured_mib"] * MiB, ph["generate"]["planned_mib"] * MiB
    assert abs(held - planned) <= STATE_TOLERANCE * planned + SLACK, cmp  # params + grads + optimizer
    for kind in ("params", "grads", "optimizer"):  # each kind as the offload finds its storages
        got, want = cmp["state_measured_mib"][kind] * MiB, cmp["state_planned_mib"][kind] * MiB
        assert abs(got - want) <= STATE_TOLERANCE * want + SLACK, (kind, cmp)
    assert ph["generate (train.offload)"]["measured_mib"] * MiB <= SLACK, cmp  # the plan says 0
    assert ph["train"]["measured_mib"] > ph["generate"]["measured_mib"], cmp  # activations on top of the state


if __name__ == "__main__":
    child_main({"measure": lambda args, out: job_measure(out)})
