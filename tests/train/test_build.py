"""build_megatron, as the roles call it: the forward roles (reference, actor_fwd) build with the recipe's ``forward:``
layout and token budget, the actor with ``train``'s; and ``train.bf16`` gives bf16 weights with fp32 master copies in
the optimizer (the real recipes train so).

Megatron runs in one child process (this file run as a script, one rank, gloo on CPU), as tests/roles/test_forward.py
does: its parallel state must stay out of pytest's process. One child serves every test here (importing megatron
and the bridge costs seconds).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# 4 samples of 5, 6, 7 and 9 tokens: packed by 16 tokens they make 2 micro-batches ([9, 7], [6, 5]); by 64, one
SAMPLES = [([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14, 15]), ([20, 21, 22, 23], [100, 101, 127]),
           ([30, 31, 32], [40, 41, 42, 43, 44, 45])]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("build")
    path = REPO / "tools" / "make-tiny-model"
    loader = importlib.machinery.SourceFileLoader("make_tiny_model", str(path))
    tool = importlib.util.module_from_spec(importlib.util.spec_from_loader("make_tiny_model", loader))
    loader.exec_module(tool)
    model = tool.make_tiny_model(tmp / "qwen3", arch="qwen3", seed=0)
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    p = subprocess.run([sys.executable, __file__, str(model), str(tmp)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    return json.loads((tmp / "result.json").read_text())


def test_forward_roles_build_with_the_forward_layout_and_budget(built):
    """train.tp 2 with sequence parallelism and a 64-token budget; forward: tp 1, 16 tokens. The reference's one rank
    builds at TP 1 without sequence parallelism (at train.tp 2 one rank cannot build: Megatron refuses), and its
    log-prob pass packs by 16 tokens: 2 micro-batches for the 4 samples, where the actor's budget makes 1."""
    ref = built["reference"]
    assert ref["error"] is None, ref["error"]
    assert (ref["tp_world"], ref["config_tp"], ref["sequence_parallel"]) == (1, 1, False)
    assert ref["logprob_budget"] == 16 and ref["micro_batches"] == 2
    assert ref["lengths"] == [len(r) for _, r in SAMPLES]
    assert built["reference_without_forward"]["error"].startswith("ValueError: train.tp × train.pp = 2×1 does not "
                                                                   "divide the world size 1")


def test_the_actor_ignores_the_forward_section(built):
    """The same recipe's actor (forward: set) builds with train's own budget: the 4 samples in one micro-batch."""
    assert built["actor"]["micro_batches"] == 1 and built["actor"]["logprob_budget"] == 64


def test_bf16_trains_bf16_weights_from_fp32_master_copies(built):
    """train.bf16: the model's weights are bf16; the optimizer holds an fp32 master copy of each, which the step
    updates (by less than a bf16 rounding step for some) and the bf16 weights are that copy rounded."""
    b = built["bf16"]
    assert b["param_dtypes"] == ["torch.bfloat16"] and b["master_dtypes"] == ["torch.float32"]
    assert b["masters"] == b["params"] > 0  # one master copy per trained weight
    assert b["master_moved"] > 0 and b["param_is_rounded_master"]
    assert built["fp32"]["param_dtypes"] == ["torch.float32"]  # the default: fp32, no master copies needed


def test_on_a_cpu_megatron_s_fused_ops_run_as_written_and_inductor_is_never_imported(built):
    """build_megatron makes ``torch.compile`` hand back what it wraps before megatron is imported
    (cpu_compat.compile_eagerly): megatron's fused ops (``jit_fuser``) are the functions as written, which is what
    they ran as with dynamo off anyway, and inductor, 0.8 CPU-s of every Megatron process's start, is not imported.
    Negative control: wrapping one function in ``torch.compile`` imports it."""
    assert built["compile"] == {"megatron_fused_ops_as_written": True, "inductor_imported": False,
                                "dynamo_disabled": True}
    p = subprocess.run([sys.executable, "-c", "import sys, torch; torch.compile(lambda x: x); "
                        "print('torch._inductor.compile_fx' in sys.modules)"], capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.split() == ["True"], p.stderr[-2000:]


def _child(model: str, out: Path) -> dict:
    import dataclasses

    import torch
    import torch.distributed as dist

    from relax_hpc.recipe.schema import Recipe
    from relax_hpc.train import cpu_compat
    from relax_hpc.train.batch import TrainingSample
    from relax_hpc.train.build import build_megatron
    from relax_hpc.train.config import TrainConfig
    from relax_hpc.train.forward_config import ForwardConfig
    from relax_hpc.train.logprobs import set_progress_hook

    dist.init_process_group(cpu_compat.backend(), store=dist.HashStore(), rank=0, world_size=1)
    batch = [TrainingSample.of(p + r, len(p)) for p, r in SAMPLES]
    count = [0]
    set_progress_hook(lambda: count.__setitem__(0, count[0] + 1))

    def recipe(**train) -> Recipe:
        r = Recipe()
        r.model.path = model
        r.roles.reference.enabled = True
        r.roles.reference.cpus_per_task = r.roles.actor.cpus_per_task = 2
        r.train = TrainConfig(max_seq_len=16, max_tokens_per_micro_batch=64, **train)
        return r

    def layout(role: str, r: Recipe) -> dict:
        count[0] = 0
        try:
            actor = build_megatron(r, role, model, forward_only=True)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            count[0] = 0
        from megatron.core import parallel_state as ps  # after build_megatron, which must come before megatron
        lps = actor.compute_log_probs(batch)
        res = {"error": None, "tp_world": ps.get_tensor_model_parallel_world_size(),
               "config_tp": actor.model[0].config.tensor_model_parallel_size,
               "sequence_parallel": actor.model[0].config.sequence_parallel,
               "logprob_budget": actor.train_cfg.logprob_max_tokens_per_micro_batch or
               actor.train_cfg.max_tokens_per_micro_batch, "micro_batches": count[0],
               "lengths": [len(x) for x in lps]}
        ps.destroy_model_parallel()
        return res

    r = recipe(tp=2, sequence_parallel=True)
    result = {"reference_without_forward": layout("reference", r)}
    from megatron.core import parallel_state as ps
    from megatron.core.jit import jit_fuser

    result["compile"] = {"megatron_fused_ops_as_written": jit_fuser(layout) is layout,
                         "inductor_imported": "torch._inductor.compile_fx" in sys.modules,
                         "dynamo_disabled": torch._dynamo.config.disable}
    ps.destroy_model_parallel()
    r.forward = ForwardConfig(tp=1, max_tokens_per_micro_batch=16)
    result["reference"] = layout("reference", r)
    r.train = dataclasses.replace(r.train, tp=1, sequence_parallel=False)  # one rank: the actor's own layout too
    result["actor"] = layout("actor", r)

    for name, bf16 in (("bf16", True), ("fp32", False)):
        r = recipe(bf16=bf16, lr=1e-2)
        actor = build_megatron(r, "actor", model, forward_only=False)
        params = [p for m in actor.model for p in m.parameters() if p.requires_grad]
        res = {"param_dtypes": sorted({str(p.dtype) for p in params}), "params": len(params)}
        if bf16:
            opt = actor.optimizer
            inner = getattr(opt, "chained_optimizers", [opt])[0]
            groups = getattr(inner, "shard_fp32_from_float16_groups", None) or inner.fp32_from_float16_groups
            masters = [m for g in groups for m in g]
            before = [m.detach().clone() for m in masters]
            train = [TrainingSample.of(b.tokens, b.response_start, advantage=1.0 if i % 2 else -1.0)
                     for i, b in enumerate(batch)]
            actor.train_step(train)
            moved = max((m - b).abs().max().item() for m, b in zip(masters, before))
            model_params = [p for g in getattr(inner, "model_float16_groups", None) or inner.float16_groups
                            for p in g]
            res.update(master_dtypes=sorted({str(m.dtype) for m in masters}), masters=len(masters),
                       master_moved=moved,
                       param_is_rounded_master=all(torch.equal(p.detach().view(-1)[: m.numel()].float(),
                                                               m.detach().view(-1).to(torch.bfloat16).float())
                                                   for p, m in zip(model_params, masters)))
        result[name] = res
        ps.destroy_model_parallel()
    return result


if __name__ == "__main__":  # the child
    res = _child(sys.argv[1], Path(sys.argv[2]))
    (Path(sys.argv[2]) / "result.json").write_text(json.dumps(res))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (seconds with megatron loaded)
