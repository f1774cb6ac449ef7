#!/usr/bin/env python3
"""The actor on one GPU against the simplest transformers + torch GRPO loop, same batch, same card, one process.

    tools/bench/actor_gpu.py [--out JSON] [--docs MD | --no-write] [--reps 5] [--warmup 2] [--max-tokens 8192]
    tools/bench/run --only actor-gpu              (the same, through the benchmark runner)
    tools/bench/actor_gpu.py --cpu-smoke --out J  (the same code path at a tiny shape, fp32, CPU, gloo: a test)
    tools/bench/actor_gpu.py --from-json J        (rewrite the "GPU" section of docs/benchmarks.md from a saved run)

Default work (issue #26): a Qwen3-shaped model made by ``tools/make-tiny-model`` (hidden 1024, 16 layers, 16 heads,
8 KV heads, MLP 3072, vocab 128: about 200M parameters), bf16, one GPU; a GRPO batch of 64 samples, 8 per prompt,
each 256 prompt + 128–1792 response tokens (seeded), advantages group-normalised 0/1 rewards.

Measured, phase after phase, each with the other's memory freed, in this order:

1. transformers + torch: ``AutoModelForCausalLM`` (bf16, ``attn_implementation="sdpa"``), ``torch.optim.AdamW``
   (fused, the actor's lr/betas/eps), micro-batches of ``--micro-batch`` consecutive samples, right-padded with an
   attention mask, the same PPO-clip loss (:func:`relax_hpc.algo.policy_loss`, weight n_mb / N per micro-batch,
   as the actor weighs them), grads clipped at the actor's ``clip_grad``. Its first forward-only pass gives the
   old log-probs both sides train against.
2. relax_hpc: ``MegatronActor.from_hf`` (``TrainConfig(bf16, micro_batch_size, max_tokens_per_micro_batch)``) on a
   one-rank process group (NCCL on a GPU), ``compute_log_probs`` once (compared with transformers' first pass: the
   same weights), then ``train_step`` and ``compute_log_probs`` timed.

Definitions (each printed beside its number): *real tokens*: the samples' own tokens, prompt + response, no
padding. *time*: median over ``--reps`` timed reps after ``--warmup`` untimed ones, synchronised on the device.
*tokens/s*: real tokens / time. *peak memory*: ``torch.cuda.max_memory_allocated`` over the timed phase, reset at
its start (tensors only: no allocator cache, cuBLAS workspace or NCCL buffers). *MFU*: 6·N·real tokens / time /
peak bf16 dense FLOP/s of the card (2·N for forward only); N = all parameters; attention-score FLOPs not counted.
"""

from __future__ import annotations

import dataclasses
import argparse
import datetime as dt
import gc
import importlib.machinery
import importlib.util
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_OUT = HERE / "results" / "actor_gpu.json"
DEFAULT_DOCS = REPO / "docs" / "benchmarks.md"

# issue #26's shape and batch; the smoke shape runs the same code in seconds on a CPU
SHAPES = {
    "gpu": dict(model=dict(hidden=1024, layers=16, heads=16, kv_heads=8, intermediate=3072, max_pos=2304),
                batch=dict(n=64, group=8, prompt=256, response=(128, 1792)), max_seq_len=2048, bf16=True),
    "cpu-smoke": dict(model=dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_pos=128),
                      batch=dict(n=8, group=4, prompt=6, response=(4, 40)), max_seq_len=64, bf16=False),
}
# bf16 dense tensor-core peak per card (SXM figures; PCIe and NVL parts are slower), matched in this order
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200", 989e12), ("H100", 989e12), ("A100", 312e12)]
# actor's first pass vs transformers', same weights: bf16 on a GPU (two implementations, 16 layers), fp32 on CPU
LOGPROB_BOUND = {"bf16": {"mean": 0.02, "max": 0.25}, "fp32": {"mean": 1e-5, "max": 1e-4}}
TARGET_RATIO = 1.5  # issue #26: relax_hpc / transformers real tokens/s of the train step


def peak_flops(card: str) -> float | None:
    for key, flops in PEAK_BF16:
        if key.lower() in card.lower():
            return flops
    return None


def load_tool(name: str):
    """A script of tools/ without a .py suffix, as a module."""
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(REPO / "tools" / name))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(mod)
    return mod


def make_batch(n: int, group: int, prompt: int, response: tuple[int, int], vocab: int, seed: int) -> list[dict]:
    """GRPO samples: ``group`` responses per prompt; advantages are each group's 0/1 rewards, normalised."""
    import torch

    from relax_hpc.train.batch import TrainingSample

    g = torch.Generator().manual_seed(seed)
    out, adv, p = [], None, None
    for i in range(n):
        if i % group == 0:
            p = torch.randint(6, vocab, (prompt,), generator=g)  # 0-5 are the tool's special tokens
            r = torch.randint(0, 2, (group,), generator=g).float()
            adv = (r - r.mean()) / (r.std() + 1e-6)
        k = int(torch.randint(response[0], response[1] + 1, (1,), generator=g))
        out.append(TrainingSample.of(torch.cat([p, torch.randint(6, vocab, (k,), generator=g)]), prompt,
                                     advantage=float(adv[i % group])))
    return out


class Clock:
    """Wall time of device work: synchronise before reading (a no-op on CPU); peak tensor memory per phase."""

    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn) -> tuple[float, object]:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t0, out

    def reset_peak(self) -> None:
        if self.cuda:
            self.sync()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gb(self) -> float | None:
        return self.torch.cuda.max_memory_allocated() / 1e9 if self.cuda else None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def timed(clock: Clock, fn, warmup: int, reps: int) -> tuple[float, list[float], object]:
    """Median of ``reps`` timed calls after ``warmup`` untimed ones; the last result; peak memory read by the caller."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(reps):
        t, out = clock.time(fn)
        times.append(t)
    return statistics.median(times), times, out


# ---------------------------------------------------------------------------------------------------------------
# transformers + torch: the loop a user would write
# ---------------------------------------------------------------------------------------------------------------


def hf_logprobs(model, group: list[dict], pad_id: int, dev):
    """Right-padded forward of one micro-batch: response log-probs ``[b, R]`` (float32) and their mask."""
    import torch

    b, L = len(group), max(s.tokens.numel() for s in group)
    R = max(s.tokens.numel() - s.response_start for s in group)
    ids = torch.full((b, L), pad_id, dtype=torch.long)
    att = torch.zeros((b, L), dtype=torch.long)
    idx = torch.zeros((b, R), dtype=torch.long)  # the position whose logits predict each response token
    tgt = torch.zeros((b, R), dtype=torch.long)
    mask = torch.zeros((b, R), dtype=torch.bool)
    for i, s in enumerate(group):
        t, st = s.tokens, s.response_start
        n, r = t.numel(), t.numel() - st
        ids[i, :n], att[i, :n] = t, 1
        idx[i, :r] = torch.arange(st - 1, n - 1)
        tgt[i, :r], mask[i, :r] = t[st:], True
    ids, att, idx, tgt, mask = (x.to(dev) for x in (ids, att, idx, tgt, mask))
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    picked = logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
    lp = picked.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, lp, torch.zeros((), device=dev)), mask


def padded(rows: list, R: int, dev):
    import torch

    out = torch.zeros((len(rows), R), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out.to(dev)


def hf_phase(model_dir: str, batch: list[dict], a, clock: Clock, dev, dtype, algo, cfg) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from relax_hpc.algo import policy_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(dev)
    model.config.use_cache = False
    pad_id = model.config.pad_token_id or 0
    n_params = sum(p.numel() for p in model.parameters())
    groups = [batch[i: i + a.micro_batch] for i in range(0, len(batch), a.micro_batch)]
    N = len(batch)

    def forward_only() -> list:
        model.eval()
        out = []
        with torch.no_grad():
            for g in groups:
                lp, _ = hf_logprobs(model, g, pad_id, dev)
                out += [row[: s.tokens.numel() - s.response_start].cpu()
                        for row, s in zip(lp, g)]
        model.train()
        return out

    first = forward_only()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=True)
        fused = True
    except (RuntimeError, ValueError):  # a dtype/device the fused kernel does not take
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        fused = False
    old = first
    losses, norms = [], []

    def step() -> float:
        model.train()
        total = torch.zeros((), device=dev)  # summed on the device: no host sync per micro-batch
        for k, g in enumerate(groups):
            lp, mask = hf_logprobs(model, g, pad_id, dev)
            o = padded(old[k * a.micro_batch: k * a.micro_batch + len(g)], lp.shape[1], dev)
            adv = torch.tensor([float(s.advantages[0]) for s in g], device=dev).unsqueeze(-1).expand_as(lp)
            loss, _ = policy_loss(algo, lp, o, adv, mask.float())
            (loss * (len(g) / N)).backward()
            total += loss.detach() * (len(g) / N)
        # the norm before clipping, as the actor reports it
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad or math.inf)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        return losses[-1]

    clock.reset_peak()
    train_s, train_all, _ = timed(clock, step, a.warmup, a.reps)
    train_peak = clock.peak_gb()
    clock.reset_peak()
    lp_s, lp_all, _ = timed(clock, forward_only, 0, a.reps)
    lp_peak = clock.peak_gb()
    slots = sum(len(g) * max(s.tokens.numel() for s in g) for g in groups)
    model = opt = None  # the closures hold them: drop them before freeing the cache
    clock.free()
    return {"first": first, "n_params": n_params, "fused_adamw": fused, "first_loss": losses[0],
            "first_grad_norm": norms[0],
            "train_s": train_s, "train_times": train_all, "train_peak_gb": train_peak,
            "logprob_s": lp_s, "logprob_times": lp_all, "logprob_peak_gb": lp_peak,
            "padding_share": 1 - sum(s.tokens.numel() for s in batch) / slots, "micro_batches": len(groups)}


# ---------------------------------------------------------------------------------------------------------------
# relax_hpc's actor
# ---------------------------------------------------------------------------------------------------------------


def relax_phase(model_dir: str, batch: list[dict], old: list, a, clock: Clock, algo, cfg) -> dict:
    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.parallel import destroy_parallel

    init_parallel(1, 1, seed=cfg.seed)
    actor = MegatronActor.from_hf(model_dir, cfg, algo)
    first_s, first = clock.time(lambda: actor.compute_log_probs(batch))  # the untrained weights: compared
    data = [dataclasses.replace(s, old_log_probs=o) for s, o in zip(batch, old)]
    metrics = []

    def step() -> float:
        m = actor.train_step(data)
        metrics.append(m)
        return m["loss"]

    clock.reset_peak()
    train_s, train_all, _ = timed(clock, step, a.warmup, a.reps)
    train_peak = clock.peak_gb()
    clock.reset_peak()
    lp_s, lp_all, _ = timed(clock, lambda: actor.compute_log_probs(batch), 0, a.reps)
    lp_peak = clock.peak_gb()
    actor = None
    destroy_parallel()
    clock.free()
    return {"first": first, "first_pass_s": first_s, "first_loss": metrics[0]["loss"],
            "first_grad_norm": metrics[0]["grad_norm"],
            "nonfinite_steps": sum(int(m.get("nonfinite_skipped", 0)) for m in metrics),
            "train_s": train_s, "train_times": train_all, "train_peak_gb": train_peak,
            "logprob_s": lp_s, "logprob_times": lp_all, "logprob_peak_gb": lp_peak}


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------


def parse_set(text: str) -> tuple[str, object]:
    """``--set KEY=VALUE``: a TrainConfig field; the value as JSON (numbers, true/false, null), else a string."""
    from dataclasses import fields

    from relax_hpc.train import TrainConfig

    key, sep, value = text.partition("=")
    names = {f.name for f in fields(TrainConfig)}
    if not sep or key not in names:
        raise SystemExit(f"--set {text!r}: expected KEY=VALUE with KEY a train.* field ({', '.join(sorted(names))})")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def init_dist(cuda: bool) -> None:
    """A one-rank default process group (NCCL on a GPU, gloo on CPU), as a role's bootstrap makes it."""
    import torch
    import torch.distributed as dist

    from relax_hpc.train import cpu_compat

    if cuda:
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group(cpu_compat.backend(), store=store, rank=0, world_size=1)


def run(a) -> dict:
    import torch

    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.train import TrainConfig
    from relax_hpc.train.config import check

    smoke = a.cpu_smoke
    shape = SHAPES["cpu-smoke" if smoke else "gpu"]
    cuda = not smoke
    if not cuda:
        torch._dynamo.config.disable = True  # as the roles do on a CPU: compiling costs, gains nothing here
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if shape["bf16"] else torch.float32
    card = torch.cuda.get_device_name(0) if cuda else "CPU (smoke: not a GPU figure)"
    flops = a.peak_tflops * 1e12 if a.peak_tflops else (peak_flops(card) if cuda else None)
    max_tokens = a.max_tokens if a.max_tokens is not None else (8192 if cuda else 128)
    over = dict(parse_set(x) for x in a.set)
    cfg = TrainConfig(**{**dict(bf16=shape["bf16"], micro_batch_size=1 if max_tokens else a.micro_batch, lr=1e-6, seed=1,
                                max_tokens_per_micro_batch=max_tokens or None, max_seq_len=shape["max_seq_len"]),
                         **over})
    bad = check(cfg)
    if bad:
        raise SystemExit("; ".join(f"train.{k} = {v!r} {msg}" for k, v, msg in bad))
    clock = Clock(cuda)
    init_dist(cuda)

    m = shape["model"]
    tmp = Path(tempfile.mkdtemp(prefix="relax-actor-gpu-"))
    t0 = time.perf_counter()
    model_dir = str(load_tool("make-tiny-model").make_tiny_model(tmp / "model", arch="qwen3", seed=0, **m))
    make_s = time.perf_counter() - t0
    bt = shape["batch"]
    batch = make_batch(bt["n"], bt["group"], bt["prompt"], tuple(bt["response"]), vocab=128, seed=a.seed)
    real = sum(s.tokens.numel() for s in batch)
    algo = AlgorithmConfig()

    try:
        hf = hf_phase(model_dir, batch, a, clock, dev, dtype, algo, cfg)
        rx = relax_phase(model_dir, batch, hf["first"], a, clock, algo, cfg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # 0.8 GB at the GPU shape
    diffs = torch.cat([(x - y).abs() for x, y in zip(rx.pop("first"), hf.pop("first"))])
    n = hf["n_params"]
    bound = LOGPROB_BOUND["bf16" if shape["bf16"] else "fp32"]

    def row(s: float, peak: float | None, k: int) -> dict:
        return {"time_s": s, "tokens_per_s": real / s, "peak_gb": peak,
                "mfu": k * n * real / s / flops if flops else None}

    res = {
        "tool": "tools/bench/actor_gpu.py" + (" --cpu-smoke" if smoke else ""),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "card": card, "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
        "peak_flops": flops,
        "model": dict(m, arch="qwen3", vocab=128, params=n, dtype=str(dtype).replace("torch.", ""), make_s=make_s),
        "batch": dict(bt, seed=a.seed, real_tokens=real, lengths=[s.tokens.numel() for s in batch]),
        "config": {"micro_batch_size": cfg.micro_batch_size, "max_tokens_per_micro_batch": cfg.max_tokens_per_micro_batch,
                   "train_overrides": over, "hf_micro_batch": a.micro_batch,
                   "lr": cfg.lr, "clip_grad": cfg.clip_grad, "reps": a.reps, "warmup": a.warmup,
                   "fused_adamw": hf["fused_adamw"]},
        "relax_train": row(rx["train_s"], rx["train_peak_gb"], 6),
        "relax_logprobs": row(rx["logprob_s"], rx["logprob_peak_gb"], 2),
        "hf_train": row(hf["train_s"], hf["train_peak_gb"], 6),
        "hf_logprobs": row(hf["logprob_s"], hf["logprob_peak_gb"], 2),
        "times": {"relax_train": rx["train_times"], "relax_logprobs": rx["logprob_times"],
                  "hf_train": hf["train_times"], "hf_logprobs": hf["logprob_times"],
                  "relax_first_pass": rx["first_pass_s"]},
        "ratio_train": hf["train_s"] / rx["train_s"],
        "ratio_logprobs": hf["logprob_s"] / rx["logprob_s"],
        "first_step": {"relax": {"loss": rx["first_loss"], "grad_norm": rx["first_grad_norm"]},
                       "hf": {"loss": hf["first_loss"], "grad_norm": hf["first_grad_norm"]}},
        "nonfinite_steps": rx["nonfinite_steps"],
        "hf_padding_share": hf["padding_share"], "hf_micro_batches": hf["micro_batches"],
        "logprob_diff": {"mean": float(diffs.mean()), "max": float(diffs.max()), "tokens": diffs.numel(),
                         "bound": bound},
    }
    res["logprob_diff"]["within"] = res["logprob_diff"]["mean"] <= bound["mean"] and res["logprob_diff"]["max"] <= bound["max"]
    peak_ok = None if not cuda else rx["train_peak_gb"] <= hf["train_peak_gb"]
    res["targets"] = {"ratio_train >= 1.5": res["ratio_train"] >= TARGET_RATIO,
                      "relax peak <= transformers peak": peak_ok,
                      "log-probs within bound": res["logprob_diff"]["within"]}
    res["definitions"] = DEFINITIONS
    return res


DEFINITIONS = {
    "real tokens": "the samples' own tokens, prompt + response; no padding",
    "time_s": "median over the timed reps (after the warm-up ones), synchronised on the device",
    "tokens_per_s": "real tokens / time_s",
    "peak_gb": "torch.cuda.max_memory_allocated over the phase, reset at its start (tensors only), 1e9 bytes",
    "mfu": "6·N·real tokens / time_s / peak_flops for a train step, 2·N·… forward only; N = all parameters, "
           "attention-score FLOPs not counted",
    "ratio_train": "relax_hpc real tokens/s / transformers real tokens/s, train step (= hf time / relax time)",
    "ratio_logprobs": "the same for the forward-only log-prob pass",
    "logprob_diff": "|Δ| over every response token: the actor's first compute_log_probs against transformers' "
                    "first forward, the same weights (the untrained model)",
    "first_step": "the first (warm-up) step's loss and grad norm (before clipping) on each side: the same weights, "
                  "data and old log-probs, so the same numbers up to the dtype's rounding",
    "hf_padding_share": "pad slots / all slots of transformers' right-padded micro-batches",
}


def summary(r: dict) -> str:
    def fmt(k: str) -> str:
        x = r[k]
        mem = f"{x['peak_gb']:.1f} GB peak" if x["peak_gb"] is not None else "peak n/a"
        mfu = f", MFU {100 * x['mfu']:.1f} %" if x["mfu"] is not None else ""
        return f"{x['time_s']:.3f} s, {x['tokens_per_s'] / 1e3:.1f}k real tokens/s, {mem}{mfu}"

    d = r["logprob_diff"]
    return "\n".join([
        f"[actor-gpu] {r['card']}, torch {r['torch']}; {mparams(r['model']['params'])} parameters, "
        f"{r['model']['dtype']}; {r['batch']['n']} samples, {r['batch']['real_tokens']} real tokens",
        f"  relax_hpc train_step        {fmt('relax_train')}",
        f"  transformers GRPO step      {fmt('hf_train')}",
        f"  relax_hpc compute_log_probs {fmt('relax_logprobs')}",
        f"  transformers log-probs      {fmt('hf_logprobs')}",
        f"  ratio relax/transformers (real tokens/s): train {r['ratio_train']:.2f}x (target >= {TARGET_RATIO}), "
        f"log-probs {r['ratio_logprobs']:.2f}x",
        f"  log-probs, actor's first pass vs transformers', same weights: mean |d| {d['mean']:.2g}, max {d['max']:.2g} "
        f"(bound mean <= {d['bound']['mean']}, max <= {d['bound']['max']}: {'within' if d['within'] else 'OUTSIDE'})",
        f"  first step, loss / grad norm: relax_hpc {r['first_step']['relax']['loss']:.5g} / "
        f"{r['first_step']['relax']['grad_norm']:.5g}, transformers {r['first_step']['hf']['loss']:.5g} / "
        f"{r['first_step']['hf']['grad_norm']:.5g}",
    ])


# ---------------------------------------------------------------------------------------------------------------
# docs/benchmarks.md, "## GPU"
# ---------------------------------------------------------------------------------------------------------------


def mparams(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2g}M"


def section(r: dict) -> str:
    m, b, c = r["model"], r["batch"], r["config"]
    packing = (f"packed (≤ {c['max_tokens_per_micro_batch']} tokens a micro-batch)" if c["max_tokens_per_micro_batch"]
               else f"padded ({c['micro_batch_size']} samples a micro-batch)")
    if c["train_overrides"]:
        packing += ", " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in c["train_overrides"].items())

    def cell(x: dict) -> str:
        peak = f"{x['peak_gb']:.1f}" if x["peak_gb"] is not None else "n/a"
        mfu = f"{100 * x['mfu']:.1f} %" if x["mfu"] is not None else "n/a"
        return f"{x['time_s']:.3f} | {x['tokens_per_s'] / 1e3:.1f}k | {peak} | {mfu}"

    d, t, fs = r["logprob_diff"], r["targets"], r["first_step"]

    def met(v) -> str:
        return "n/a" if v is None else "met" if v else "**not met**"

    peak = f"{r['peak_flops'] / 1e12:.0f} TFLOP/s" if r["peak_flops"] else "unknown for this card (MFU not given)"
    return "\n".join([
        "## GPU", "",
        f"Written by `{r['tool']}` ({r['date']}) on **{r['card']}** (torch {r['torch']}"
        f"{', CUDA ' + r['cuda'] if r['cuda'] else ''}); "
        "`tools/bench/run --only actor-gpu` and `tools/gpu-check` run the same. One process, one device, the same "
        f"batch: {b['n']} GRPO samples ({b['group']} per prompt) of {b['prompt']} prompt + {b['response'][0]}–"
        f"{b['response'][1]} response tokens, {b['real_tokens']} real tokens, seed {b['seed']}; a Qwen3-shaped "
        f"model of {mparams(m['params'])} parameters (hidden {m['hidden']}, {m['layers']} layers, {m['heads']} "
        f"heads, {m['kv_heads']} KV heads, MLP {m['intermediate']}, vocab {m['vocab']}), {m['dtype']}. Medians of "
        f"{c['reps']} reps after {c['warmup']} warm-up.", "",
        "| step | time (s) | real tokens/s | peak memory (GB) | MFU |", "|---|---|---|---|---|",
        f"| relax_hpc `MegatronActor.train_step`, {packing} "
        f"| {cell(r['relax_train'])} |",
        f"| transformers + torch GRPO step, {c['hf_micro_batch']} samples a micro-batch, right-padded "
        f"({100 * r['hf_padding_share']:.0f} % padding), AdamW{' fused' if c['fused_adamw'] else ''} "
        f"| {cell(r['hf_train'])} |",
        f"| relax_hpc `compute_log_probs` (forward only) | {cell(r['relax_logprobs'])} |",
        f"| transformers forward-only log-probs, the same micro-batches | {cell(r['hf_logprobs'])} |", "",
        f"- relax_hpc / transformers, real tokens/s of the train step: **{r['ratio_train']:.2f}×** (target ≥ "
        f"{TARGET_RATIO}×: {met(t['ratio_train >= 1.5'])}); forward-only log-probs {r['ratio_logprobs']:.2f}×. Peak "
        f"memory of the train step not above transformers': {met(t['relax peak <= transformers peak'])}.",
        f"- Log-probs of the actor's first pass against transformers' on the same weights, {d['tokens']} response "
        f"tokens: mean |Δ| {d['mean']:.2g}, max {d['max']:.2g} (bound: mean ≤ {d['bound']['mean']}, max ≤ "
        f"{d['bound']['max']}: {'within' if d['within'] else '**outside**'}). First step (same weights, data, old log-probs), loss and grad "
        f"norm: relax_hpc {fs['relax']['loss']:.5f}, {fs['relax']['grad_norm']:.5f}; transformers "
        f"{fs['hf']['loss']:.5f}, {fs['hf']['grad_norm']:.5f}.",
        "- Definitions: real tokens are the samples' own (prompt + response, no padding); time is the median of the "
        "timed reps, synchronised on the device; tokens/s = real tokens / time; peak memory is "
        "`torch.cuda.max_memory_allocated` over the phase, reset at its start (tensors only); MFU = 6·N·real tokens "
        f"/ time / peak (2·N·… forward only), N = all {mparams(m['params'])} parameters, attention scores not "
        f"counted, peak {peak} (bf16 dense).",
        "",
    ])


PLACEHOLDER_MARK = "No card has run it yet."


def write_section(path: Path, text: str, heading: str = "## GPU") -> None:
    """Replace the ``heading`` section (up to the next ``## `` or ``### `` heading), or put one before the first
    ``### `` section (the appended logs)."""
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    pat = re.compile("^" + re.escape(heading) + r"\n.*?(?=^##+ |\Z)", re.S | re.M)
    if pat.search(doc):
        doc = pat.sub(lambda _: text + "\n", doc, count=1)
    else:
        i = doc.find("\n### ")
        doc = doc + "\n" + text if i < 0 else doc[: i + 1] + text + "\n" + doc[i + 1:]
    path.write_text(doc)


def save(res: dict, out: str | None, docs: str | None, text: str, heading: str = "## GPU") -> None:
    """A benchmark's result: its JSON at ``out``, its docs section (``text``) in ``docs``; either may be None."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {out}")
    if docs:
        write_section(Path(docs), text, heading)
        print(f"{heading[3:]} section of {docs} rewritten")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help=f"JSON result (default {DEFAULT_OUT.relative_to(REPO)}; with --cpu-smoke: none)")
    p.add_argument("--docs", help="rewrite the GPU section of this file (default docs/benchmarks.md; with "
                                  "--cpu-smoke only when given)")
    p.add_argument("--no-write", action="store_true", help="do not touch the docs")
    p.add_argument("--reps", type=int, default=5, help="timed reps of each phase (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed train steps first")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch (transformers; the actor's "
                                                               "micro_batch_size)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the actor's train.max_tokens_per_micro_batch (default 8192: the slots of transformers' "
                        "largest padded micro-batch, 4 × 2048; 0: padded micro-batches)")
    p.add_argument("--seed", type=int, default=0, help="the batch's seed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a TrainConfig field for the actor, e.g. --set recompute=selective (repeatable)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's bf16 dense peak, if not H100/H200/A100")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape, fp32, CPU, gloo: the same code path, checked")
    p.add_argument("--from-json", help="only rewrite the docs section from this saved result")
    a = p.parse_args(argv)
    if a.from_json:
        write_section(Path(a.docs or DEFAULT_DOCS), section(json.loads(Path(a.from_json).read_text())))
        print(f"GPU section of {a.docs or DEFAULT_DOCS} rewritten from {a.from_json}")
        return 0
    if a.cpu_smoke:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the smoke is the CPU path, also on a machine with a GPU
    import torch

    if not a.cpu_smoke and not torch.cuda.is_available():
        print("actor-gpu needs a CUDA GPU (torch.cuda.is_available() is False here): nothing measured, nothing "
              "written. `tools/bench/actor_gpu.py --cpu-smoke` runs the same code at a tiny shape on the CPU; "
              "`tools/gpu-check` runs this on a GPU machine (docs/gpu.md).")
        return 0
    if a.cpu_smoke:
        a.reps, a.warmup = min(a.reps, 2), min(a.warmup, 1)
    res = run(a)
    print(summary(res))
    save(res, a.out or (None if a.cpu_smoke else str(DEFAULT_OUT)),
         None if a.no_write else (a.docs or (None if a.cpu_smoke else str(DEFAULT_DOCS))), section(res))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)  # megatron + transformers teardown takes seconds and flushes nothing we need
