#!/usr/bin/env python3
"""Weight-sync benchmark (run by hand, not a test): bucketed broadcast vs the raw limit vs one broadcast per tensor.

    tools/bench/weight_sync.py [--source actor|file] [--layers 24 --hidden 128 --heads 4 --intermediate N] [--reps 25]
                               [--bucket-mib 512 16 4] [--no-engine] [--no-append] [--json PATH]

The model is a tiny Llama made offline by tools/make-tiny-model (default hidden 128, 24 layers: 219 tensors,
about 25 MB in fp32): many small tensors, where per-broadcast overhead shows. ``--hidden 512 --layers 8 --heads 8
--intermediate 1792`` gives Llama-3-8B's proportions (QKV 12 % of a layer's weights, the MLP 80 %), with 1 MB
tensors, about 110 MB.
``--source actor`` (default): the tensors are what a weight sync sends, the real ``MegatronActor``'s export
(``named_hf_weights``, world 1, gloo): views of Megatron's DDP param buffer where the bridge maps a parameter
as it is, fresh tensors where it converts (QKV split). Runs of the views that lie end to end go out without a
pack copy (``WeightSender.push(in_place=actor.in_place())``). ``--source file``: the checkpoint's tensors,
each in its own memory, so every bucket is packed.

1. **Transport** (two processes on this machine, one gloo group built by relax_hpc.weights.sync.new_group,
   the same code path as WeightSender.connect): this process sends (rank 0), a child receives (rank 1) the
   way SGLang's engine does (allocate, receive, cut into views; relax_hpc.weights.sync.receive).
   * ``raw``: one broadcast of a ready flat buffer with the same bytes (the limit: no packing, one call);
   * ``bucketed``: relax_hpc.weights.sync.send_buckets (runs in place as they lie; the rest packed per bucket,
     one broadcast each, packing of the next bucket overlapping the current broadcast), per bucket size;
   * ``per_tensor``: one broadcast per tensor (send_buckets mode="per_tensor").
   Each timing runs from a start handshake to the receiver's acknowledgement, methods interleaved rep by
   rep (the machine may be shared), ``--reps`` runs after one warm-up; ratios use each method's best run.
2. **End to end** (unless --no-engine): WeightSender.push to a CPU engine process (HTTP + gloo + the
   engine loading the weights), bucketed vs per-tensor broadcasts vs one HTTP call + broadcast per tensor.

Prints a markdown table and appends it, with machine and date, to docs/benchmarks.md (never rewrites it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.machinery
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import append, machine  # noqa: E402  (tools/bench/common.py: this script's directory is on sys.path)
from relax_hpc.weights.buckets import BufferRing, MiB, dtype_from_name, empty_flat, iter_buckets, plan, unpack  # noqa: E402
from relax_hpc.weights.push import take_snapshot  # noqa: E402
from relax_hpc.weights.sync import new_group, receive, send_buckets  # noqa: E402

GROUP = "relax_bench_weight_sync"
TIMEOUT = dt.timedelta(seconds=300)


# ----------------------------------------------------------------------------------------- receiver (child)

def receiver(port: int) -> int:
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=TIMEOUT)
    pg = new_group(store, 1, 2, GROUP, "gloo", TIMEOUT)
    flag = torch.zeros(1)
    raw_buf = None
    cache: dict = {}
    i = 0
    while True:
        cmd = json.loads(store.get(f"cmd/{i}"))
        i += 1
        if cmd["method"] == "quit":
            return 0
        if cmd["method"] == "raw" and (raw_buf is None or raw_buf.numel() != cmd["numel"]):
            raw_buf = torch.empty(cmd["numel"], dtype=getattr(torch, cmd["dtype"]))
        dist.broadcast(flag, src=0, group=pg)  # start handshake
        if cmd["method"] == "raw":
            dist.broadcast(raw_buf, src=0, group=pg)
        elif not cmd["reuse"]:  # exactly SGLang's receive path, every buffer freshly allocated
            fmt = "flattened_bucket" if cmd["method"] == "bucketed" else None
            for names, dtypes, shapes in cmd["buckets"]:
                receive(names, dtypes, shapes, pg, load_format=fmt)
        else:  # the same with buffers reused between syncs, as SGLang's CUDA caching allocator gives them
            for k, (names, dtypes, shapes) in enumerate(cmd["buckets"]):
                metas = plan((n, s, dtype_from_name(d)) for n, d, s in zip(names, dtypes, shapes))
                key = (cmd["method"], *cmd["bucket"], k)
                if cmd["method"] == "bucketed":
                    if key not in cache:
                        cache[key] = empty_flat(metas)
                    dist.broadcast(cache[key], src=0, group=pg)
                    unpack(cache[key], metas)
                else:
                    if key not in cache:
                        cache[key] = [torch.empty(m.shape, dtype=m.dtype) for m in metas]
                    for w in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in cache[key]]:
                        w.wait()
        dist.broadcast(flag, src=1, group=pg)  # acknowledgement: everything is here


# ----------------------------------------------------------------------------------------- sender (parent)

class _Export:
    """``named`` as a model's export, for take_snapshot."""

    def __init__(self, named: list):
        self.named = named

    def named_hf_weights(self):
        return iter(self.named)

def make_model(hidden: int, layers: int, out: Path, heads: int = 4, kv_heads: int = 2,
               intermediate: int | None = None) -> Path:
    loader = importlib.machinery.SourceFileLoader("relax_make_tiny_model_bench", str(REPO / "tools" / "make-tiny-model"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.make_tiny_model(out, arch="llama", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, seed=0,
                               intermediate=intermediate)


def actor_weights(model_dir: Path):
    """(named, in_place, actor): the real MegatronActor's weight-sync export, as the actor role sends it."""
    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.train import MegatronActor, TrainConfig, cpu_compat, init_parallel

    if not dist.is_initialized():
        dist.init_process_group(cpu_compat.backend(), store=dist.HashStore(), rank=0, world_size=1)
        init_parallel(1, 1, seed=0)
    actor = MegatronActor.from_hf(model_dir, TrainConfig(lr=1e-3, micro_batch_size=1, seed=0), AlgorithmConfig())
    return list(actor.named_hf_weights()), actor.in_place(), actor


def transport(named: list, reps: int, bucket_sizes: list[int], reuse: bool, in_place=None) -> dict[str, list[float]]:
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    child = subprocess.Popen([sys.executable, __file__, "--receiver", str(store.port), "--threads",
                              str(torch.get_num_threads())])
    try:
        pg = new_group(store, 0, 2, GROUP, "gloo", TIMEOUT)
        flag = torch.zeros(1)
        total = sum(t.numel() for _, t in named)
        dtype = named[0][1].dtype
        raw = torch.cat([t.reshape(-1) for _, t in named])
        plans = {(b, ip is not None): [[bk.names, bk.dtypes, bk.shapes] for bk in iter_buckets(named, b, in_place=ip)]
                 for b in bucket_sizes for ip in {in_place, None}}
        big = max(bucket_sizes)
        # train.overlap_sync's push: the buckets packed ahead, in the snapshot (relax_hpc.weights.push.take_snapshot),
        # each sent as it lies; the snapshot's own copy is timed apart ("pack only")
        ahead = take_snapshot(_Export(named), 0, bucket_bytes=big)
        plans["ahead"] = [[bk.names, bk.dtypes, bk.shapes] for bk in ahead.buckets]
        # (label, method, bucket bytes, in_place); "packed": the same buckets with every tensor packed (no in place)
        methods = ([("raw", "raw", None, None)] + [(f"bucketed {b // MiB} MiB", "bucketed", b, in_place) for b in bucket_sizes]
                   + ([(f"bucketed {big // MiB} MiB, all packed", "bucketed", big, None)] if in_place is not None else [])
                   + [(f"bucketed {big // MiB} MiB, packed ahead", "bucketed", big, "ahead")]
                   + [("per_tensor", "per_tensor", big, in_place)])
        ring = BufferRing(2) if reuse else None
        times: dict[str, list[float]] = {}
        seq = 0
        for rep in range(reps + 1):  # rep 0 warms up (allocator, sockets)
            for label, method, b, ip in methods:
                cmd = {"method": method, "numel": total, "dtype": str(dtype).removeprefix("torch."), "reuse": reuse,
                       "bucket": [b, ip is not None, ip == "ahead"]}
                if b is not None:
                    cmd["buckets"] = plans["ahead"] if ip == "ahead" else plans[(b, ip is not None)]
                store.set(f"cmd/{seq}", json.dumps(cmd))
                seq += 1
                dist.broadcast(flag, src=0, group=pg)
                t0 = time.perf_counter()
                if method == "raw":
                    dist.broadcast(raw, src=0, group=pg)
                elif ip == "ahead":
                    send_buckets(ahead.buckets, pg, b, mode=method)  # as the push sends a Snapshot: as they lie
                else:
                    send_buckets(named, pg, b, mode=method, ring=ring, in_place=ip)
                dist.broadcast(flag, src=1, group=pg)
                dt_s = time.perf_counter() - t0
                if rep > 0:
                    times.setdefault(label, []).append(dt_s)
        store.set(f"cmd/{seq}", json.dumps({"method": "quit"}))
        child.wait(timeout=60)
        return times
    finally:
        if child.poll() is None:
            child.kill()  # our own child, by its handle
            child.wait()


def end_to_end(model_dir: Path, named: list, reps: int, log_dir: Path, in_place=None) -> dict[str, list[float]]:
    from relax_hpc.engines.launcher import launch_engine
    from relax_hpc.weights import WeightSender, engine_fingerprint, fingerprint

    h = launch_engine("cpu", model_dir, log_path=log_dir / "bench-engine.log",
                      extra_args=["--threads", str(torch.get_num_threads())],
                      ready_timeout=300)
    try:
        c = h.client(timeout=120)
        s = WeightSender(timeout=300, connect_timeout=120)
        s.connect([c], "127.0.0.1")
        cases = [("push bucketed 512 MiB", dict(mode="bucketed"), 512 * MiB),
                 ("push per-tensor broadcasts, 1 call", dict(mode="per_tensor"), 512 * MiB),
                 ("push 1 call + 1 broadcast per tensor", dict(mode="per_tensor"), 1)]
        times: dict[str, list[float]] = {}
        v = 0
        for rep in range(reps + 1):
            for name, kw, b in cases:
                s.bucket_bytes = b
                v += 1
                m = s.push(named, str(v), in_place=in_place, **kw)
                if rep > 0:
                    times.setdefault(name, []).append(m["perf/weight_sync_time"])
        assert engine_fingerprint(c, [n for n, _ in named][:5]) == fingerprint(named[:5])
        s.close()
        return times
    finally:
        h.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    p.add_argument("--source", choices=["actor", "file"], default="actor",
                   help="actor: the MegatronActor's export (views of its param buffer, sent in place where they lie "
                        "end to end); file: the checkpoint's tensors (all packed)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, help="MLP width (default: make-tiny-model's)")
    p.add_argument("--json", help="also write the timings to this file (for tools/bench/run)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--bucket-mib", type=float, nargs="+", default=[512, 16, 4])
    p.add_argument("--no-engine", action="store_true", help="skip the end-to-end push to a CPU engine")
    p.add_argument("--fresh-buffers", action="store_true",
                   help="allocate every pack/receive buffer anew (default: reuse them between syncs, as "
                        "WeightSender does on CPU and the CUDA caching allocator does on GPU)")
    p.add_argument("--no-append", action="store_true", help="print only; do not append to docs/benchmarks.md")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in both processes (default 1: on a small shared VM, OpenMP copies with "
                        "more threads than free cores are several times slower)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.receiver is not None:
        return receiver(a.receiver)

    when = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    where = machine(f"torch {torch.__version__} ({torch.get_num_threads()} thread/process)")
    tmp = Path(tempfile.mkdtemp(prefix="relax-bench-weights-"))
    try:
        return run(a, tmp, when, where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, tmp: Path, when: str, where: str) -> int:
    model_dir = make_model(a.hidden, a.layers, tmp / "model", heads=a.heads, intermediate=a.intermediate)
    in_place = None
    if a.source == "actor":
        if a.dtype != "float32":
            raise SystemExit("--source actor sends the actor's fp32 CPU parameters: use --dtype float32 or --source file")
        named, in_place, _actor = actor_weights(model_dir)
    else:
        from safetensors.torch import load_file

        named = [(n, t.to(getattr(torch, a.dtype))) for n, t in load_file(str(model_dir / "model.safetensors")).items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    placed = sum(b.nbytes for b in iter_buckets(named, 512 * MiB, in_place=in_place) if b.in_place)
    desc = (f"Llama hidden {a.hidden}, {a.layers} layers, {a.heads} heads, MLP {a.intermediate or 'default'}: {len(named)} tensors, {nbytes / 1e6:.1f} MB {a.dtype} "
            f"(median tensor {statistics.median(t.numel() * t.element_size() for _, t in named) / 1e3:.0f} kB), from "
            + ("the MegatronActor's export: " + f"{placed / nbytes:.0%} of the bytes are runs of its param buffer, sent in place"
               if a.source == "actor" else "the checkpoint file: every bucket packed"))
    print(f"{desc}\n{where}", flush=True)

    sizes = [max(1, int(b * MiB)) for b in a.bucket_mib]
    times = transport(named, a.reps, sizes, reuse=not a.fresh_buffers, in_place=in_place)
    ring = BufferRing(2)
    pack_t = []
    for rep in range(a.reps + 1):  # the sender's copy alone, for reading the table: bucketed ≈ raw + pack
        t0 = time.perf_counter()
        for _ in iter_buckets(named, max(sizes), ring=ring, in_place=in_place):
            pass
        if rep:
            pack_t.append(time.perf_counter() - t0)
    # ratios from the best run of each method: on a shared machine, noise only ever adds time
    raw = min(times["raw"])
    per = min(times["per_tensor"])
    rows = ["| method | broadcasts | median s | best s | GB/s (best) | vs raw (best) | speed-up vs per-tensor (best) |",
            "|---|---|---|---|---|---|---|"]
    for key, ts in times.items():
        if key == "snapshot":
            continue
        med = statistics.median(ts)
        if key == "raw":
            nb = 1
        elif key == "per_tensor":
            nb = len(named)
        elif key.endswith("packed ahead"):
            nb = len(take_snapshot(_Export(named), 0, bucket_bytes=max(sizes)).buckets)
        else:
            nb = len(list(iter_buckets(named, int(float(key.split()[1]) * MiB),
                                       in_place=None if key.endswith("all packed") else in_place)))
        best = min(ts)
        rows.append(f"| {key.replace('_', '-')} | {nb} | {med:.4f} | {best:.4f} | {nbytes / best / 1e9:.2f} | "
                    f"{raw / best * 100:.0f} % | {per / best:.1f}× |")
    snap_t = []
    for rep in range(a.reps + 1):  # train.overlap_sync's snapshot: the same copy, done before the push
        t0 = time.perf_counter()
        take_snapshot(_Export(named), 0, bucket_bytes=max(sizes))
        if rep:
            snap_t.append(time.perf_counter() - t0)
    times["snapshot"] = snap_t
    pk = statistics.median(pack_t)
    rows.append(f"| (pack only, {max(sizes) // MiB} MiB buckets, no broadcast) | 0 | {pk:.4f} | {min(pack_t):.4f} | "
                f"{nbytes / min(pack_t) / 1e9:.2f} | | |")
    rows.append(f"| (snapshot only: the packed-ahead copy, train.overlap_sync) | 0 | {statistics.median(snap_t):.4f} | "
                f"{min(snap_t):.4f} | {nbytes / min(snap_t) / 1e9:.2f} | | |")
    out = [f"### Weight sync transport, gloo, 2 processes ({when})", "", f"Model: {desc}. Machine: {where}.",
           f"{a.reps} runs per method (after 1 warm-up), interleaved, each from a start handshake to the receiver's "
           "acknowledgement; ratios compare best runs (vs raw = raw best / method best). Pack and receive buffers "
           + ("allocated anew every time." if a.fresh_buffers else "reused between syncs (raw: one ready buffer each side)."),
           "", *rows, ""]

    if not a.no_engine:
        e2e_reps = max(3, min(5, a.reps))
        e2e = end_to_end(model_dir, named, e2e_reps, tmp, in_place=in_place)
        first = min(next(iter(e2e.values())))
        out += [f"End to end, `WeightSender.push` to one CPU engine process (pause → continue, HTTP + gloo + the "
                f"engine loading the weights), {e2e_reps} runs each after 1 warm-up:", "",
                "| push | HTTP calls | broadcasts | median s | best s | vs bucketed (best) |", "|---|---|---|---|---|---|"]
        shape = {"push bucketed 512 MiB": (1, 1), "push per-tensor broadcasts, 1 call": (1, len(named)),
                 "push 1 call + 1 broadcast per tensor": (len(named), len(named))}
        for key, ts in e2e.items():
            med = statistics.median(ts)
            calls, nb = shape[key]
            out.append(f"| {key} | {calls} update + 6 control | {nb} | {med:.3f} | {min(ts):.3f} | {min(ts) / first:.1f}× |")
        out.append("")
    text = "\n".join(out)
    print("\n" + text)
    if a.json:
        Path(a.json).write_text(json.dumps({"times": times, "e2e": e2e if not a.no_engine else {}, "desc": desc,
                                            "tensors": len(named), "bytes": nbytes, "in_place_bytes": placed}))
    if not a.no_append:
        append(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
