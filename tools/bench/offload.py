#!/usr/bin/env python3
"""Trainer offload benchmark (run by hand, not a test): what one ``train.offload`` cycle frees and what it costs.

    tools/bench/offload.py [--hidden 512 --layers 8 --heads 8 --intermediate 1792] [--reps 7] [--no-append]
                           [--json PATH]

The model is a Llama made offline by tools/make-tiny-model, by default with Llama-3-8B's proportions (as
tools/bench/weight_sync.py), fp32, trained by the real ``MegatronActor`` (world 1, gloo on the CPU, NCCL on a GPU):
Megatron DDP and the distributed optimizer, one train step first so that Adam's state exists. Each rep is the
actor role's cycle (:mod:`relax_hpc.train.offload`, :mod:`relax_hpc.roles.actor`):

* ``offload``: the gradients and optimizer state off (after the train step), then the parameters (after the sync):
  the copies of what is kept (parameters, Adam state; the gradients are dropped) and the ``resize_(0)``s;
* ``reload``: every storage back (``resize_``), the kept bytes copied in, the gradients zeroed (before the next
  train step).

Against ``raw copy``: the same kept bytes as one flat buffer copied to a host buffer and back, both allocated once
(the memcpy bound: no per-storage calls, no fresh pages). On the CPU "the device" is the CPU: the cycle frees
nothing for anyone there, so the figure is the mechanism's cost; a GPU run (pinned host memory) measures the PCIe
cycle. Medians over ``--reps`` after one warm-up; the methods interleave rep by rep (the machine may be shared).

Prints a markdown table and appends it, with machine and date, to docs/benchmarks.md (never rewrites it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from common import append, machine  # noqa: E402


def build(model_dir: Path):
    """A MegatronActor (world 1) after one GRPO train step: parameters, grad buffers and Adam state all exist."""
    import torch
    import torch.distributed as dist

    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.train import MegatronActor, TrainConfig, cpu_compat, init_parallel
    from relax_hpc.train.batch import TrainingSample

    dist.init_process_group(cpu_compat.backend(), store=dist.HashStore(), rank=0, world_size=1)
    init_parallel(1, 1, seed=0)
    actor = MegatronActor.from_hf(model_dir, TrainConfig(lr=1e-3, micro_batch_size=2, seed=0,
                                                         use_distributed_optimizer=True), AlgorithmConfig())
    g = torch.Generator().manual_seed(0)
    batch = [TrainingSample.of(torch.randint(6, 128, (24,), generator=g), 8, advantage=a)
             for a in (1.0, -1.0, 0.5, -0.5)]
    actor.train_step(batch)
    return actor


def measure(actor, reps: int) -> dict:
    import torch

    from relax_hpc.train.offload import KEPT, TrainOffload

    off = TrainOffload(actor.model, actor.optimizer)
    dev = off.device
    sizes = off.device_bytes()
    kept = sum(v for k, v in sizes.items() if k in KEPT)
    pin = dev.type == "cuda"
    flat = torch.empty(kept, dtype=torch.uint8, device=dev)
    host = torch.empty(kept, dtype=torch.uint8, pin_memory=pin)

    def sync():
        if pin:
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {"offload": [], "reload": [], "raw copy out": [], "raw copy in": []}
    freed = []
    for rep in range(reps + 1):  # the first is the warm-up (the host buffers are allocated then)
        b1, s1 = off.offload(("grads", "optimizer"))
        b2, s2 = off.offload(("params",))
        assert all(v == 0 for v in off.device_bytes().values()), off.device_bytes()
        r = off.reload()
        sync()
        t0 = time.perf_counter()
        host.copy_(flat, non_blocking=pin)
        sync()
        t1 = time.perf_counter()
        flat.copy_(host, non_blocking=pin)
        sync()
        t2 = time.perf_counter()
        if rep:
            times["offload"].append(s1 + s2)
            times["reload"].append(r)
            times["raw copy out"].append(t1 - t0)
            times["raw copy in"].append(t2 - t1)
            freed.append(b1 + b2)
    assert len(set(freed)) == 1 and freed[0] == sum(sizes.values()), (freed, sizes)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"device": str(dev), "bytes": sizes, "freed": freed[0], "kept": kept, "times": times, "med": med,
            "storages": {k: len(v) for k, v in off.storages().items()}}


def render(res: dict, desc: str, reps: int, when: str, where: str) -> str:
    m, b = res["med"], res["bytes"]
    mb = 1e6
    cycle, raw = m["offload"] + m["reload"], m["raw copy out"] + m["raw copy in"]
    rows = [("offload (grads + optimizer, then params)", m["offload"], res["kept"]),
            ("reload (all; grads zeroed)", m["reload"], res["kept"]),
            ("cycle", cycle, 2 * res["kept"]),
            ("raw copy of the kept bytes, out + in", raw, 2 * res["kept"])]
    lines = [f"### Trainer offload cycle, `train.offload` ({when})", "",
             f"Machine: {where}. `tools/bench/offload.py`: {desc}; the real MegatronActor on {res['device']} (DDP, "
             f"distributed optimizer, after one train step), {reps} reps after a warm-up, medians. Freed a cycle: "
             f"{res['freed'] / mb:.1f} MB = params {b['params'] / mb:.1f} + grads {b['grads'] / mb:.1f} + Adam state "
             f"{b['optimizer'] / mb:.1f} MB ({sum(res['storages'].values())} storages); copied each way: the "
             f"{res['kept'] / mb:.1f} MB of params and Adam state (the grads are dropped and come back as zeros).", "",
             "| what | s | GB/s of copied bytes |", "|---|---|---|"]
    for what, s, n in rows:
        lines.append(f"| {what} | {s:.4f} | {n / s / 1e9:.2f} |")
    lines += ["", f"The cycle costs {cycle / raw:.2f}× the raw copy of the same bytes (the reload also zeroes the "
              "grads and touches fresh pages, one copy per storage); on the CPU it frees nothing for anyone (the host "
              "copy is in the same memory), so this is the mechanism's price, paid once a step in colocate."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1792)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-append", action="store_true", help="print only; do not append to docs/benchmarks.md")
    p.add_argument("--json", help="also write the timings here")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    a = p.parse_args(argv)
    import torch

    from weight_sync import make_model  # tools/bench/weight_sync.py: the same models

    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = machine(f"torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="relax-bench-offload-"))
    try:
        model = make_model(a.hidden, a.layers, tmp / "model", heads=a.heads, kv_heads=a.heads // 4 or 1,
                           intermediate=a.intermediate)
        res = measure(build(model), a.reps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    desc = f"Llama, hidden {a.hidden}, {a.layers} layers, {a.heads} heads, intermediate {a.intermediate}, fp32"
    text = render(res, desc, a.reps, when, where)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps({**res, "desc": desc, "text": text}))
    if not a.no_append:
        append(a.out, text)
    return 0


def bench(quick: bool, base: Path) -> tuple[dict, str]:
    """For tools/bench/run: this script in a process of its own (megatron's parallel state is process-wide)."""
    import subprocess

    out = base / "offload.json"
    args = ["--layers", "4", "--reps", "3"] if quick else []
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--no-append", "--json", str(out), *args],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = json.loads(out.read_text())
    med = got["med"]
    cycle = med["offload"] + med["reload"]
    return ({"offload_cycle_vs_raw_copy": cycle / (med["raw copy out"] + med["raw copy in"])},
            f"Trainer offload: {got['desc']}; freed {got['freed'] / 1e6:.1f} MB a cycle, offload "
            f"{med['offload']:.4f} s + reload {med['reload']:.4f} s (medians), "
            f"{cycle / (med['raw copy out'] + med['raw copy in']):.2f}× a raw copy of the same bytes.")


if __name__ == "__main__":
    sys.exit(main())
