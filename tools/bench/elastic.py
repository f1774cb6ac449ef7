#!/usr/bin/env python3
"""Elastic rollout: join time and drain time, under load (run by hand, not a test).

    tools/bench/elastic.py [--reps 3] [--steps 40] [--slurm] [--model runs/models/tiny-llama] [--no-append]

Runs the fully-async quickstart and, while it trains (no pause: rollout is generating), asks ``relax-scale
rollout=+1`` and, once that engine is ready, ``rollout=-1``, ``--reps`` times in the same run. Locally the engine is
a step engine (a process); with ``--slurm`` the run is ``recipes/quickstart-slurm.yaml`` on the dev cluster
(``tools/dev-slurm up``) and the engine comes as an attached job (``--attach``).

* **Join time** = the scale request → the engine ``ready``: started from the model on disk, joined, and given the
  current weights by a sync (the operation's ``ready`` time in ``state.json``).
* **Drain time** = the drain's start → the engine ``gone``: no new requests, the tasks holding it (the generate in
  flight, a sync) done, its host stopped (the operation's ``gone`` time). The drain is asked right after the engine
  served its first step, while the run goes on, so a generate handed out with it is usually in flight.

Prints a markdown table and appends it, with machine, date and load, to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common import append, machine  # noqa: E402
from relax_hpc.launch.scale import scale  # noqa: E402
from relax_hpc.rundir import RunDir  # noqa: E402


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(what)


def _op(run: RunDir, op_id: str) -> dict | None:
    doc = run.read_json(run.state, {}) or {}
    return next((o for o in doc.get("scale") or [] if o["id"] == op_id), None)


def cycles(run: RunDir, reps: int, attach: dict | None) -> list[tuple[float, float]]:
    """``reps`` × (+1 then -1) on a running run; (join s, drain s) each."""
    out = []
    _wait(lambda: (run.read_json(run.state, {}) or {}).get("step", 0) >= 2, 600, "the run at step 2")
    for _ in range(reps):
        up = _wait(lambda: (r := scale(run, "rollout=+1", attach=attach))["accepted"] and r, 120, "+1 accepted")
        done = _wait(lambda: (o := _op(run, up["op"])) and o["state"] != "running" and o, 600, "joined")
        if done["state"] != "done":
            raise RuntimeError(f"scale-out failed: {done}")
        join = next(iter(done["ready"].values()))
        name = done["engines"][0]
        # drain it while it serves: once it has served a step, the next generate (already handed out) holds it
        _wait(lambda: ((run.read_json(run.state, {}) or {}).get("engines") or {}).get(name, {}).get("requests", 0) > 0,
              600, f"{name} served")
        down = _wait(lambda: (r := scale(run, "rollout=-1"))["accepted"] and r, 120, "-1 accepted")
        done = _wait(lambda: (o := _op(run, down["op"])) and o["state"] != "running" and o, 600, "drained")
        out.append((join, next(iter(done["gone"].values()))))
        print(f"join {join:.2f} s, drain {out[-1][1]:.2f} s", file=sys.stderr)
    return out


def local(reps: int, steps: int, model: Path, root: Path) -> list[tuple[float, float]]:
    from relax_hpc.controller import run_controller
    from relax_hpc.launch import attach
    from relax_hpc.recipe import dump_recipe, load_recipe
    from relax_hpc.rundir import create_run_dir

    r = load_recipe(REPO / "recipes" / "quickstart-async.yaml",
                    [f"run.steps={steps}", f"model.path={model}", f"data.path={REPO / 'recipes/data/arith.jsonl'}",
                     f"run.runs_root={root}"])
    run = create_run_dir(root, "elastic")
    run.recipe.write_text(dump_recipe(r))
    os.environ["RELAX_EXECUTOR"] = "local"
    t = threading.Thread(target=run_controller, args=(run.path,), kwargs={"capacity": attach}, daemon=True)
    t.start()
    try:
        return cycles(run, reps, None)
    finally:
        t.join()


def on_slurm(reps: int, steps: int, model: Path, root: Path) -> list[tuple[float, float]]:
    p = subprocess.run([str(REPO / ".venv/bin/relax-submit"), "--json", str(REPO / "recipes/quickstart-slurm.yaml"),
                        f"run.steps={steps}", f"model.path={model}", f"data.path={REPO / 'recipes/data/arith.jsonl'}",
                        f"run.runs_root={root}"], capture_output=True, text=True, check=True)
    run = RunDir(Path(json.loads(p.stdout)["run_dir"]))
    _wait(lambda: (run.read_json(run.state, {}) or {}).get("state") == "RUNNING", 300, "the run started")
    try:
        return cycles(run, reps, {"time": "00:10:00"})
    finally:
        _wait(lambda: (run.read_json(run.state, {}) or {}).get("state") not in ("RUNNING", None), 1200, "the run's end")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="long enough for the reps; the run ends by itself")
    ap.add_argument("--slurm", action="store_true", help="the dev cluster, attached jobs (else local step engines)")
    ap.add_argument("--model", type=Path, default=REPO / "runs/models/tiny-llama")
    ap.add_argument("--no-append", action="store_true")
    a = ap.parse_args()
    head = machine()
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        got = (on_slurm if a.slurm else local)(a.reps, a.steps, a.model.resolve(), Path(tmp))
    joins, drains = [j for j, _ in got], [d for _, d in got]
    where = "dev Slurm cluster, attached jobs (`--attach`)" if a.slurm else "local, step engines (processes)"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"### Elastic rollout: join and drain under load, {where} ({stamp})\n\n{head}\n\n"
            "The fully-async quickstart trains while `relax-scale rollout=+1` then `rollout=-1` run, "
            f"{a.reps} times in one run (`tools/bench/elastic.py{' --slurm' if a.slurm else ''}`). Join = the "
            "request → the engine ready with the current weights (started, joined, synced); drain = the drain's "
            "start → the engine gone (no new requests; the generate or sync holding it done; its host stopped), asked "
            "right after the engine served its first step.\n\n"
            "| | each rep (s) | median (s) |\n|---|---|---|\n"
            f"| join | {', '.join(f'{x:.2f}' for x in joins)} | {statistics.median(joins):.2f} |\n"
            f"| drain | {', '.join(f'{x:.2f}' for x in drains)} | {statistics.median(drains):.2f} |\n")
    print(text)
    if not a.no_append:
        append(REPO / "docs" / "benchmarks.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
