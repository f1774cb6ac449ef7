#!/usr/bin/env python3
"""The colocate step on one GPU: the engine and the actor take turns on the card, the weights go by CUDA IPC.

    tools/bench/handover_gpu.py [--out JSON] [--docs MD | --no-write] [--steps 3] [--pushes 5]
    tools/bench/handover_gpu.py --cpu-smoke --out J  (the same code at a tiny shape, fp32, CPU: a test)
    tools/bench/handover_gpu.py --from-json J        (rewrite the "GPU: the colocate step" section of docs/benchmarks.md)

Work (issue #29), on the 200M Qwen3 shape and the GRPO batch of ``tools/bench/actor_gpu.py``: relax_hpc's reference
engine (``python -m relax_hpc.engines.cpu_engine --device auto``, bf16) and a ``MegatronActor`` (bf16, packed) in
this process, both on GPU 0. Each colocate step, as a run does it: **generate** (the batch's prompts, 8 samples
each, ``--new-tokens`` tokens, one HTTP batch) → **release** (``/release_memory_occupation``) → **train** (one
``train_step`` on the batch) → **resume** (``/resume_memory_occupation``) → **push** (``WeightSender.push`` of
``named_hf_weights()``: the bridge's export, then ``/update_weights_from_tensor``, pause to continue). Then
``--pushes`` pushes of the weights already exported (0.4 GB bf16 held on the GPU), which time the transfer alone,
against a device copy of the same bytes.

Definitions (printed beside each number): *time*: wall, synchronised on the device, median over the steps (the
first step is a warm-up, left out). *GPU idle share*: 1 − (generate + train + push) / step. *transfer*: the
sender's ``perf/weight_sync_transfer_time``: the ``/update_weights_from_tensor`` calls, HTTP included, of weights
already exported. *device copy*: ``dst.copy_(src)`` of one flat buffer of the same bytes, in this process.
*released*: ``torch.cuda.mem_get_info`` free bytes after the release minus before it (the engine is another
process: its memory shows only there).
"""

from __future__ import annotations

import dataclasses
import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import actor_gpu as A  # noqa: E402  (its shapes, batch, clock and process group: the same work)

REPO = A.REPO
DEFAULT_OUT = HERE / "results" / "handover_gpu.json"
DEFAULT_DOCS = REPO / "docs" / "benchmarks.md"
HEADING = "## GPU: the colocate step"
TARGET_TRANSFER_S = 0.010  # issue #29: the 200M model's weights by /update_weights_from_tensor, HTTP included


def free_bytes(cuda: bool) -> int | None:
    import torch

    return int(torch.cuda.mem_get_info()[0]) if cuda else None


def run(a) -> dict:
    import torch

    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.engines.client import EngineClient
    from relax_hpc.engines.launcher import start_engine
    from relax_hpc.train import MegatronActor, TrainConfig, init_parallel
    from relax_hpc.weights.sync import WeightSender

    smoke = a.cpu_smoke
    shape = A.SHAPES["cpu-smoke" if smoke else "gpu"]
    cuda = not smoke
    if not cuda:
        torch._dynamo.config.disable = True
    clock = A.Clock(cuda)
    card = torch.cuda.get_device_name(0) if cuda else "CPU (smoke: not a GPU figure)"
    A.init_dist(cuda)
    tmp = Path(tempfile.mkdtemp(prefix="relax-handover-gpu-"))
    engine = None
    try:
        model_dir = str(A.load_tool("make-tiny-model").make_tiny_model(tmp / "model", arch="qwen3", seed=0,
                                                                        **shape["model"]))
        engine = start_engine("reference", model_dir, log_path=tmp / "engine.log",
                              extra_args=["--device", "auto", "--seed", "0", "--threads", "1"])
        engine.wait_ready(600)
        client = EngineClient(engine.url, timeout=600)
        bt = shape["batch"]
        batch = A.make_batch(bt["n"], bt["group"], bt["prompt"], tuple(bt["response"]), vocab=128, seed=a.seed)
        prompts = [s.tokens[: bt["prompt"]].tolist() for s in batch]
        cfg = TrainConfig(bf16=shape["bf16"], micro_batch_size=1, lr=1e-6, seed=1, max_seq_len=shape["max_seq_len"],
                          max_tokens_per_micro_batch=8192 if cuda else 128)
        init_parallel(1, 1, seed=cfg.seed)
        actor = MegatronActor.from_hf(model_dir, cfg, AlgorithmConfig())
        old = actor.compute_log_probs(batch)
        data = [dataclasses.replace(s, old_log_probs=o) for s, o in zip(batch, old)]
        # a one-GPU box: the engine shares the actor's GPU, so the sender picks the tensor path by itself
        sender = WeightSender(path=None if cuda else "tensor")
        sender.connect([engine.url], "127.0.0.1")
        assert sender.path == "tensor", f"the sender chose {sender.path} for an engine on its own GPU"
        new = a.new_tokens or (256 if cuda else 8)
        sp = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
        steps = []
        for i in range(a.steps + 1):
            row: dict = {}
            t0 = time.perf_counter()
            row["generate_s"], _ = clock.time(lambda: client.generate_batch(prompts, sp, return_logprob=True))
            before = free_bytes(cuda)
            row["release_s"], _ = clock.time(client.release_memory_occupation)
            row["released_gb"] = (free_bytes(cuda) - before) / 1e9 if cuda else None
            row["train_s"], _ = clock.time(lambda: actor.train_step(data))
            row["resume_s"], _ = clock.time(client.resume_memory_occupation)
            m = {}
            row["push_s"], _ = clock.time(lambda: m.update(sender.push(actor.named_hf_weights(), version=str(i + 1))))
            row["step_s"] = time.perf_counter() - t0
            row["push_transfer_s"] = m["perf/weight_sync_transfer_time"]
            row["idle_share"] = 1 - (row["generate_s"] + row["train_s"] + row["push_s"]) / row["step_s"]
            steps.append(row)
        steps = steps[1:]  # the first is a warm-up
        named = [(n, t.detach().clone()) for n, t in actor.named_hf_weights()]  # exported once, held on the device
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        pushes = []
        for i in range(a.pushes):
            clock.sync()
            m = sender.push(named, version=f"p{i}")
            pushes.append(m)
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
        dst = torch.empty_like(src)
        copy_s, copies, _ = A.timed(clock, lambda: dst.copy_(src), 2, max(a.pushes, 3))
        sender.close()
        client.close()
    finally:
        if engine is not None:
            engine.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(key: str, rows: list[dict]) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    transfer = statistics.median(p["perf/weight_sync_transfer_time"] for p in pushes)
    whole = statistics.median(p["perf/weight_sync_time"] for p in pushes)
    res = {
        "tool": "tools/bench/handover_gpu.py" + (" --cpu-smoke" if smoke else ""),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "card": card, "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
        "model": dict(shape["model"], arch="qwen3", vocab=128, dtype="bfloat16" if shape["bf16"] else "float32"),
        "batch": dict(bt, seed=a.seed, new_tokens=new),
        "steps": steps, "step": {k: med(k, steps) for k in steps[0]},
        "push": {"bytes": nbytes, "tensors": len(named), "buckets": pushes[0]["perf/weight_sync_buckets"],
                 "transfer_s": transfer, "sync_s": whole, "transfer_gbps": nbytes / transfer / 1e9,
                 "transfers": [p["perf/weight_sync_transfer_time"] for p in pushes],
                 "device_copy_s": copy_s, "device_copy_gbps": nbytes / copy_s / 1e9, "copies": copies,
                 "transfer_over_copy": transfer / copy_s},
    }
    res["targets"] = {"transfer <= 10 ms": transfer <= TARGET_TRANSFER_S if cuda else None,
                      "memory released while training": (res["step"]["released_gb"] or 0) > 0.1 if cuda else None}
    res["definitions"] = DEFINITIONS
    return res


DEFINITIONS = {
    "time": "wall, synchronised on the device; the median over the timed steps (the first is a warm-up)",
    "idle_share": "1 - (generate + train + push) / step: the step's share with neither role computing",
    "push_s": "WeightSender.push of named_hf_weights(): the bridge's export, then pause, the tensor calls, version, "
              "continue",
    "transfer_s": "perf/weight_sync_transfer_time of a push of weights already exported: the "
                  "/update_weights_from_tensor calls, HTTP included",
    "sync_s": "the same push's perf/weight_sync_time: pause to continue",
    "device_copy_s": "dst.copy_(src) of one flat buffer of the same bytes in this process, synchronised",
    "released_gb": "free device memory after /release_memory_occupation minus before it (torch.cuda.mem_get_info)",
}


def summary(r: dict) -> str:
    s, p = r["step"], r["push"]
    rel = f", {s['released_gb']:.2f} GB released" if s.get("released_gb") is not None else ""
    return (f"{r['card']}: colocate step {s['step_s']:.3f} s = generate {s['generate_s']:.3f} + release "
            f"{s['release_s']:.4f}{rel} + train {s['train_s']:.3f} + resume {s['resume_s']:.4f} + push "
            f"{s['push_s']:.3f} (GPU idle share {100 * s['idle_share']:.1f} %)\n"
            f"weights {p['bytes'] / 1e9:.3f} GB in {p['tensors']} tensors, {p['buckets']:.0f} buckets: transfer "
            f"{1e3 * p['transfer_s']:.2f} ms ({p['transfer_gbps']:.1f} GB/s), whole sync {1e3 * p['sync_s']:.2f} ms; "
            f"device copy {1e3 * p['device_copy_s']:.3f} ms ({p['device_copy_gbps']:.0f} GB/s); transfer / copy "
            f"{p['transfer_over_copy']:.1f}×")


def section(r: dict) -> str:
    s, p, m, b = r["step"], r["push"], r["model"], r["batch"]
    t = r["targets"]
    met = {None: "n/a", True: "met", False: "**not met**"}
    rel = f"{s['released_gb']:.2f} GB" if s.get("released_gb") is not None else "n/a"
    return "\n".join([
        HEADING, "",
        f"Written by `{r['tool']}` ({r['date']}) on **{r['card']}** (torch {r['torch']}"
        f"{', CUDA ' + r['cuda'] if r['cuda'] else ''}). The reference engine and a `MegatronActor` on one device, "
        f"Qwen3 shape (hidden {m['hidden']}, {m['layers']} layers), {m['dtype']}; {b['n']} samples of {b['prompt']} "
        f"prompt tokens + {b['new_tokens']} generated; medians of {len(r['steps'])} steps after one warm-up.", "",
        "| generate | release | train | resume | push (export + sync) | step | GPU idle share | released |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['generate_s']:.3f} s | {1e3 * s['release_s']:.1f} ms | {s['train_s']:.3f} s | {1e3 * s['resume_s']:.1f} ms "
        f"| {s['push_s']:.3f} s | {s['step_s']:.3f} s | {100 * s['idle_share']:.1f} % | {rel} |", "",
        f"- Weights by `/update_weights_from_tensor` ({'CUDA IPC' if r['cuda'] else 'shared memory'}): "
        f"{p['bytes'] / 1e9:.3f} GB in {p['tensors']} tensors, {p['buckets']:.0f} bucket(s): transfer "
        f"**{1e3 * p['transfer_s']:.2f} ms** ({p['transfer_gbps']:.1f} GB/s; target ≤ 10 ms: "
        f"{met[t['transfer <= 10 ms']]}), the whole sync (pause to continue) {1e3 * p['sync_s']:.2f} ms; a device copy "
        f"of the same bytes {1e3 * p['device_copy_s']:.3f} ms ({p['device_copy_gbps']:.0f} GB/s): "
        f"{p['transfer_over_copy']:.1f}× the copy. Memory released while the actor trains: {met[t['memory released while training']]}.",
        "- Definitions: " + "; ".join(f"{k}: {v}" for k, v in r["definitions"].items()) + ".",
        "",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help=f"JSON result (default {DEFAULT_OUT.relative_to(REPO)}; with --cpu-smoke: none)")
    p.add_argument("--docs", help="rewrite this benchmark's section of this file (default docs/benchmarks.md; with "
                                  "--cpu-smoke only when given)")
    p.add_argument("--no-write", action="store_true", help="do not touch the docs")
    p.add_argument("--steps", type=int, default=3, help="timed colocate steps (after one warm-up)")
    p.add_argument("--pushes", type=int, default=5, help="timed pushes of weights already exported")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per sample (default 256; smoke 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape, fp32, CPU: the same code path, checked")
    p.add_argument("--from-json", help="only rewrite the docs section from this saved result")
    a = p.parse_args(argv)
    if a.from_json:
        A.write_section(Path(a.docs or DEFAULT_DOCS), section(json.loads(Path(a.from_json).read_text())), HEADING)
        print(f"{HEADING[3:]} section of {a.docs or DEFAULT_DOCS} rewritten from {a.from_json}")
        return 0
    if a.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        a.steps, a.pushes = min(a.steps, 1), min(a.pushes, 2)
    import torch

    if not a.cpu_smoke and not torch.cuda.is_available():
        print("handover-gpu needs a CUDA GPU: nothing measured. `--cpu-smoke` runs the same code on the CPU; "
              "`tools/gpu-check` runs it on a GPU machine (docs/gpu.md).")
        return 0
    res = run(a)
    print(summary(res))
    A.save(res, a.out or (None if a.cpu_smoke else str(DEFAULT_OUT)),
           None if a.no_write else (a.docs or (None if a.cpu_smoke else str(DEFAULT_DOCS))), section(res), HEADING)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
