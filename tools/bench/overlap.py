#!/usr/bin/env python3
"""The weight sync behind the next train (train.overlap_sync) against the sync in series (run by hand, not a test).

    tools/bench/overlap.py [--steps 20] [--model runs/models/tiny-llama] [--json PATH]
    tools/bench/run --only overlap [--quick]

The fully-async quickstart (recipes/quickstart-async.yaml, max_staleness 1, the same seed) four times, A B B A:
A = ``train.overlap_sync: false`` (the sync is a task between train N and train N+1), B = ``true`` (the actor answers
the sync at its snapshot, trains N+1 while the push runs; the step counts as synced when the push lands). Local
executor, actor and rollout pinned to CPUs 0 and 1 (``RELAX_LOCAL_CPUS=actor=0;rollout=1``). Per run, the median
over the steps after :data:`WARMUP` of ``perf/step_interval`` (sync landed → sync landed) and of the actor's busy time
per step (``perf/task_train_time`` + ``perf/task_sync_time``: with overlap the sync task is the snapshot alone).

``overlap_vs_series`` = median interval of the A runs ÷ that of the B runs (> 1: overlap is faster), same work, same
definition in both. ``overlapped_steps``: the share of B's steps whose train started before the previous step's sync
landed (``perf/weight_sync_overlapped``). On the tiny model the push is a few ms of a step of about a second, and the
rollout role is the slower one, so little can be gained here: the figure says what the mechanism costs or buys where
the sync is short; on a cluster the push of a large model is seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PIN = "actor=0;rollout=1"
WARMUP = 3


def run_once(overlap: bool, steps: int, model: Path, root: Path, name: str) -> list[dict]:
    from relax_hpc.controller import run_controller
    from relax_hpc.recipe import dump_recipe, load_recipe
    from relax_hpc.rundir import create_run_dir

    over = [f"run.steps={steps}", f"model.path={model}", f"data.path={REPO / 'recipes/data/arith.jsonl'}",
            f"run.runs_root={root}", f"train.overlap_sync={'true' if overlap else 'false'}"]
    r = load_recipe(REPO / "recipes" / "quickstart-async.yaml", over)
    run = create_run_dir(root, name)
    run.recipe.write_text(dump_recipe(r))
    final = run_controller(run.path)
    if final["state"] != "COMPLETED":
        raise SystemExit(f"overlap={overlap} run failed: {final.get('reason')} (see {run.path})")
    return [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]


def med(rows: list[dict], *keys: str) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows[WARMUP:])


def bench(quick: bool, base: Path, steps: int | None = None, model: Path | None = None) -> tuple[dict, str]:
    steps = steps or (8 if quick else 20)
    model = model or REPO / "runs" / "models" / "tiny-llama"
    os.environ["RELAX_LOCAL_CPUS"] = PIN
    os.environ["RELAX_EXECUTOR"] = "local"
    runs: dict[str, list[list[dict]]] = {"series": [], "overlap": []}
    order = []  # (A or B, its median interval, its median train task time): how far the runs scatter
    for i, overlap in enumerate((False, True, True, False)):  # A B B A: drift on a shared machine cancels out
        rows = run_once(overlap, steps, model, base, f"overlap-{i}")
        runs["overlap" if overlap else "series"].append(rows)
        order.append(("B" if overlap else "A", med(rows, "perf/step_interval"), med(rows, "perf/task_train_time")))
    interval = {k: statistics.median(med(r, "perf/step_interval") for r in v) for k, v in runs.items()}
    busy = {k: statistics.median(med(r, "perf/task_train_time", "perf/task_sync_time") for r in v)
            for k, v in runs.items()}
    push = statistics.median(med(r, "perf/weight_sync_time") for r in runs["overlap"])
    rows = [r for run in runs["overlap"] for r in run[WARMUP:]]
    share = sum(r.get("perf/weight_sync_overlapped", 0.0) for r in rows) / len(rows)
    out = {"overlap_vs_series": interval["series"] / interval["overlap"], "overlapped_steps": share}
    text = (f"Overlapped weight sync: the fully-async quickstart (max_staleness 1), {steps} steps ({WARMUP} warm-up "
            f"left out), A B B A (A: train.overlap_sync false, B: true), pinned CPUs ({PIN}); medians of per-run "
            f"medians. Step interval: in series {interval['series']:.3f} s, overlapped {interval['overlap']:.3f} s "
            f"(overlap vs series {interval['series'] / interval['overlap']:.3f}×); the actor's busy time per step "
            f"(train + sync task): {busy['series']:.3f} s vs {busy['overlap']:.3f} s; the push behind the train "
            f"{push * 1e3:.1f} ms; {100 * share:.0f} % of the overlapped run's steps trained before the previous "
            "step's sync landed. Per run, in order (interval / train task): "
            + ", ".join(f"{k} {iv:.3f} / {tr:.3f} s" for k, iv, tr in order) + f"; load average {os.getloadavg()[0]:.1f}.")
    return out, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", type=Path, default=REPO / "runs" / "models" / "tiny-llama")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out, text = bench(False, Path(tempfile.mkdtemp(prefix="relax-bench-overlap-")), a.steps, a.model.resolve())
    print(text)
    if a.json:
        a.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
