#!/usr/bin/env python3
"""Sample-exchange benchmark (run by hand, not a test): the exchange vs raw file I/O, announce vs polling.

    tools/bench/exchange.py [--dir DIR ...] [--steps 4] [--chunks 1] [--samples 512] [--mean-len 4096] [--reps 5]
                            [--sweep 1 4 16] [--latency-n 200] [--poll-ms 10 100] [--no-append]

Samples look like Relax's rollout rows: ``tokens`` (int32, ragged), ``loss_masks`` (uint8, ragged over the
response), ``rollout_log_probs`` (float32, ragged over the response), ``raw_reward`` (float32), ``response_lengths``
(int32). Lengths are uniform in [mean/2, 3·mean/2], the response half of each. The columns are what the rollout
hands the exchange (``rollout/write.write_step``): ragged fields as one flat :class:`Ragged` (data + offsets).

1. **Throughput**, per directory (a filesystem): ``--steps`` steps of ``--chunks`` chunks of ``--samples`` samples
   (one chunk per step is what a run writes: ``write_step`` writes a rollout step as one chunk)
   * ``exchange``: per step, ``write_chunk`` for each chunk, then in one journal group ``Broker.announce`` of them
     all, ``end_step`` and one ``Broker.request`` for the step, as the controller handles a generate's report and
     leases the step to train (produce); then ``read_chunk`` (checksum verified) of every chunk and one ``ack``
     in a journal group of its own, as the train report's (consume; the ack completes the step, which is
     cleared: its files are renamed away and deleted by a background thread); a fresh broker and journal per rep;
   * ``raw``: the same column buffers (ragged data and offsets included), one file per chunk: ``writev`` +
     ``fsync``, one directory fsync per step (produce), then ``read`` (consume).
   Samples/s and MB/s of payload (the columns' bytes) end to end (write + read), from the medians of ``--reps``
   and from the fastest rep (on a shared machine the best rep is the better estimate of what the code costs).
   Both read back from the page cache.
2. **Chunk size** (``--sweep``): the same step data split into 1, 4, 16 … chunks, exchange vs raw each: what a
   chunk costs beyond its bytes (an HDF5 file's metadata, a journal record, a link), so what chunk size to write.
3. **Latency** from "chunk durable on disk" (``write_chunk`` returned) to "a consumer holds it": a consumer
   blocked in ``Broker.request(timeout=...)`` woken by ``announce`` (in-process: the socket hop the controller
   will add is not in it), vs a consumer polling the partition directory with ``os.scandir`` every
   ``--poll-ms``. p50/p99 over ``--latency-n`` small chunks.

Prints markdown tables and appends them, with machine and date, to docs/benchmarks.md (never rewrites it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from common import append, machine  # noqa: E402  (tools/bench/common.py: this script's directory is on sys.path)
from relax_hpc.exchange import Broker, Ragged, read_chunk, write_chunk  # noqa: E402
from relax_hpc.exchange.chunk import CHECKSUM_ALGO, parse_chunk_file, partition_dir  # noqa: E402


def make_chunks(n_chunks: int, samples: int, mean_len: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    chunks = []
    for _ in range(n_chunks):
        lens = rng.integers(mean_len // 2, mean_len * 3 // 2 + 1, size=samples)
        resp = lens // 2
        chunks.append({
            "tokens": Ragged.from_list([rng.integers(0, 151_000, size=int(k), dtype=np.int32) for k in lens]),
            "loss_masks": Ragged.from_list([np.ones(int(r), dtype=np.uint8) for r in resp]),
            "rollout_log_probs": Ragged.from_list([rng.standard_normal(int(r), dtype=np.float32) for r in resp]),
            "raw_reward": rng.random(samples, dtype=np.float32),
            "response_lengths": resp.astype(np.int32),
        })
    return chunks


def split(chunks: list[dict], parts: int) -> list[dict]:
    """The same samples as ``parts`` chunks per chunk (for the chunk-size sweep)."""
    out = []
    for c in chunks:
        n = len(c["raw_reward"])
        for lo, hi in zip(range(0, n, -(-n // parts)), range(-(-n // parts), n + -(-n // parts), -(-n // parts))):
            hi = min(hi, n)
            out.append({k: Ragged.from_list(v.to_list()[lo:hi]) if isinstance(v, Ragged) else v[lo:hi] for k, v in c.items()})
    return out


def payload(c: dict) -> list[np.ndarray]:
    out = []
    for v in c.values():
        out += [v.data, v.offsets] if isinstance(v, Ragged) else [v]
    return out


def nbytes(c: dict) -> int:
    return sum(a.nbytes for a in payload(c))


def n_samples(c: dict) -> int:
    return len(c["raw_reward"])


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------- throughput ---

def run_exchange(root: Path, steps: list[list[dict]]) -> tuple[float, float, float]:
    """What a run does with each step's chunks: rollout writes them; the controller handles the generate report in
    one journal group (one fdatasync): it announces them, ends the step and leases the whole step to train;
    train reads every chunk (checksum verified) and its report acks (``TrainingLoop``: ``_generate_done``,
    ``_train``, ``_train_done``)."""
    b = Broker(root, tasks={"train": list(steps[0][0])}, max_staleness=1)
    w = r = cpu = 0.0
    for step, chunks in enumerate(steps):
        b.start_step(step)
        c0 = time.process_time()
        t0 = time.perf_counter()
        refs = [write_chunk(root, step, "rollout", seq, c) for seq, c in enumerate(chunks)]
        with b.group():  # the generate report: announces, the step's end, the train lease (TrainingLoop._train)
            for ref in refs:
                b.announce(ref)
            b.end_step(step)
            lease = b.request("train", step=step, batch_size=1 << 30)  # the whole step, as TrainingLoop._lease asks
        t1 = time.perf_counter()
        got = 0
        for ref in lease.chunks:
            data = read_chunk(ref, lease.fields, ragged="flat")
            got += ref.n
            assert len(data["tokens"]) == ref.n
        with b.group():  # the train report: the ack, and the step's clear that it completes
            b.ack(lease.id)
        t2 = time.perf_counter()
        cpu += time.process_time() - c0
        w, r = w + t1 - t0, r + t2 - t1
        assert got == sum(n_samples(c) for c in chunks)
    b.close()
    return w, r, cpu


def run_raw(root: Path, steps: list[list[dict]]) -> tuple[float, float, float]:
    w = r = cpu = 0.0
    for step, chunks in enumerate(steps):
        d = root / f"raw_{step}"
        d.mkdir()
        c0 = time.process_time()
        t0 = time.perf_counter()
        for i, c in enumerate(chunks):
            fd = os.open(d / f"c{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            bufs, left = [memoryview(a).cast("B") for a in payload(c)], nbytes(c)
            while left:  # writev may write less than asked
                k = os.writev(fd, bufs)
                left -= k
                while bufs and k >= len(bufs[0]):
                    k -= len(bufs.pop(0))
                if k:
                    bufs[0] = bufs[0][k:]
            os.fsync(fd)
            os.close(fd)
        fsync_dir(d)
        t1 = time.perf_counter()
        total = 0
        for i in range(len(chunks)):
            with open(d / f"c{i}", "rb") as f:
                total += len(f.read())
        t2 = time.perf_counter()
        cpu += time.process_time() - c0
        w, r = w + t1 - t0, r + t2 - t1
        assert total == sum(nbytes(c) for c in chunks)
    return w, r, cpu


def throughput(base: Path, steps: list[list[dict]], reps: int) -> list[dict]:
    chunks = [c for s in steps for c in s]
    samples = sum(n_samples(c) for c in chunks)
    mb = sum(nbytes(c) for c in chunks) / 1e6
    times = {"exchange": [], "raw": []}
    for _ in range(reps):
        for name, fn in (("exchange", run_exchange), ("raw", run_raw)):  # interleaved: the machine may be shared
            root = Path(tempfile.mkdtemp(prefix="relax-bench-xchg-", dir=base))
            try:
                times[name].append(fn(root, steps))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    rows = []
    for name, ts in times.items():
        w = statistics.median(t[0] for t in ts)
        r = statistics.median(t[1] for t in ts)
        best = min(t[0] + t[1] for t in ts)
        cpu = statistics.median(t[2] for t in ts)
        rows.append({"name": name, "write_s": w, "read_s": r, "total_s": w + r, "best_s": best,
                     "cpu_ms_chunk": cpu / len(chunks) * 1e3,
                     "sps": samples / (w + r), "mbs": mb / (w + r), "best_sps": samples / best, "best_mbs": mb / best})
    raw = rows[1]
    for row in rows:
        row["vs_raw"] = raw["total_s"] / row["total_s"]
        row["best_vs_raw"] = raw["best_s"] / row["best_s"]
    return rows


def sweep(base: Path, steps: list[list[dict]], parts: list[int], reps: int) -> list[tuple[int, int, dict, dict]]:
    """(chunks per step, samples per chunk, exchange row, raw row) with each step's data split ``parts`` ways."""
    out = []
    for k in parts:
        split_steps = [split(s, k) for s in steps]
        ex, raw = throughput(base, split_steps, reps)
        out.append((len(split_steps[0]), n_samples(split_steps[0][0]), ex, raw))
    return out


# ---------------------------------------------------------------------------------------------- latency ---

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def latency_broker(base: Path, n: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="relax-bench-xchg-", dir=base))
    b = Broker(root, tasks={"train": ["tokens"]}, max_staleness=1)
    b.start_step(0)
    durable: dict[int, float] = {}
    seen: list[float] = []
    announce_s: list[float] = []
    go = threading.Event()

    def consumer():
        go.set()
        while len(seen) < n:
            lease = b.request("train", batch_size=1, timeout=5)
            t = time.perf_counter()
            if lease is None:
                continue
            for ref in lease.chunks:
                seen.append(t - durable[int(ref.name.rsplit("_", 1)[1])])
            b.ack(lease.id)

    th = threading.Thread(target=consumer)
    th.start()
    go.wait()
    for seq in range(n):
        ref = write_chunk(root, 0, "rollout", seq, {"tokens": [np.arange(16, dtype=np.int32)]})
        durable[seq] = time.perf_counter()
        b.announce(ref)
        announce_s.append(time.perf_counter() - durable[seq])
        time.sleep(0.003)
    th.join(60)
    b.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"p50": pct(seen, 50), "p99": pct(seen, 99), "announce_p50": pct(announce_s, 50)}


def latency_poll(base: Path, n: int, poll_s: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix="relax-bench-xchg-", dir=base))
    partition_dir(root, 0).mkdir()
    durable: dict[int, float] = {}
    seen: list[float] = []
    stop = threading.Event()

    def poller():
        known: set[str] = set()
        while not stop.is_set():
            t = time.perf_counter()
            for e in os.scandir(partition_dir(root, 0)):
                p = parse_chunk_file(e.name)
                if p and e.name not in known and p[1] in durable:
                    known.add(e.name)
                    seen.append(t - durable[p[1]])
            time.sleep(poll_s)

    th = threading.Thread(target=poller)
    th.start()
    for seq in range(n):
        write_chunk(root, 0, "rollout", seq, {"tokens": [np.arange(16, dtype=np.int32)]})
        durable[seq] = time.perf_counter()
        time.sleep(0.003)
    time.sleep(2 * poll_s + 0.05)
    stop.set()
    th.join(10)
    shutil.rmtree(root, ignore_errors=True)
    # a scan that began just before the rename cannot see it; its time stamp precedes "durable": clip at 0
    seen = [max(0.0, s) for s in seen]
    return {"p50": pct(seen, 50), "p99": pct(seen, 99), "seen": len(seen)}


# ------------------------------------------------------------------------------------------------- main ---

def fs_of(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-PT", str(path)], capture_output=True, text=True, timeout=10).stdout.splitlines()
        fields = out[1].split()
        return f"{fields[1]} ({fields[6]})"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown fs"


def fsync_ms(base: Path) -> float:
    fd, name = tempfile.mkstemp(dir=base)
    try:
        ts = []
        for _ in range(20):
            os.write(fd, b"x" * 100)
            t = time.perf_counter()
            os.fdatasync(fd)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3
    finally:
        os.close(fd)
        os.unlink(name)


def sweep_table(rows: list[tuple[int, int, dict, dict]]) -> str:
    lines = ["| chunks per step | samples per chunk | exchange s | raw s | exchange vs raw | exchange CPU ms/chunk |",
             "|---|---|---|---|---|---|"]
    for k, n, ex, raw in rows:
        lines.append(f"| {k} | {n} | {ex['total_s']:.3f} | {raw['total_s']:.3f} | {ex['vs_raw']:.0%} | {ex['cpu_ms_chunk']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", action="append", help="a directory on the filesystem to test (repeatable; default: the temp dir)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--chunks", type=int, default=1, help="chunks per step (a run writes one)")
    p.add_argument("--samples", type=int, default=512, help="samples per chunk")
    p.add_argument("--sweep", type=int, nargs="*", default=[1, 4, 16],
                   help="chunk-size table: each step's data split into this many chunks (none: no table)")
    p.add_argument("--mean-len", type=int, default=4096, help="mean tokens per sample")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--latency-n", type=int, default=200)
    p.add_argument("--poll-ms", type=float, nargs="+", default=[10.0, 100.0])
    p.add_argument("--no-append", action="store_true", help="print only; do not append to docs/benchmarks.md")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    a = p.parse_args(argv)

    when = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    import h5py

    where = machine(f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version})", f"numpy {np.__version__}")
    chunks = make_chunks(a.steps * a.chunks, a.samples, a.mean_len)
    steps = [chunks[i * a.chunks:(i + 1) * a.chunks] for i in range(a.steps)]
    per_chunk_mb = nbytes(chunks[0]) / 1e6
    lines = [f"\n### Sample exchange: chunks vs raw files, announce vs polling ({when})\n",
             f"Machine: {where}.",
             f"Throughput: {a.steps} steps × {a.chunks} chunk(s) × {a.samples} samples, mean {a.mean_len} tokens "
             f"(tokens int32, loss_masks uint8 and rollout_log_probs float32 over the response half, raw_reward, "
             f"response_lengths): {per_chunk_mb:.2f} MB of arrays per chunk; exchange and raw interleaved, "
             f"{a.reps} reps: write s, read s, samples/s, MB/s from the medians, best = the fastest rep end to end; CPU ms/chunk = this process's CPU time (write + read, median) per chunk, which contention for the CPU does not inflate. exchange = write_chunk ({CHECKSUM_ALGO}, tmp + fsync + link + dir fsync) + the step's announces, end and train lease "
             f"(one journal group, one fdatasync), then read_chunk (checksum verified) + ack; raw = the same "
             f"column buffers, one file per chunk, writev + fsync, one dir fsync per step, then read. Reads come from the page cache in both. "
             f"vs raw = raw time / exchange time.\n"]
    for d in a.dir or [tempfile.gettempdir()]:
        base = Path(d)
        base.mkdir(parents=True, exist_ok=True)
        fs = fs_of(base)
        sync = fsync_ms(base)
        rows = throughput(base, steps, a.reps)
        lines.append(f"**{base}** — {fs}, fdatasync of a small append {sync:.2f} ms (median)\n")
        lines.append("| path | write s | read s | samples/s | MB/s | vs raw | best samples/s | best MB/s | best vs raw | CPU ms/chunk |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            lines.append(f"| {r['name']} | {r['write_s']:.3f} | {r['read_s']:.3f} | {r['sps']:,.0f} | {r['mbs']:,.0f} | "
                         f"{r['vs_raw']:.0%} | {r['best_sps']:,.0f} | {r['best_mbs']:,.0f} | {r['best_vs_raw']:.0%} | "
                         f"{r['cpu_ms_chunk']:.1f} |")
        if a.sweep:
            lines.append("")
            lines.append(f"Chunk size: each step's {a.chunks * a.samples} samples as k chunks, {a.reps} interleaved reps, medians:\n")
            lines.append(sweep_table(sweep(base, steps, a.sweep, a.reps)))
        lat = latency_broker(base, a.latency_n)
        lines.append("")
        lines.append(f"Latency, chunk durable → a consumer holds it, {a.latency_n} one-sample chunks:\n")
        lines.append("| consumer | p50 ms | p99 ms |")
        lines.append("|---|---|---|")
        lines.append(f"| broker: blocked in request(), woken by announce (announce itself: p50 {lat['announce_p50'] * 1e3:.2f} ms) "
                     f"| {lat['p50'] * 1e3:.2f} | {lat['p99'] * 1e3:.2f} |")
        for poll in a.poll_ms:
            pl = latency_poll(base, a.latency_n, poll / 1e3)
            lines.append(f"| polling the directory every {poll:g} ms | {pl['p50'] * 1e3:.2f} | {pl['p99'] * 1e3:.2f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if not a.no_append:
        append(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
