"""A tiny Qwen3-MoE (4 experts, top-2, every layer sparse) through megatron-bridge on CPU: transformers' log-probs at
EP=1 (one process) and EP=2 (two processes over gloo, each rank holding 2 of the 4 experts, the tokens exchanged
by the all-to-all dispatcher); the export (what weight sync sends) gives back every HF tensor, experts included,
gathered over EP; a training step at EP=2 equals one at EP=1 on the same ranks; a checkpoint saved at EP=2 after a
training step loads at EP=1 (world 1) with the same weights and log-probs, and the next training step there matches
EP=2's.

Two launches share every assertion: the EP=2 run (parity, export, a GRPO step, save, one more step, then the first
step again at EP=1, DP=2) and the one-process EP=1 run that loads its checkpoint. Micro-batches are packed by
tokens, so the two EP ranks route different token counts. This file is also the worker of both
(``python tests/train/test_moe.py JOB OUT ARGS``, see ``launch.py``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

TOL = 1e-5
# packed micro-batches (a token budget): the DP ranks' shares have different lengths
CFG = {"micro_batch_size": 1, "max_seq_len": 32, "max_tokens_per_micro_batch": 48, "lr": 1e-3, "clip_grad": 1.0}


def _hf_log_probs(hf_dir: str, batch: list) -> list:
    """transformers' Qwen3MoeForCausalLM, each sample alone: log-probs of its response tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    out = []
    for s in batch:
        t = s.tokens
        with torch.no_grad():
            lp = torch.log_softmax(hf(t[None]).logits[0].float(), -1)
        out.append(lp[s.response_start - 1: -1].gather(-1, t[s.response_start:, None])[:, 0])
    return out


def _gap(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _export_check(actor, hf_dir: str) -> tuple[dict, dict]:
    """The bridge's export against the HF file: names both ways, and the largest difference."""
    from safetensors.torch import load_file

    ref, got = load_file(f"{hf_dir}/model.safetensors"), {n: t.clone() for n, t in actor.named_hf_weights()}
    common = set(ref) & set(got)
    return got, {"missing": sorted(set(ref) ^ set(got)), "n": len(got),
                 "n_experts": sum(".mlp.experts." in n for n in got),
                 "max_diff": max(float((got[k] - ref[k]).abs().max()) for k in common)}


def _step(actor, batch: list, old: list) -> dict:
    m = actor.train_step([dataclasses.replace(s, old_log_probs=o) for s, o in zip(batch, old)])
    return {k: m[k] for k in ("loss", "pg_loss", "grad_norm", "ppo_kl")}


def _refusals(models: dict) -> dict:
    """At EP=2, the build refuses a dense model and a MoE whose experts EP does not divide (before building it)."""
    from relax_hpc.errors import is_permanent
    from relax_hpc.train import TrainConfig
    from relax_hpc.train.model import build_model

    out = {}
    for name, hf_dir in models.items():
        try:
            build_model(hf_dir, TrainConfig(tp=1, pp=1, ep=2))
            out[name] = "built"
        except Exception as e:
            out[name] = f"{'permanent' if is_permanent(e) else type(e).__name__}: {e}"
    return out


def job_moe(args: dict, out: Path) -> dict:
    """``ep`` 2 (world 2): parity, export, the build's refusals, a step, save, log-probs and weights after it, a second
    step; then the first step again at EP=1 (DP=2). ``ep`` 1 (world 1): parity, export, load that checkpoint:
    log-probs, weights, then the second step."""
    import os

    import torch

    from relax_hpc.train import MegatronActor, TrainConfig, cpu_compat, init_parallel
    from relax_hpc.train.parallel import destroy_parallel, info

    from worker import _algo, make_batch

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    ep, hf_dir, ckpt = args["ep"], args["hf"], args["ckpt"]
    init_parallel(1, 1, seed=1, ep=ep)
    cfg = TrainConfig(tp=1, pp=1, ep=ep, seed=1, **CFG)
    actor = MegatronActor.from_hf(hf_dir, cfg, _algo(eps_clip=0.2))
    p = info()
    experts = [n for n, _ in actor.model[0].module.named_parameters() if ".local_experts." in n]
    batch = make_batch(6, seed=7)
    want = _hf_log_probs(hf_dir, batch)
    lp0 = actor.compute_log_probs(batch)
    res = {"layout": {"world": p.world, "dp": p.dp, "ep": p.ep, "ep_rank": p.ep_rank},
           "local_experts": len({n.split(".local_experts.")[1].split(".")[0] for n in experts}),
           "parity": _gap(lp0, want), "n_tokens": sum(len(x) for x in lp0)}
    _, res["export"] = _export_check(actor, hf_dir)
    if ep == 2:
        res["refused"] = _refusals(args["refuse"])
        res["step1"] = _step(actor, batch, lp0)
        actor.save_checkpoint(ckpt, {"note": "moe"})
        lp1 = actor.compute_log_probs(batch)
        weights, _ = _export_check(actor, hf_dir)
        if int(os.environ["RANK"]) == 0:
            torch.save({"lp1": lp1, "weights": weights}, Path(ckpt) / "after_step1.pt")
        res["moved"] = _gap(lp1, lp0)
        res["step2"] = _step(actor, batch, lp0)
        # the same first step at EP=1 over the same two ranks (DP=2): the experts' grads reduced over DP instead
        del actor
        destroy_parallel()
        init_parallel(1, 1, seed=1, ep=1)
        dp2 = MegatronActor.from_hf(hf_dir, TrainConfig(tp=1, pp=1, ep=1, seed=1, **CFG), _algo(eps_clip=0.2))
        res["dp2_ep1_step1"] = _step(dp2, batch, lp0)
    else:
        ref = torch.load(Path(ckpt) / "after_step1.pt")
        res["extra"] = actor.load_checkpoint(ckpt)
        weights, _ = _export_check(actor, hf_dir)
        res["loaded_logprob_diff"] = _gap(actor.compute_log_probs(batch), ref["lp1"])
        res["loaded_weight_diff"] = max(float((weights[n] - t).abs().max()) for n, t in ref["weights"].items())
        res["loaded_names_same"] = sorted(weights) == sorted(ref["weights"])
        res["step2"] = _step(actor, batch, lp0)
    return res


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> dict:
    from train import launch
    from train.conftest import load_tiny_model_tool

    root = tmp_path_factory.mktemp("moe")
    tool = load_tiny_model_tool()
    hf = str(tool.make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", seed=0))
    refuse = {"dense": str(tool.make_tiny_model(root / "dense", arch="qwen3", layers=1)),
              "3_experts": str(tool.make_tiny_model(root / "e3", arch="qwen3_moe", layers=1, moe={"experts": 3}))}
    args = {"hf": hf, "ckpt": str(root / "ckpt"), "refuse": refuse}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the ranks (see __main__)
        ep2 = launch.run_job("moe", dict(args, ep=2), nproc=2, out_dir=root / "ep2", timeout=240)
        ep1 = launch.run_job("moe", dict(args, ep=1), nproc=1, out_dir=root / "ep1", timeout=240)
    return {"ep2": ep2, "ep1": ep1}


@pytest.mark.timeout(400)
def test_moe_logprobs_match_transformers_ep1_ep2(moe_runs):
    for name, layout in (("ep1", {"world": 1, "dp": 1, "ep": 1}), ("ep2", {"world": 2, "dp": 2, "ep": 2})):
        r = moe_runs[name]
        print(f"[moe parity {name}] log-probs max |Δ| vs transformers {r['parity']:.2e} over {r['n_tokens']} "
              f"response tokens")
        assert {k: r["layout"][k] for k in layout} == layout
        assert r["local_experts"] == 4 // layout["ep"]  # EP=2: each rank builds half of each layer's experts
        assert r["parity"] <= TOL and r["n_tokens"] > 30


def test_moe_export_gives_every_hf_tensor_back(moe_runs):
    """megatron-bridge's export (weight sync, HF checkpoints): every tensor of the HF file, each expert's gate, up
    and down projections included, unchanged, at EP=1 and gathered over the two EP ranks at EP=2."""
    for name in ("ep1", "ep2"):
        e = moe_runs[name]["export"]
        assert not e["missing"] and e["n_experts"] == 2 * 4 * 3 and e["max_diff"] == 0.0, (name, e)


def test_moe_training_step_same_at_ep1_and_ep2(moe_runs):
    """One GRPO step from the HF weights on the same two ranks: experts split over EP=2 (the all-to-all's backward)
    or every expert on both ranks (EP=1, DP=2: their grads all-reduced): the same loss and grad norm."""
    a, b = moe_runs["ep2"]["step1"], moe_runs["ep2"]["dp2_ep1_step1"]
    print(f"[moe step ep2] {a}\n[moe step ep1 dp2] {b}")
    assert a["grad_norm"] > 0
    for k, v in a.items():
        assert abs(b[k] - v) <= TOL * max(1.0, abs(v)), (k, a, b)


def test_moe_checkpoint_saved_at_ep2_loads_at_ep1(moe_runs):
    """A GRPO step at EP=2 (that moved the log-probs), save; at EP=1 in one process the loaded weights are the EP=2
    ones exactly, the log-probs equal, and the next step (restored Adam state) matches EP=2's."""
    ep2, ep1 = moe_runs["ep2"], moe_runs["ep1"]
    assert ep2["moved"] > 1e-3 and ep2["step1"]["grad_norm"] > 0
    assert ep1["extra"] == {"note": "moe"} and ep1["loaded_names_same"]
    print(f"[moe checkpoint ep2->ep1] weights max |Δ| {ep1['loaded_weight_diff']:.1e}, log-probs max |Δ| "
          f"{ep1['loaded_logprob_diff']:.1e}; next step {ep1['step2']} vs {ep2['step2']}")
    assert ep1["loaded_weight_diff"] == 0.0
    assert ep1["loaded_logprob_diff"] <= TOL
    for k, v in ep2["step2"].items():
        assert abs(ep1["step2"][k] - v) <= TOL * max(1.0, abs(v)), (k, ep1["step2"], ep2["step2"])


def test_moe_build_refuses_what_ep_cannot_split(moe_runs):
    r = moe_runs["ep2"]["refused"]
    assert r["dense"].startswith("permanent: train.ep = 2 but the model is dense") and "Fix: train.ep: 1" in r["dense"]
    assert r["3_experts"].startswith("permanent: train.ep = 2 does not divide the model's 3 experts"), r


def test_train_ep_validation():
    """No Megatron: the recipe's train.ep is refused with its key, value and fix where Megatron could not lay it out."""
    from relax_hpc.recipe import RecipeError, recipe_from_dict

    def problems(train: dict, ranks: int = 4) -> dict:
        try:
            recipe_from_dict({"train": train, "roles": {"actor": {"nodes": 1, "tasks_per_node": ranks}}})
        except RecipeError as e:
            return {k: (v, m) for k, v, m in e.problems}
        return {}

    assert problems({"ep": 4}) == {} and problems({"ep": 2, "tp": 2, "sequence_parallel": True}) == {}
    assert "at least 1" in problems({"ep": 0})["train.ep"][1]
    v, msg = problems({"ep": 3})["train.ep"]
    assert v == 3 and "does not divide the actor's data-parallel size 4" in msg and "Fix: a divisor of 4" in msg
    v, msg = problems({"ep": 4, "tp": 2, "sequence_parallel": True})["train.ep"]
    assert v == 4 and "data-parallel size 2" in msg
    v, msg = problems({"ep": 2, "tp": 2})["train.sequence_parallel"]
    assert v is False and "Fix: sequence_parallel: true" in msg


if __name__ == "__main__":  # one rank of the runs above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(moe=job_moe)
