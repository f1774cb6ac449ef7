#!/usr/bin/env python3
"""Scaling on paper, checked by simulation (run by hand, not a test; docs/scaling.md has the model).

    tools/bench/scaling.py [--n 1 4 16] [--steps 3] [--samples 4] [--prompt-len 16] [--response-len 32]
                           [--engines 1 4 16] [--buckets 8] [--dir DIR] [--no-write]

Three checks of the formulas in docs/scaling.md, each with the real code:

1. **Exchange.** For each N in ``--n``: a real :class:`~relax_hpc.exchange.broker.Broker` in a temporary
   directory with the run's three consuming tasks (``train``, ``reference``, ``actor_fwd``, their fields from
   :mod:`relax_hpc.exchange.fields`, as :mod:`relax_hpc.controller.training` builds them). Per step: N producers
   (threads) each write one chunk with every rollout field (``write_chunk``) and announce it; the step is
   ended; N consumers per forward task lease one chunk at a time, read it (checksum verified), write their
   side file (``write_fields``), ``add_fields`` and ack; then N train consumers lease, read every train
   field (main file and both side files) and ack. The last ack clears the step. Counted by wrapping the
   system calls: journal records (lines), fdatasyncs, fsyncs, files created (links to a final name: HDF5 itself
   creates each hidden tmp file, so opens are not counted), bytes
   written; and the wall time of the step. Predicted = the formulas with C = N chunks and N leases per task.
   N = 1 is what a run does today: one chunk per step, one lease per task.
2. **Controller heartbeats and engine polls.** ``RunState.apply`` (what the single-threaded loop does with every
   heartbeat) on a state built from the 64-node recipe of docs/scaling.md (actor 256 ranks, the rollout driver 1,
   reference 16, actor_fwd 16), and ``protocol.decode`` + ``validate`` of one heartbeat line (a connection
   thread's part). Then the run's E = 112 engines, each a step with an engine host that long-polls
   ``next_task`` every ``roles/engine.POLL_S``: what the loop does with one poll (``RunState.apply``, then a
   real ``Elastic.on_message``).
3. **Weight-sync HTTP fan-out.** ``WeightSender.push`` (the real one) over a 1-rank gloo group to E stub
   engines (``--engines``) that answer at once (one HTTP server process with the CPU engine's handler), with
   small tensors cut into ``--buckets`` buckets; then ``EngineChecker.unreachable`` and ``.check`` (the spot
   check). The stub counts every call: predicted E·(6 + B) for the push and E + 4·E for the checks. The
   time is actor rank 0's own cost of talking to E engines, without the bytes (no engine receives anything).

Prints markdown tables; unless --no-write, rewrites the "Checked by simulation" section of docs/scaling.md
(between its markers) with them. Keep it short: on 2 cores the defaults take well under a minute.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

T0 = time.monotonic()  # the whole run, imports included (torch's take seconds)
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))  # tools/bench/common.py and exchange.py, as modes.py and run do
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from common import machine  # noqa: E402
from exchange import fs_of, fsync_ms  # noqa: E402
from relax_hpc.exchange import journal as journal_mod  # noqa: E402
from relax_hpc.exchange.broker import Broker  # noqa: E402
from relax_hpc.exchange.chunk import HEADER_SIZE, read_chunk, write_chunk, write_fields  # noqa: E402
from relax_hpc.exchange.fields import (ACTOR_FWD, BY_NAME, LOGPROB_FIELDS, PRODUCER,  # noqa: E402
                                       REFERENCE, SIDE_FIELD, rollout_fields, task_fields)

DOC = REPO / "docs" / "scaling.md"
BEGIN, END = "<!-- scaling.py: begin -->", "<!-- scaling.py: end -->"

# docs/scaling.md, "Exchange": HDF5's own bytes per file (object headers, B-trees) besides our 512-byte header and
# the arrays; measured with h5py 3.16 / HDF5 2.0 (libver v110), 13 rollout fields in a main file, 1 in a side file
H_MAIN, H_SIDE = 14_500, 6_100
# docs/scaling.md: bytes of one journal record of each kind (JSON line; chunk ids like step_12/chunk_rollout_0,
# CRC-32 checksums, field lists); a lease or ack of k chunks adds about 22 bytes per chunk after the first
REC = {"start": 85, "end": 45, "cleared": 80, "produced": 330, "fields_added": 200, "leased_fwd": 150,
       "leased_train": 230, "consumed": 100}
FWD = (REFERENCE, ACTOR_FWD)  # the forward roles, both enabled (use_kl_loss and roles.actor_fwd.enabled)
TEXT_BYTES = 4  # bytes of prompt/response text per token (β in docs/scaling.md)


# ----------------------------------------------------------------------------------------------- counting ---

class Calls:
    """System calls made by this process while installed: fsync, fdatasync, links, mkdirs, bytes through
    os.write. Thread-safe."""

    def __init__(self) -> None:
        self.c: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.c[key] += n

    def snap(self) -> Counter:
        with self._lock:
            return Counter(self.c)


@contextmanager
def counting(calls: Calls):
    real = {"fsync": os.fsync, "link": os.link, "mkdir": os.mkdir, "write": os.write}
    real_datasync = journal_mod._datasync  # bound at import in journal.py: patch it there

    def fsync(fd):
        calls.add("fsync")
        return real["fsync"](fd)

    def datasync(fd):
        calls.add("fdatasync")
        return real_datasync(fd)

    def link(src, dst, *a, **kw):
        calls.add("link")
        return real["link"](src, dst, *a, **kw)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        calls.add("mkdir")
        return real["mkdir"](path, mode, dir_fd=dir_fd)

    def write(fd, data):
        k = real["write"](fd, data)
        calls.add("bytes", k)
        return k

    os.fsync, os.link, os.mkdir, os.write = fsync, link, mkdir, write
    journal_mod._datasync = datasync
    try:
        yield calls
    finally:
        os.fsync, os.link, os.mkdir, os.write = real["fsync"], real["link"], real["mkdir"], real["write"]
        journal_mod._datasync = real_datasync


# ----------------------------------------------------------------------------------------------- exchange ---

def columns(n: int, lp: int, lr: int, rng: np.random.Generator) -> dict:
    """One chunk's rollout fields (every one the schema has, its dtype), ``n`` samples of ``lp`` prompt and ``lr``
    response tokens, TEXT_BYTES of text per token."""
    out = {}
    for name in rollout_fields():
        f = BY_NAME[name]
        if name == "tokens":
            v = [rng.integers(0, 150_000, lp + lr, dtype=np.int64) for _ in range(n)]
        elif name in ("loss_mask", "rollout_log_probs"):
            v = [np.ones(lr, np.float32) if name == "loss_mask" else rng.standard_normal(lr, dtype=np.float32)
                 for _ in range(n)]
        elif f.kind == "fixed":
            v = np.full(n, lr, dtype=f.dtype) if name == "response_length" else np.arange(n).astype(f.dtype)
        else:
            v = {"prompt": ["p" * (TEXT_BYTES * lp)] * n, "response": ["r" * (TEXT_BYTES * lr)] * n,
                 "status": ["completed"] * n, "weight_version": ["3"] * n, "label": ["7"] * n}[name]
        out[name] = v
    return out


def payload(cols: dict) -> int:
    """The bytes of the arrays a chunk file holds (ragged/json: data + n+1 int64 offsets)."""
    total = 0
    for v in cols.values():
        if isinstance(v, np.ndarray):
            total += v.nbytes
        elif isinstance(v[0], np.ndarray):
            total += sum(a.nbytes for a in v) + 8 * (len(v) + 1)
        else:
            total += sum(len(json.dumps(x, separators=(",", ":"))) for x in v) + 8 * (len(v) + 1)
    return total


def predict_exchange(c: int, leases: int, main_payload: int, side_payload: int, f: int = len(FWD)) -> dict:
    """docs/scaling.md's per-step formulas: C chunks, F forward roles, ``leases`` per task (T = 1 + F tasks)."""
    t = 1 + f
    records = 3 + c * (1 + f) + 2 * t * leases
    files = c * (1 + f)
    return {"records": records, "fdatasync": records, "fsync": 2 * files + 1, "created": files, "dirs": 1,
            "data_bytes": c * (HEADER_SIZE + H_MAIN + main_payload) + f * c * (HEADER_SIZE + H_SIDE + side_payload),
            "journal_bytes": (REC["start"] + REC["end"] + REC["cleared"] + c * REC["produced"]
                              + f * c * REC["fields_added"] + f * leases * (REC["leased_fwd"] + REC["consumed"])
                              + leases * (REC["leased_train"] + REC["consumed"]))}


def sim_exchange(base: Path, n: int, steps: int, samples: int, lp: int, lr: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="relax-bench-scaling-", dir=base))
    tasks = {"train": task_fields("train", (PRODUCER, *FWD)), **{r: LOGPROB_FIELDS for r in FWD}}
    train_fields = tasks["train"]
    rng = np.random.default_rng(n)
    chunk_cols = [columns(samples, lp, lr, rng) for _ in range(n)]
    side_arrays = [np.zeros(lr, np.float32)] * samples
    calls = Calls()
    per_step: list[dict] = []
    pool = cf.ThreadPoolExecutor(max_workers=2 * n)
    try:
        with counting(calls), Broker(root, tasks=tasks, max_staleness=0) as b:
            jpath = b.journal_path
            for step in range(1, steps + 1):
                c0, j0 = calls.snap(), jpath.stat().st_size
                lines0 = jpath.read_bytes().count(b"\n")
                leases: Counter = Counter()
                t0 = time.perf_counter()
                assert b.start_step(step)

                def produce(i: int) -> int:
                    ref = write_chunk(root, step, f"p{i}", step, chunk_cols[i])
                    b.announce(ref)
                    return ref.size

                main_bytes = sum(pool.map(produce, range(n)))
                b.end_step(step)

                def forward(role: str, i: int) -> int:
                    done = 0
                    while (lease := b.request(role, batch_size=samples, step=step, holder=f"{role}{i}")) is not None:
                        for ref in lease.chunks:
                            read_chunk(ref, LOGPROB_FIELDS, ragged="flat")
                            side = write_fields(ref, role, {SIDE_FIELD[role]: side_arrays})
                            b.add_fields(side)
                            done += side.size
                        b.ack(lease.id)
                        leases[role] += 1
                    return done

                side_bytes = sum(pool.map(lambda a: forward(*a), [(r, i) for r in FWD for i in range(n)]))

                def train(i: int) -> int:
                    got = 0
                    while (lease := b.request("train", batch_size=samples, step=step, holder=f"actor{i}")) is not None:
                        for ref in lease.chunks:
                            got += len(read_chunk(ref, train_fields, ragged="flat")["raw_reward"])
                        b.ack(lease.id)  # the last one clears the step (auto_clear)
                        leases["train"] += 1
                    return got

                got = sum(pool.map(train, range(n)))
                dt_s = time.perf_counter() - t0
                assert got == n * samples and b.complete(step) and step not in b.uncleared()
                c1 = calls.snap()
                d = {k: c1[k] - c0[k] for k in ("fsync", "fdatasync", "link", "mkdir", "bytes")}
                d["created"] = d["link"]  # each file is made under a tmp name (by HDF5) and linked once
                d.update(records=jpath.read_bytes().count(b"\n") - lines0, journal_bytes=jpath.stat().st_size - j0,
                         data_bytes=main_bytes + side_bytes, time_s=dt_s, leases=dict(leases))
                per_step.append(d)
    finally:
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    # every step must count the same; the time is the median
    first = per_step[0]
    for d in per_step[1:]:
        for k in ("fsync", "fdatasync", "created", "records", "leases"):
            if d[k] != first[k]:
                raise AssertionError(f"N={n}: steps differ in {k}: {first[k]} vs {d[k]}")
    out = dict(first)
    out["time_s"] = statistics.median(d["time_s"] for d in per_step)
    out["journal_bytes"] = statistics.median(d["journal_bytes"] for d in per_step)
    out["payload_main"] = payload(chunk_cols[0])
    out["payload_side"] = samples * (4 * lr + 8) + 8
    return out


# --------------------------------------------------------------------------------------------- controller ---

SPLIT = ["roles.actor.nodes=32", "roles.actor.tasks_per_node=8", "roles.rollout.nodes=28",
         "roles.rollout.tasks_per_node=4", "roles.reference.nodes=2", "roles.reference.tasks_per_node=8",
         "roles.actor_fwd.nodes=2", "roles.actor_fwd.tasks_per_node=8", "roles.actor_fwd.share_with=null",
         "rollout.rollout_batch_size=512", "rollout.n_samples_per_prompt=8"]


def sim_controller(base: Path, reps: int = 5) -> dict:
    from relax_hpc.backends import LocalBackend
    from relax_hpc.controller import protocol as P
    from relax_hpc.controller.state import RunState
    from relax_hpc.recipe import load_recipe, role_steps
    from relax_hpc.rundir import create_run_dir

    recipe = load_recipe(REPO / "recipes" / "smoke.yaml", SPLIT)
    steps = role_steps(recipe)
    tmp = Path(tempfile.mkdtemp(prefix="relax-bench-scaling-", dir=base))
    try:
        run = create_run_dir(tmp, "scaling")
        st = RunState(run, recipe, steps, LocalBackend(), env={})
        now = time.time()
        for role in st.ranks:
            st.step_started(role, now)
        roles = {}
        for role, ranks in st.ranks.items():
            msgs = [{"type": "heartbeat", "role": role, "rank": i, "node": f"{role}{i // 8}", "phase": "ready",
                     "info": {"collective_ok": True, "task": None}} for i in range(len(ranks))]
            for m in msgs:  # warm up: every rank known
                st.apply(now, m)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for m in msgs:
                    st.apply(time.time(), m)
                ts.append((time.perf_counter() - t0) / len(msgs))
            roles[role] = {"ranks": len(ranks), "us": min(ts) * 1e6}
        t0 = time.perf_counter()
        st.write()
        write_ms = (time.perf_counter() - t0) * 1e3
        state_bytes = run.state.stat().st_size
        token = "t" * 64
        line = P.encode({"type": "heartbeat", "token": token, "role": "actor", "rank": 3, "node": "actor0",
                         "phase": "ready", "info": {"collective_ok": True,
                                                    "task": {"id": 3, "kind": "train", "progress": 12, "step": 4}}})
        k = 2000
        t0 = time.perf_counter()
        for _ in range(k):
            m = P.decode(line)
            P.token_ok(m["token"], token)
            P.validate(m)
        parse_us = (time.perf_counter() - t0) / k * 1e6
        return {"roles": roles, "heartbeat_s": recipe.logging.heartbeat_s, "state_write_ms": write_ms,
                "state_bytes": state_bytes, "parse_us": parse_us, "max_connections": P.MAX_CONNECTIONS,
                "engines": sim_engine_polls(recipe, run, st, token, reps)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sim_engine_polls(recipe, run, st, token: str, reps: int) -> dict:
    """The loop's part of one engine host's ``next_task`` long poll: ``RunState.apply`` (not a rank: it returns
    at once) and ``Elastic.on_message`` (the engine's sign of life), on a registry of the run's E engines."""
    from relax_hpc.backends import LocalBackend
    from relax_hpc.controller.channel import Channel
    from relax_hpc.controller.elastic import Elastic
    from relax_hpc.controller.engines import EngineRegistry
    from relax_hpc.recipe import initial_engines
    from relax_hpc.roles.engine import POLL_S

    names = initial_engines(recipe)
    reg = EngineRegistry()
    for i, name in enumerate(names):
        reg.add(name, f"http://10.0.{i // 250}.{i % 250}:30000", origin="initial", state="ready", weight_version="3")
    ch = Channel(token, bind_host="127.0.0.1")
    try:
        el = Elastic(recipe, run, reg, st, ch, LocalBackend(), holds=lambda n: False, on_change=lambda: None,
                     assign=ch.assign)
        msgs = [{"type": "next_task", "role": f"engine:{n}", "rank": 0, "wait_s": POLL_S} for n in names]
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for m in msgs:
                now = time.time()
                st.apply(now, m)
                el.on_message(m)
            ts.append((time.perf_counter() - t0) / len(msgs))
    finally:
        ch.close()
    return {"engines": len(names), "poll_s": POLL_S, "us": min(ts) * 1e6}


# ------------------------------------------------------------------------------------------- weight sync ---

STUB = r"""
import collections, sys, threading
from relax_hpc.engines.http import EngineServer as _Server, ok, route_handler
counts, lock = collections.Counter(), threading.Lock()
def counted(path, fn):
    def call(body):
        with lock:
            counts[path] += 1
        return fn(body)
    return call
success = lambda b: ok({"success": True, "message": ""})
routes = {p: counted(p, success) for p in ("/begin_weight_update", "/end_weight_update",
                                           "/update_weights_from_distributed", "/update_weight_version")}
routes.update({
    "/pause_generation": counted("/pause_generation", lambda b: ok({"message": "paused", "status": "ok"})),
    "/continue_generation": counted("/continue_generation", lambda b: ok({"message": "continued", "status": "ok"})),
    "/flush_cache": counted("/flush_cache", lambda b: (200, "Cache flushed.")),
    "/health": counted("/health", lambda b: (200, None)),
    "/get_weights_by_name": counted("/get_weights_by_name", lambda b: ok([0.0] * int(b.get("truncate_size", 1)))),
    "/model_info": counted("/model_info", lambda b: ok({"weight_version": "1"})),
    "/_counts": lambda b: ok(dict(counts)),
})
stock = route_handler(routes, None)  # the CPU engine's and actor_fwd's Follower's handler, as it is
nodelay = type("NoDelay", (stock,), {"disable_nagle_algorithm": True})  # TCP_NODELAY, as SGLang's uvicorn sets it
servers = [_Server(("127.0.0.1", 0), h) for h in (nodelay, stock)]
for s in servers[1:]:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print(*(s.server_address[1] for s in servers), flush=True)
servers[0].serve_forever()
"""


def sim_weights(engines: list[int], buckets: int, reps: int = 3) -> list[dict]:
    """Rows for E in ``engines`` against SGLang-like stubs (TCP_NODELAY), then one row, E = 1, against the stock
    handler of the CPU engine and the Follower (see docs/scaling.md, "Weight sync": it once cost 40 ms a call; now a regression check)."""
    import torch
    import torch.distributed as dist

    from relax_hpc.engines.client import EngineClient
    from relax_hpc.weights import WeightSender
    from relax_hpc.weights.check import ROWS, EngineChecker

    proc = subprocess.Popen([sys.executable, "-c", STUB], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        urls = [f"http://127.0.0.1:{port}" for port in proc.stdout.readline().split()]
        admin = EngineClient(urls[0])
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        per_bucket, tensor_numel = 4, 4096  # bf16: 8 KiB a tensor, 32 KiB a bucket
        named = [(f"layer{i}.weight", torch.full((tensor_numel,), float(i), dtype=torch.bfloat16))
                 for i in range(per_bucket * buckets)]
        heads = {name: t[:ROWS].clone() for name, t in named}
        rows = []
        for e, url, handler in [*((e, urls[0], "nodelay") for e in engines), (1, urls[1], "stock")]:
            sender = WeightSender(backend="gloo", device="cpu", bucket_bytes=per_bucket * tensor_numel * 2)
            sender.engines = [EngineClient(url) for _ in range(e)]  # one client per engine, as connect() makes them
            sender.sessions = {url: True}
            sender.tp_sizes = [1] * e
            sender.pg, sender.group_name = dist.group.WORLD, "scaling-sim"
            checker = EngineChecker()
            names = {f"engine{i}": url for i in range(e)}
            sender.push(iter(named), version="0")  # warm-up: connections open
            checker.check(names, heads, "0")
            before = EngineClient(url).request("GET", "/_counts").json()
            push_s, push_cpu, check_s, got_buckets = [], [], [], 0
            for r in range(reps if handler == "nodelay" else 1):
                t0, c0 = time.perf_counter(), time.process_time()
                m = sender.push(iter(named), version=str(r + 1))
                push_s.append(time.perf_counter() - t0)
                push_cpu.append(time.process_time() - c0)  # this process's CPU: what rank 0 itself spends
                got_buckets = int(m["perf/weight_sync_buckets"])
                t0 = time.perf_counter()
                dead = checker.unreachable(names)
                checks = checker.check(names, heads, str(r + 1))
                check_s.append(time.perf_counter() - t0)
                assert not dead and len(checks) == e
            done = len(push_s)
            after = EngineClient(url).request("GET", "/_counts").json()
            counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            check_kinds = ("/health", "/get_weights_by_name", "/model_info")
            push_calls = sum(v for k, v in counted.items() if k not in check_kinds) // done
            check_calls = sum(counted.get(k, 0) for k in check_kinds) // done
            rows.append({"engines": e, "handler": handler, "buckets": got_buckets, "push_calls": push_calls,
                         "check_calls": check_calls, "pred_push": e * (6 + got_buckets), "pred_check": e + 4 * e,
                         "push_s": statistics.median(push_s), "push_cpu_s": statistics.median(push_cpu),
                         "check_s": statistics.median(check_s)})
            checker.close()
            for c in sender.engines:
                c.close()
        admin.close()
        return rows
    finally:
        proc.terminate()
        proc.wait(10)


# ------------------------------------------------------------------------------------------------- report ---

def exchange_table(rows: list[dict], base: Path, sync_ms: float, file_ms: float) -> list[str]:
    out = [
        f"**Exchange**, per rollout step (C = N chunks of {rows[0]['samples']} samples, one per producer; N consumers "
        f"per task, each lease one chunk, so N leases per task; F = 2 forward roles, T = 3 tasks), on {base} "
        f"({fs_of(base)}; small fdatasync {sync_ms:.2f} ms, fsync of a new 16 KB file {file_ms:.2f} ms, medians). "
        "Predicted / measured:",
        "",
        "| N | journal records | fdatasync | fsync | files created | data bytes | journal bytes | time per step | "
        "fsync floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["pred"]
        floor = r["fdatasync"] * sync_ms + r["fsync"] * file_ms
        out.append(
            f"| {r['n']} | {p['records']} / {r['records']} | {p['fdatasync']} / {r['fdatasync']} | "
            f"{p['fsync']} / {r['fsync']} | {p['created']} / {r['created']} | "
            f"{p['data_bytes']:,} / {r['data_bytes']:,} | {p['journal_bytes']:,} / {int(r['journal_bytes']):,} | "
            f"{r['time_s'] * 1e3:.0f} ms | {floor:.0f} ms ({100 * floor / (r['time_s'] * 1e3):.0f} %) |")
    return out


def controller_table(c: dict) -> list[str]:
    h = c["heartbeat_s"]
    total_ranks = sum(r["ranks"] for r in c["roles"].values())
    out = [f"**Controller**, heartbeats at the 64-node split (heartbeat every {h:g} s) and the engine hosts' polls. "
           "Loop time per message (`RunState.apply`, and `Elastic.on_message` for a poll; best of 5 passes over every "
           "sender) and the loop's share of one core:", "",
           "| sender | ranks or engines | messages/s | µs per message | loop ms per s |", "|---|---|---|---|---|"]
    load = 0.0
    for role, r in c["roles"].items():
        rate = r["ranks"] / h
        load += rate * r["us"] / 1e3
        out.append(f"| {role} | {r['ranks']} | {rate:g} | {r['us']:.1f} | {rate * r['us'] / 1e3:.1f} |")
    e = c["engines"]
    e_rate = e["engines"] / e["poll_s"]
    e_load = e_rate * e["us"] / 1e3
    out.append(f"| engine hosts (`next_task` every {e['poll_s']:g} s) | {e['engines']} | {e_rate:g} | {e['us']:.1f} | "
               f"{e_load:.1f} |")
    msgs = total_ranks / h + e_rate
    parse = msgs * c["parse_us"] / 1e3
    conns = total_ranks + 4 + e["engines"]
    out += ["", f"All roles: {total_ranks} ranks and {e['engines']} engine hosts, {msgs:g} messages/s, "
            f"{load + e_load:.1f} ms of loop time per second ({(load + e_load) / 10:.1f} % of a core); parsing and "
            f"checking each line in its connection thread {c['parse_us']:.1f} µs, {parse:.1f} ms per second more. "
            f"state.json at this size (ranks only, no engine table): {c['state_bytes']:,} bytes, "
            f"{c['state_write_ms']:.1f} ms to write. Connections: {total_ranks} ranks + 4 rank-0 task polls + "
            f"{e['engines']} engine hosts = {conns} of at most {c['max_connections']} (protocol.MAX_CONNECTIONS)."]
    return out


def weights_table(rows: list[dict]) -> list[str]:
    out = ["**Weight-sync HTTP fan-out** (actor rank 0's calls to E engines: `WeightSender.push`, then "
           "`EngineChecker.unreachable` + `.check`; stub engines in one other process that answer at once, no bytes "
           "moved). `nodelay`: the stub sets TCP_NODELAY, as SGLang's server does; `stock`: the handler of the CPU "
           "engine and of actor_fwd's Follower as it is. Predicted / counted calls, and the time:", "",
           "| E | handler | buckets B | push calls E·(6+B) | check calls E + 4E | push ms | ms per push call | "
           "rank-0 CPU ms per push call | check ms | ms per check call |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['engines']} | {r['handler']} | {r['buckets']} | {r['pred_push']} / {r['push_calls']} | "
                   f"{r['pred_check']} / {r['check_calls']} | {r['push_s'] * 1e3:.0f} | "
                   f"{r['push_s'] * 1e3 / r['push_calls']:.2f} | {r['push_cpu_s'] * 1e3 / r['push_calls']:.2f} | "
                   f"{r['check_s'] * 1e3:.0f} | "
                   f"{r['check_s'] * 1e3 / r['check_calls']:.2f} |")
    return out


def file_fsync_ms(base: Path, n: int = 10) -> float:
    """Median of writing 16 KB to a new file and fsyncing it (what a chunk's publish does, per file)."""
    ts = []
    d = Path(tempfile.mkdtemp(prefix="relax-bench-scaling-", dir=base))
    try:
        for i in range(n):
            fd = os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, b"x" * 16384)
            t0 = time.perf_counter()
            os.fsync(fd)
            ts.append(time.perf_counter() - t0)
            os.close(fd)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return statistics.median(ts) * 1e3


def rewrite_doc(text: str) -> None:
    doc = DOC.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{DOC} has no {BEGIN} … {END} section to rewrite")
    DOC.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text.strip()}\n{END}", doc))
    print(f"rewrote the simulation section of {DOC}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 16], help="producers = consumers per task")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=4, help="samples per chunk")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--engines", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the exchange lives (a filesystem to test)")
    p.add_argument("--no-write", action="store_true", help=f"print only; do not rewrite {DOC.relative_to(REPO)}")
    a = p.parse_args(argv)

    import h5py

    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    where = machine(f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version})")
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sync_ms, file_ms = fsync_ms(base), file_fsync_ms(base)

    xrows = []
    for n in a.n:
        r = sim_exchange(base, n, a.steps, a.samples, a.prompt_len, a.response_len)
        r.update(n=n, samples=a.samples,
                 pred=predict_exchange(n, n, r["payload_main"], r["payload_side"]))
        assert r["leases"] == {t: n for t in ("train", *FWD)}, r["leases"]
        xrows.append(r)
        print(f"exchange N={n}: {r['time_s'] * 1e3:.0f} ms per step", file=sys.stderr)
    ctl = sim_controller(base)
    print("controller: done", file=sys.stderr)
    wrows = sim_weights(a.engines, a.buckets)
    print("weight-sync fan-out: done", file=sys.stderr)
    took = time.monotonic() - T0

    cmd = "tools/bench/scaling.py" + ("" if a.n == [1, 4, 16] and a.steps == 3 and a.samples == 4 else
                                      f" --n {' '.join(map(str, a.n))} --steps {a.steps} --samples {a.samples}")
    lines = [f"Measured {when} with `{cmd}` ({took:.0f} s). Machine: {where}; load average "
             f"{os.getloadavg()[0]:.1f} at the end. Chunks: {a.samples} samples of {a.prompt_len} prompt + "
             f"{a.response_len} response tokens, every rollout field, {TEXT_BYTES} bytes of text per token; "
             f"{a.steps} steps per N, counts from every step (they must agree), time the median.", ""]
    lines += exchange_table(xrows, base, sync_ms, file_ms)
    lines += ["", "Data bytes are predicted as 512 + H + arrays per file with H = "
              f"{H_MAIN:,} (main) and {H_SIDE:,} (side); journal bytes from the size of each kind of record (the "
              "table in \"Exchange\"). The fsync floor is "
              "fdatasyncs × the small-fdatasync time + fsyncs × the new-file fsync time: how much of the step the "
              "disk's flushes explain; the rest is CPU (HDF5 metadata, CRC-32C, reads), on 2 cores shared by 2N "
              "threads.", ""]
    lines += controller_table(ctl)
    lines += [""]
    lines += weights_table(wrows)
    text = "\n".join(lines)
    print(text)
    if not a.no_write:
        rewrite_doc(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
