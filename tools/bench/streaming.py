#!/usr/bin/env python3
"""Streaming within a step against one chunk per step, on a long-tail workload (run by hand, not a test).

    tools/bench/streaming.py [--steps 8] [--short 4] [--long 96] [--prompt 96] [--groups 2] [--no-append]
    tools/bench/run --only streaming        # the same, with the other benchmarks' reporting

The workload: the tiny Llama, 16 prompts × 4 samples a step, each prompt ``--prompt`` characters of padding before an
arithmetic sum (the model's vocabulary is characters: one token each); the CPU reference engine answers most prompts
with ``--short`` tokens and one prompt group in ten with ``--long`` tokens, EOS ignored (:mod:`longtail`, a
generate function that tells the engine each length). The reference role adds π_ref (``algorithm.use_kl_loss``),
and the actor computes π_old itself. Four runs, the same seed and work: colocate and fully-async
(``max_staleness`` 1), each with ``rollout.stream_groups: --groups`` (a chunk of 2 groups as soon as they are done,
announced; the reference and the actor's π_old pass start on it) and with one chunk per step, each run twice in
the order A B B A (their steps pooled).

**The ratio** ``streaming vs whole step`` = the median ``perf/step_time`` (generate start → sync done, one step's
latency) of the one-chunk run ÷ the streaming run's, steps after ``WARMUP``. Also shown: the part of the step
after the generate (step time − ``perf/task_generate_time``, per step), the only part streaming can shorten, apart
from the generation's own time, which moves with the load of a shared machine; and the median
``perf/step_interval`` (sync done → sync done: the throughput), whose ratio is the same in colocate (one step at a
time) and smaller in fully-async (rollout already runs ahead of training there).

What streaming can overlap: the forward passes of the groups done early (π_ref, π_old) with the generation of the
long tail. What it cannot: the optimizer step (it needs the whole mini-batch: train.global_batch covers the step
here) and the long groups' own passes. Results: printed, ``tools/bench/results/streaming.json`` and (unless
--no-append) appended to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
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

WARMUP = 1
PROMPTS, SAMPLES = 16, 4


def make_data(path: Path, pad: int) -> Path:
    """64 long prompts: ``pad`` characters, then a one-digit sum; the label is its digit (the arith reward)."""
    rows = []
    for i in range(64):
        a, b = i % 5, (i // 5) % 5
        rows.append({"prompt": "." * pad + f"{a}+{b}=", "label": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_one(mode: str, groups: int, a: argparse.Namespace, data: Path, root: Path) -> list[dict]:
    from relax_hpc.controller import run_controller
    from relax_hpc.recipe import dump_recipe, load_recipe
    from relax_hpc.rundir import create_run_dir

    recipe = "quickstart.yaml" if mode == "colocate" else "quickstart-async.yaml"
    over = [f"run.steps={a.steps}", f"model.path={REPO / 'runs/models/tiny-llama'}", f"data.path={data}",
            f"run.runs_root={root}", f"rollout.rollout_batch_size={PROMPTS}", f"rollout.n_samples_per_prompt={SAMPLES}",
            f"rollout.max_response_len={a.long}", f"train.max_seq_len={a.prompt + 8 + a.long}",
            "train.max_tokens_per_micro_batch=8192", "rollout.custom_generate_function_path=longtail.generate",
            "rollout.eval_interval=null", "rollout.skip_eval_before_train=true", f"rollout.stream_groups={groups}",
            "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.001", "roles.reference.enabled=true",
            "logging.tensorboard=false"]
    r = load_recipe(REPO / "recipes" / recipe, over)
    run = create_run_dir(root, f"{mode}-{'streamed' if groups else 'whole'}")
    run.recipe.write_text(dump_recipe(r))
    t0 = time.monotonic()
    final = run_controller(run.path)
    if final["state"] != "COMPLETED":
        raise SystemExit(f"{mode} run failed: {final.get('reason')} (see {run.path})")
    print(f"[streaming] {mode}, stream_groups {groups}: {a.steps} steps in {time.monotonic() - t0:.0f} s",
          file=sys.stderr)
    return [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if r["step"] > WARMUP and key in r)


def bench(a: argparse.Namespace, base: Path) -> tuple[dict, str]:
    os.environ["RELAX_EXECUTOR"] = "local"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ["RELAX_BENCH_SHORT"], os.environ["RELAX_BENCH_LONG"] = str(a.short), str(a.long)
    data = make_data(base / "longtail.jsonl", a.prompt)
    out, rows = {}, []
    for mode in ("colocate", "fully_async"):
        # A B B A: each variant run twice, around the other, their steps pooled: a machine whose load drifts during
        # the bench (this one is shared) weighs on both alike
        got: dict[int, list[dict]] = {0: [], a.groups: []}
        for g in (0, a.groups, a.groups, 0):
            got[g] += run_one(mode, g, a, data, base)
        whole, streamed = got[0], got[a.groups]
        st = {g: med(r, "perf/step_time") for g, r in got.items()}
        # what streaming can shorten: the part of the step after the generate (step time − the generate task, per
        # step), apart from the generation itself, whose time moves with the machine's load
        after = {g: statistics.median(x["perf/step_time"] - x["perf/task_generate_time"] for x in r
                                      if x["step"] > WARMUP and "perf/task_generate_time" in x) for g, r in got.items()}
        out[f"streaming_{mode}_after_generate"] = after[0] / after[a.groups]
        iv = {g: med(r, "perf/step_interval") for g, r in got.items()}
        out[f"streaming_{mode}"] = st[0] / st[a.groups]
        out[f"streaming_{mode}_interval"] = iv[0] / iv[a.groups]
        stage = med(streamed, "perf/actor_stage_time") if any("perf/actor_stage_time" in x for x in streamed) else 0.0
        rows.append(f"| {mode} | {st[0]:.3f} | {st[a.groups]:.3f} | **{st[0] / st[a.groups]:.2f}×** | {iv[0]:.3f} | "
                    f"{iv[a.groups]:.3f} | {iv[0] / iv[a.groups]:.2f}× | {med(whole, 'perf/task_generate_time'):.3f} | "
                    f"{med(streamed, 'perf/task_generate_time'):.3f} | {after[0]:.3f} | {after[a.groups]:.3f} | "
                    f"{stage:.3f} |")
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        f"### Streaming within a step ({when})", "",
        f"Machine: {machine()}. Long-tail workload: the tiny Llama, {PROMPTS} prompts × {SAMPLES} samples a step, "
        f"prompts of {a.prompt} + 4 tokens, responses of {a.short} tokens and, for one prompt group in ten, {a.long} "
        f"tokens; reference role on (π_ref), π_old from the actor; {a.steps} steps, the first {WARMUP} left out, "
        f"medians over two runs of each variant (A B B A). Streamed: rollout.stream_groups {a.groups}. Ratio = step "
        "time (generate start → sync done) of one "
        "chunk per step ÷ streamed; the same for the step interval (sync done → sync done).", "",
        "| mode | step time, one chunk s | streamed s | streaming vs whole step | interval, one chunk s | streamed s | "
        "ratio | generate s, one chunk | generate s, streamed | after the generate s, one chunk | streamed | "
        "actor stage s, streamed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, ""])
    return out, text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--no-append", action="store_true")
    return ap


def report(results: dict, text: str, no_append: bool, say=print) -> None:
    for mode in ("colocate", "fully_async"):
        say(f"{mode}: streaming vs whole step: {results[f'streaming_{mode}']:.2f}× (median step time, generate "
              f"start → sync done, one chunk per step ÷ streamed; step interval ratio "
              f"{results[f'streaming_{mode}_interval']:.2f}×; after the generate "
              f"{results[f'streaming_{mode}_after_generate']:.2f}×)")
    out = HERE / "results" / "streaming.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({k: round(v, 4) for k, v in results.items()}, indent=1) + "\n")
    if not no_append:
        append(REPO / "docs" / "benchmarks.md", text)


def main() -> None:
    a = parser().parse_args()
    base = Path(tempfile.mkdtemp(prefix="relax-bench-streaming-"))
    results, text = bench(a, base)
    print(text)
    report(results, text, a.no_append)


if __name__ == "__main__":
    main()
