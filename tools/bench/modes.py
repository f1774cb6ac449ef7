#!/usr/bin/env python3
"""Colocate vs fully-async, and the controller's overhead (run by hand, not a test).

    tools/bench/modes.py [--steps 30] [--staleness 1] [--model runs/models/tiny-llama] [--no-append]

Runs the quickstart recipe locally (the embedded executor: every role a process on this machine) twice,
``mode: colocate`` and ``mode: fully_async`` with ``max_staleness``, the same seed, and reads each run's
``metrics.jsonl``. The first 5 steps are warm-up and left out.

* **Throughput**: samples/s = samples per step / median ``perf/step_interval`` (sync done → sync done).
* **Ideal overlap** from the colocate run's phase times (medians): T_rollout = ``perf/rollout_time`` +
  ``perf/exchange_write_time``, T_train = ``perf/train_time`` + ``perf/weight_sync_time``; ideal speed-up =
  (T_rollout + T_train) / max(T_rollout, T_train). Achieved = async samples/s ÷ colocate samples/s; the
  target is ≥ 90 % of ideal.
* **Controller overhead**: ``perf/controller_time`` (the loop's own work on a step's reports: broker,
  journal fsyncs, metrics) ÷ step interval, and the coordination gap of colocate steps: step time − the
  roles' own task times (socket hops, task hand-out, the roles' reading of their tasks).

Prints markdown tables and appends them, with machine, date and load, to docs/benchmarks.md.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common import append, machine  # noqa: E402  (tools/bench/common.py: this script's directory is on sys.path)
from relax_hpc.controller import run_controller  # noqa: E402
from relax_hpc.recipe import dump_recipe, load_recipe  # noqa: E402
from relax_hpc.rundir import create_run_dir  # noqa: E402

WARMUP = 5


def run_mode(mode: str, steps: int, staleness: int, model: Path, root: Path) -> list[dict]:
    recipe = "quickstart.yaml" if mode == "colocate" else "quickstart-async.yaml"
    over = [f"run.steps={steps}", f"model.path={model}", f"data.path={REPO / 'recipes/data/arith.jsonl'}",
            f"run.runs_root={root}"] + ([f"max_staleness={staleness}"] if mode == "fully_async" else [])
    r = load_recipe(REPO / "recipes" / recipe, over)
    run = create_run_dir(root, mode)
    run.recipe.write_text(dump_recipe(r))
    os.environ["RELAX_EXECUTOR"] = "local"
    t0 = time.monotonic()
    run_controller(run.path)
    print(f"{mode}: {steps} steps in {time.monotonic() - t0:.0f} s ({run.path})", file=sys.stderr)
    return [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]


def med(rows: list[dict], *keys: str) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows[WARMUP:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--model", type=Path, default=REPO / "runs" / "models" / "tiny-llama")
    ap.add_argument("--no-append", action="store_true")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="relax-bench-modes-"))
    where = machine()
    rows = {m: run_mode(m, a.steps, a.staleness, a.model.resolve(), root) for m in ("colocate", "fully_async")}
    batch = load_recipe(REPO / "recipes" / "quickstart.yaml").rollout
    per_step = batch.rollout_batch_size * batch.n_samples_per_prompt
    col, asy = rows["colocate"], rows["fully_async"]
    t_roll = med(col, "perf/rollout_time", "perf/exchange_write_time")
    t_train = med(col, "perf/train_time", "perf/weight_sync_time")
    ideal = (t_roll + t_train) / max(t_roll, t_train)
    sps = {m: per_step / med(r, "perf/step_interval") for m, r in rows.items()}
    achieved = sps["fully_async"] / sps["colocate"]
    gap = statistics.median(r["perf/step_time"] - sum(r.get(k, 0.0) for k in (
        "perf/rollout_time", "perf/exchange_write_time", "perf/train_time", "perf/weight_sync_time"))
        for r in col[WARMUP:])
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"### Colocate vs fully-async, controller overhead ({when})", "",
        f"Machine: {where}; load average {os.getloadavg()[0]:.1f} at the end. Quickstart recipe, local executor, {a.steps} steps "
        f"({WARMUP} warm-up steps left out), {per_step} samples per step, fully_async with max_staleness "
        f"{a.staleness}. Medians per step.", "",
        "| mode | step interval s | samples/s | rollout s | train+sync s | controller s | controller / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in rows.items():
        lines.append(f"| {m} | {med(r, 'perf/step_interval'):.3f} | {sps[m]:.1f} | "
                     f"{med(r, 'perf/rollout_time', 'perf/exchange_write_time'):.3f} | "
                     f"{med(r, 'perf/train_time', 'perf/weight_sync_time'):.3f} | "
                     f"{med(r, 'perf/controller_time') * 1e3:.2f} ms | "
                     f"{100 * med(r, 'perf/controller_time') / med(r, 'perf/step_interval'):.2f} % |")
    lines += ["", f"Ideal overlap from the colocate phases: ({t_roll:.3f} + {t_train:.3f}) / "
              f"{max(t_roll, t_train):.3f} = **{ideal:.2f}×**; fully-async achieved **{achieved:.2f}×** "
              f"= **{100 * achieved / ideal:.0f} % of ideal**. Colocate coordination gap (step time − the "
              f"roles' task times): {gap * 1e3:.0f} ms per step = {100 * gap / med(col, 'perf/step_interval'):.1f} %.",
              ""]
    text = "\n".join(lines)
    print(text)
    if not a.no_append:
        append(REPO / "docs" / "benchmarks.md", text)


if __name__ == "__main__":
    main()
