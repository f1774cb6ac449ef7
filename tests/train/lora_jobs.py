"""The LoRA job of the shared multi-process runs (``worker.py``'s ``lora``; tests/train/test_lora.py reads it).

Per layout (TP 1 with DP 2, TP 2, PP 2 on two ranks): a LoRA actor (fp32) trains ``steps`` GRPO steps on a fixed
batch; its log-probs after, the base's (adapters off), what a weight sync would send in each mode, the memory of its
gradient buffers and optimizer state. At the first layout also: a full fine-tuning actor's memory, the exact resume
of a LoRA run (train k, save, train n; load in a new actor, train n), and the refusals of a checkpoint on another
base model or without train.lora.
"""

from __future__ import annotations

import os
from pathlib import Path

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                                    "output_layer"]}


def _cfg(layout: dict, lora: dict | None, **kw):
    from relax_hpc.train import TrainConfig
    from relax_hpc.train.config import LoraConfig

    return TrainConfig(tp=layout.get("tp", 1), pp=layout.get("pp", 1), seed=1, micro_batch_size=2, clip_grad=1.0,
                       lora=LoraConfig(**lora) if lora else None, **kw)


def _actor(hf: str, layout: dict, lora: dict | None, lr: float):
    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.train import MegatronActor

    return MegatronActor.from_hf(hf, _cfg(layout, lora, lr=lr), AlgorithmConfig(eps_clip=0.2))


def _batch(actor, n: int):
    from worker import make_batch

    batch = make_batch(n, seed=11)
    for s, o in zip(batch, actor.compute_log_probs(batch)):
        s.old_log_probs = o
    return batch


def _bytes(named) -> tuple[int, int]:
    n = b = 0
    for _, t in named:
        n += 1
        b += t.numel() * t.element_size()
    return n, b


def job_lora(args: dict, out: Path) -> dict:
    import torch

    from relax_hpc.train import init_parallel
    from relax_hpc.train import lora as L
    from relax_hpc.train.parallel import destroy_parallel
    from relax_hpc.weights.lora import sync_weights

    world = int(os.environ["WORLD_SIZE"])
    res: dict = {}
    for i, layout in enumerate(args["layouts"]):
        tp, pp = layout.get("tp", 1), layout.get("pp", 1)
        key = f"tp{tp}_pp{pp}_dp{world // (tp * pp)}"
        init_parallel(tp, pp, seed=1)
        actor = _actor(args["hf"], layout, LORA, args["lr"])
        batch = _batch(actor, args["n"])
        base = [t.tolist() for t in actor.compute_log_probs(batch)]
        r: dict = {"losses": []}
        for _ in range(args["steps"]):
            m = actor.train_step(batch)
            r["losses"].append([m["loss"], m["grad_norm"]])
        r["logprobs"] = [t.tolist() for t in actor.compute_log_probs(batch)]
        with L.adapters_off(actor.model):
            r["logprobs_off"] = [t.tolist() for t in actor.compute_log_probs(batch)]
        r["logprobs_base"] = base
        merged = dict(actor.named_hf_weights())  # merge mode's sync: the adapters merged into every weight
        r["merge_sync"] = _bytes(merged.items())
        actor.train_cfg.lora.mode = "adapter"  # what the adapter mode's sync would send of the same model
        for c in L._chunks(actor.model):
            c._relax_lora["mode"] = c._relax_lora["config"]["mode"] = "adapter"
        adapters = dict(sync_weights(actor))
        r["adapter_sync"] = _bytes(adapters.items())
        r["adapter_names"] = sorted(adapters)[:4]
        r["trainable"] = L.trainable_bytes(actor.model)
        r["grad_buffer_bytes"] = L.grad_buffer_bytes(actor.model)
        r["optimizer_state_bytes"] = L.optimizer_state_bytes(actor.optimizer)
        if i == 0:
            # the merged weights are W0 + (alpha / rank) B A, module by module: the engine's own merge of the
            # adapters sent (relax_hpc.engines.lora) must give the merged sync's tensors
            from relax_hpc.engines.lora import EngineAdapters

            from safetensors.torch import load_file

            w0 = load_file(str(Path(args["hf"]) / "model.safetensors"))
            params = {k: v.clone() for k, v in w0.items()}

            def param(name):
                return name, params[name]

            EngineAdapters().load(list(adapters.items()), params, param, lambda named: None)
            r["engine_merge_max_diff"] = max(float((params[k] - merged[k]).abs().max()) for k in merged)
            r["lm_head_moved"] = float((merged["lm_head.weight"] - w0["lm_head.weight"]).abs().max())
        del actor
        destroy_parallel()
        if i == 0:
            res["resume"] = _resume(args, layout, out)
            res["full"] = _full_memory(args, layout)
            res["refusals"] = _refusals(args, layout, out)
        res[key] = r
    return res


def _resume(args: dict, layout: dict, out: Path) -> dict:
    from relax_hpc.train import init_parallel
    from relax_hpc.train.parallel import destroy_parallel

    ckpt = str(out / "lora_ckpt")
    init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
    actor = _actor(args["hf"], layout, LORA, args["lr"])
    batch = _batch(actor, args["n"])
    for _ in range(2):
        actor.train_step(batch)
    step_dir = actor.save_checkpoint(ckpt, {"data_pos": 2})
    ref = [[m["loss"], m["grad_norm"]] for m in (actor.train_step(batch) for _ in range(2))]
    ref_lp = [t.tolist() for t in actor.compute_log_probs(batch)]
    del actor
    destroy_parallel()
    init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
    actor = _actor(args["hf"], layout, LORA, args["lr"])
    extra = actor.load_checkpoint(ckpt)
    got = [[m["loss"], m["grad_norm"]] for m in (actor.train_step(batch) for _ in range(2))]
    got_lp = [t.tolist() for t in actor.compute_log_probs(batch)]
    del actor
    destroy_parallel()
    files = {p.name: p.stat().st_size for p in Path(step_dir).iterdir() if p.is_file()}
    return {"ref": ref, "got": got, "ref_lp": ref_lp, "got_lp": got_lp, "extra": extra, "ckpt": ckpt,
            "ckpt_bytes": sum(v for k, v in files.items() if k.endswith(".distcp"))}


def _full_memory(args: dict, layout: dict) -> dict:
    from relax_hpc.train import init_parallel
    from relax_hpc.train import lora as L
    from relax_hpc.train.parallel import destroy_parallel

    init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
    actor = _actor(args["hf"], layout, None, args["lr"])
    actor.train_step(_batch(actor, args["n"]))  # Adam's state exists after a step
    r = {"trainable": L.trainable_bytes(actor.model), "grad_buffer_bytes": L.grad_buffer_bytes(actor.model),
         "optimizer_state_bytes": L.optimizer_state_bytes(actor.optimizer)}
    del actor
    destroy_parallel()
    return r


def _refusals(args: dict, layout: dict, out: Path) -> dict:
    from relax_hpc.train import init_parallel
    from relax_hpc.train.parallel import destroy_parallel

    r = {}
    for what, hf, lora in (("other_base", args["other_hf"], LORA), ("no_lora", args["hf"], None)):
        init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
        actor = _actor(hf, layout, lora, args["lr"])
        try:
            actor.load_checkpoint(str(out / "lora_ckpt"))
            r[what] = "loaded"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            r[what] = f"{type(e).__name__}: {e}"
        del actor
        destroy_parallel()
    r["moe_experts"] = _moe_refused(args, layout, out)
    return r


def _moe_refused(args: dict, layout: dict, out: Path) -> str:
    """A mixture-of-experts model with linear_fc1/linear_fc2 as targets (they reach its routed experts)."""
    import importlib.machinery
    import importlib.util

    import torch.distributed as dist

    from relax_hpc.train import init_parallel
    from relax_hpc.train.parallel import destroy_parallel

    hf = out / "tiny_moe"
    if dist.get_rank() == 0:
        loader = importlib.machinery.SourceFileLoader("make_tiny_model_lora", str(
            Path(__file__).resolve().parents[2] / "tools" / "make-tiny-model"))
        tool = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
        loader.exec_module(tool)
        tool.make_tiny_model(hf, arch="qwen3_moe", layers=1, seed=0)
    dist.barrier()
    init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
    try:
        _actor(str(hf), layout, {"rank": 4, "alpha": 8.0}, args["lr"])
        return "built"
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    finally:
        destroy_parallel()
