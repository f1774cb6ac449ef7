"""Sweeps: ``relax-submit recipe.yaml --sweep train.lr=1e-6,3e-6 rollout.temperature=0.8,1.0`` submits one run per
point of the grid (here 4), each a job of its own, named by its point; ``relax-status --sweep NAME`` shows one row
per point, ``relax-cancel --sweep NAME`` cancels them all (docs/slurm.md, "Sweeps").

Why separate jobs: a het job cannot be a job array. Throttling (``--sweep-max-running N``) is Slurm's own, so that
it holds after relax-submit exits: point ``i`` is submitted with ``--dependency=afterany:<job of point i-N>``
(N chains, each running one point at a time). Not ``--dependency=singleton``: Slurm 22.05 applies a het job's
singleton to its own components, and such a job never starts. The dependency is added to that submission's
script only, not to the run's recipe, so a continuation job (a refused requeue) starts without waiting.

Every point is planned and validated (the recipe, then the cluster's checks) before anything is submitted: a
bad value at any point submits nothing, and the error names the point. The sweep's record is
``<runs_root>/sweeps/<NAME>.json``: its points, each with its run directory and job id.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.launch import slurm
from relax_hpc.launch.tools import launcher_for
from relax_hpc.launch.runs import RunNotFound
from relax_hpc.launch.submit import Plan, plan, submit
from relax_hpc.recipe import RecipeError
from relax_hpc.rundir import RunDir, mask_override, read_json_file, RunFileError, write_json

SWEEPS_DIR = "sweeps"  # under the runs root: one <name>.json per sweep
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SLUG_BAD = re.compile(r"[^A-Za-z0-9._-]+")


class SweepError(ValueError):
    """A sweep that must not be submitted (or cannot be found); one message naming the point or the option."""


@dataclass(frozen=True)
class Axis:
    key: str
    values: tuple[str, ...]  # as typed; each is read as YAML, like any override (1e-6 is a number)


def split_values(text: str) -> list[str]:
    """``1e-6,3e-6`` → two values; commas inside brackets or quotes stay (``[a,b],[c]`` → two lists)."""
    out, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


def parse_axes(specs: list[str], overrides: list[str] = ()) -> list[Axis]:
    """``--sweep``'s words, ``KEY=V1,V2,...`` each, checked: a key once, not also a plain override, no empty value."""
    axes: list[Axis] = []
    plain = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    for spec in specs:
        key, eq, rest = spec.partition("=")
        key = key.strip()
        if not eq or not key:
            raise SweepError(f"--sweep {spec!r}: expected KEY=V1,V2,..., e.g. --sweep train.lr=1e-6,3e-6")
        values = split_values(rest)
        if any(v == "" for v in values):
            raise SweepError(f"--sweep {spec!r}: an empty value. Fix: KEY=V1,V2 with no empty item")
        if any(a.key == key for a in axes):
            raise SweepError(f"--sweep: key {key!r} is given twice. Fix: one KEY=V1,V2,... per key")
        if key in plain:
            raise SweepError(f"--sweep: key {key!r} is also a plain override ({key}=...). Fix: give it in one place")
        if key == "run.name":
            raise SweepError("--sweep: run.name cannot be swept: each point's run is named by its point")
        axes.append(Axis(key, tuple(values)))
    if not axes:
        raise SweepError("--sweep: no KEY=V1,V2,... given")
    return axes


def points(axes: list[Axis]) -> list[tuple[tuple[str, str], ...]]:
    """Every combination, the first axis slowest: ((key, value), ...) per point."""
    return [tuple(zip((a.key for a in axes), combo)) for combo in itertools.product(*(a.values for a in axes))]


def label(point: tuple[tuple[str, str], ...]) -> str:
    """``train.lr=1e-6 rollout.temperature=0.8``: how a point is shown and named in errors."""
    return " ".join(f"{k}={v}" for k, v in point)


def slug(point: tuple[tuple[str, str], ...]) -> str:
    """``lr1e-6-temperature0.8``: a point in a run name (a key's last part, unless two axes share it)."""
    lasts = [k.rsplit(".", 1)[-1] for k, _ in point]
    parts = []
    for (k, v), last in zip(point, lasts):
        name = last if lasts.count(last) == 1 else k
        parts.append(_SLUG_BAD.sub("_", f"{name}{v}").strip("_") or "x")
    return "-".join(parts)


@dataclass
class AfterPlan(Plan):
    """A plan whose job waits for another job to end (``afterany``): the sweep's throttle. The dependency goes in
    the first ``#SBATCH`` block (a het job's job-wide options are the first component's)."""

    after: str | None = None

    def script(self, run_dir: Path) -> str:
        return with_dependency(super().script(run_dir), self.after)


def with_dependency(script: str, after: str | None) -> str:
    if not after:
        return script
    lines = script.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.startswith("#SBATCH")), 1)
    return "".join(lines[:at] + [f"#SBATCH --dependency=afterany:{after}\n"] + lines[at:])


@dataclass
class Sweep:
    name: str
    runs_root: Path
    points: list[tuple[tuple[str, str], ...]]
    plans: list[Plan]
    max_running: int | None

    @property
    def record_path(self) -> Path:
        return self.runs_root / SWEEPS_DIR / f"{self.name}.json"

    def after(self, i: int) -> int | None:
        """The point whose job point ``i`` waits for (``--sweep-max-running``), or None."""
        return i - self.max_running if self.max_running and i >= self.max_running else None


def plan_sweep(recipe_path: str | Path, overrides: list[str], specs: list[str], executor: str = "slurm",
               name: str | None = None, max_running: int | None = None, check_place: bool = True) -> Sweep:
    """Every point planned and checked (:func:`~relax_hpc.launch.submit.plan`); :class:`SweepError` naming each bad
    point (its values, then the recipe's problems) where any is refused: nothing is created then."""
    axes = parse_axes(specs, overrides)
    if max_running is not None and max_running < 1:
        raise SweepError(f"--sweep-max-running {max_running}: must be at least 1 (or left out: all at once)")
    if max_running is not None and not launcher_for(executor).queued:
        raise SweepError("--sweep-max-running needs Slurm (the throttle is a Slurm dependency); a local sweep "
                         "starts every point at once. Fix: leave it out, or submit to Slurm")
    if name is not None and not _NAME.fullmatch(name):
        raise SweepError(f"--sweep-name {name!r}: letters, digits, '.', '_' and '-', starting with a letter or digit")
    grid = points(axes)
    plans: list[Plan] = []
    bad: list[str] = []
    base = None
    for i, point in enumerate(grid):
        if base is None:  # the recipe's run.name, as the command line leaves it (read from the first point)
            base = _base_name(recipe_path, overrides, point, executor)
        over = [*overrides, *(f"{k}={v}" for k, v in point), f"run.name={base}-{slug(point)}"]
        try:
            plans.append(plan(recipe_path, over, executor, check_place=check_place))
        except RecipeError as e:
            lines = e.render().splitlines()[1:]  # its problems; the head line is said once, below
            bad.append(f"point {i + 1} of {len(grid)} ({label(point)}):\n" + "\n".join(lines))
    if bad:
        raise SweepError(f"sweep of recipe {recipe_path}: {len(bad)} of {len(grid)} point(s) refused; nothing was "
                         "submitted:\n" + "\n".join(bad))
    name = name or f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"
    sw = Sweep(name, plans[0].runs_root, grid, plans, max_running)
    if sw.record_path.exists():
        raise SweepError(f"a sweep named {name!r} exists already ({sw.record_path}). Fix: another --sweep-name")
    return sw


def _base_name(recipe_path: str | Path, overrides: list[str], point: tuple, executor: str) -> str:
    try:
        p = plan(recipe_path, [*overrides, *(f"{k}={v}" for k, v in point)], executor, check_place=False)
        return p.recipe.run.name
    except RecipeError:
        return Path(str(recipe_path)).stem  # this point is refused anyway; its problems are reported with the rest


def dry_run(sw: Sweep) -> dict:
    return {"dry_run": True, "sweep": sw.name, "record": str(sw.record_path), "max_running": sw.max_running,
            "points": [{"point": dict(pt), "label": label(pt), "run_name": p.recipe.run.name,
                        "after_point": None if sw.after(i) is None else sw.after(i) + 1}
                       for i, (pt, p) in enumerate(zip(sw.points, sw.plans))]}


def submit_sweep(sw: Sweep) -> dict:
    """Submit every point in order (throttled ones after the job they wait for), writing the sweep's record as
    each is submitted: a submission that fails half way leaves the record of those submitted
    (``relax-cancel --sweep`` finds them). Returns the record."""
    record: dict[str, Any] = {"sweep": sw.name, "created_at": time.time(), "max_running": sw.max_running,
                              "runs_root": str(sw.runs_root), "points": []}
    sw.record_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(sw.record_path, record)
    for i, (pt, p) in enumerate(zip(sw.points, sw.plans)):
        k = sw.after(i)
        after = record["points"][k]["job_id"] if k is not None else None
        job, _ = submit(AfterPlan(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)}, after=after))
        record["points"].append({"point": {key: mask_override(f"{key}={v}").split("=", 1)[1] for key, v in pt},
                                 "label": label(pt), "run": job["run"], "run_dir": job["run_dir"],
                                 "job_id": job["job_id"], "executor": job["executor"], "after": after})
        write_json(sw.record_path, record)
    return record


# ------------------------------------------------------------------------------------ status, cancel ---

def load_sweep(name: str, runs_root: str | Path) -> dict:
    """The record of sweep ``name`` under ``runs_root``; :class:`RunNotFound` naming what exists instead."""
    root = Path(runs_root).expanduser().resolve()
    path = root / SWEEPS_DIR / f"{name}.json"
    if not _NAME.fullmatch(name):
        raise RunNotFound(f"no sweep {name!r}: a sweep's name has letters, digits, '.', '_' and '-' only")
    try:
        doc = read_json_file(path, dict)
    except RunFileError as e:
        if not e.missing:
            raise RunNotFound(str(e)) from None
        known = sorted(p.stem for p in (root / SWEEPS_DIR).glob("*.json"))[-5:]
        hint = f" Sweeps there: {', '.join(known)}." if known else ""
        raise RunNotFound(f"no sweep {name!r} under {root} ({path} does not exist).{hint}") from None
    if not isinstance(doc.get("points"), list) or not all(isinstance(p, dict) and p.get("run_dir")
                                                           for p in doc["points"]):
        raise RunNotFound(f"{path}: field 'points' is not a list of points with a run_dir")
    return doc


def sweep_status(doc: dict) -> dict:
    """One row per point: its values, run, job, state (Slurm's words), step, reward, reason. One ``squeue`` (and
    at most one ``sacct``) answers for every point (:func:`relax_hpc.launch.slurm.want`)."""
    from relax_hpc.launch.status import collect

    slurm.want([p["job_id"] for p in doc["points"] if launcher_for(p.get("executor")).queued and p.get("job_id")])
    rows = []
    for p in doc["points"]:
        row = {"point": p.get("point"), "label": p.get("label"), "run": p.get("run"), "run_dir": p["run_dir"],
               "job_id": p.get("job_id"), "state": "UNKNOWN", "step": None, "total_steps": None, "reward": None,
               "reason": None}
        try:
            info = collect(RunDir(Path(p["run_dir"])))
        except (RunNotFound, OSError) as e:
            row["reason"] = str(e)
        else:
            prog = info.get("progress") or {}
            reward = prog.get("reward_last") if prog.get("reward_last") is not None else info.get("reward")
            row.update(state=info["state"], step=info.get("step"), total_steps=info.get("total_steps"),
                       reward=reward, reason=info.get("reason"))
        rows.append(row)
    return {"sweep": doc.get("sweep"), "max_running": doc.get("max_running"), "points": rows,
            "final": all(slurm.is_finished(r["state"]) for r in rows)}


def render_status(info: dict):
    from rich.table import Table
    from rich.text import Text

    from relax_hpc.launch.status import _styled

    t = Table(title=f"sweep {info['sweep']}" + (f" (at most {info['max_running']} running)"
                                                  if info.get("max_running") else ""), title_justify="left")
    for col in ("point", "run", "job", "state", "step", "reward", "reason"):
        t.add_column(col, overflow="fold")
    for r in info["points"]:
        step = "-" if r["step"] is None else f"{r['step']}/{r['total_steps'] or '?'}"
        reward = f"{r['reward']:.3f}" if isinstance(r["reward"], (int, float)) else "-"
        t.add_row(Text(r["label"] or "-"), Text(r["run"] or "-"), str(r["job_id"] or "-"), _styled(r["state"]), step,
                  reward, Text(r["reason"] or "-"))  # Text: a reason is never read as rich markup
    return t


def cancel_sweep(doc: dict, grace_s: float = 30.0) -> dict:
    """Cancel every point that has not ended, the last submitted first (so a throttled point whose job ends
    cannot let the next one start in between). Per point: what was done, or why not."""
    from relax_hpc.backends import CancelError
    from relax_hpc.launch.cancel import cancel
    from relax_hpc.launch.status import collect, is_final

    out = []
    for p in reversed(doc["points"]):
        rd = RunDir(Path(p["run_dir"]))
        try:
            if is_final(collect(rd)):
                out.append({"run": p.get("run"), "job_id": p.get("job_id"), "action": "none: already ended"})
                continue
            out.append(dict(cancel(rd, grace_s), error=None))
        except (CancelError, RunNotFound, slurm.SlurmError, OSError) as e:
            out.append({"run": p.get("run"), "job_id": p.get("job_id"), "action": None, "error": str(e)})
    return {"sweep": doc.get("sweep"), "points": list(reversed(out)),
            "ok": all(not r.get("error") for r in out)}


# ------------------------------------------------------------------------------------------ the CLIs ---
# relax-submit/-status/-cancel --sweep (relax_hpc.launch.cli parses; these print and return its exit codes:
# 0 done, 1 failed, 2 refused before anything happened, 130 interrupted)

def submit_main(args: Any, executor: str, console: Any, print_json: Any, err: Any) -> int:
    if not args.sweep:
        err("relax-submit: --sweep-max-running and --sweep-name go with --sweep KEY=V1,V2,...")
        return 2
    if args.resume:
        err("relax-submit: --sweep and --resume do not go together (resume each point's run by its name)")
        return 2
    try:
        sw = plan_sweep(args.recipe, args.overrides, args.sweep, executor, args.sweep_name, args.sweep_max_running,
                        check_place=not args.render_only)
    except SweepError as e:
        err(f"relax-submit: {e}")
        if args.json:
            print_json({"error": "sweep refused", "message": str(e)})
        return 2
    if args.dry_run:
        d = dry_run(sw)
        if args.json:
            print_json(d)
        else:
            print(f"# relax-submit --dry-run --sweep: nothing submitted. Sweep {sw.name}: {len(sw.points)} point(s), "
                  f"each checked; record would be {sw.record_path}")
            for i, pt in enumerate(d["points"]):
                wait = f"  (after point {pt['after_point']} ends)" if pt["after_point"] else ""
                print(f"  {i + 1}. {pt['label']}  →  run {pt['run_name']}{wait}")
        return 0
    try:
        record = submit_sweep(sw)
    except Exception as e:  # noqa: BLE001 - sbatch refused half way: say what was submitted
        done = (read_json_file(sw.record_path, dict).get("points") if sw.record_path.exists() else None) or []
        err(f"relax-submit --sweep: submitting point {len(done) + 1} of {len(sw.points)} failed: {e}\n"
            + (f"{len(done)} point(s) were submitted; relax-cancel --sweep {sw.name} cancels them"
               if done else "nothing was submitted"))
        return 1
    if args.json:
        print_json(record)
    else:
        console.print(f"Submitted sweep [bold]{sw.name}[/bold]: {len(record['points'])} run(s)"
                      + (f", at most {sw.max_running} at once" if sw.max_running else ""), highlight=False)
        for pt in record["points"]:
            wait = f" after {pt['after']}" if pt["after"] else ""
            console.print(f"  {pt['label']}: run {pt['run']}, job {pt['job_id']}{wait}", highlight=False)
        console.print(f"Next:\n  relax-status --sweep {sw.name}\n  relax-cancel --sweep {sw.name}", highlight=False)
    return 0


def status_main(args: Any, print_json: Any, err: Any) -> int:
    from rich.console import Console
    from rich.live import Live

    if args.run or args.audit:
        err("relax-status: --sweep NAME shows a sweep; name no run and no --audit with it")
        return 2
    try:
        doc = load_sweep(args.sweep, args.runs_root)
    except RunNotFound as e:
        err(f"relax-status: {e}")
        return 2
    console = Console()
    try:
        info = sweep_status(doc)
        if not args.watch:
            print_json(info) if args.json else console.print(render_status(info))
            return 0
        # --watch: every --interval, until every point ended; Slurm is asked at most every slurm.CACHE_S
        if args.json or not console.is_terminal:
            last = None
            while True:
                rows = [(r["state"], r["step"], r["reason"]) for r in info["points"]]
                if rows != last:
                    print_json(info) if args.json else console.print(render_status(info))
                    last = rows
                if info["final"]:
                    return 0
                time.sleep(args.interval)
                info = sweep_status(doc)
        with Live(render_status(info), console=console, refresh_per_second=2) as live:
            while not info["final"]:
                time.sleep(args.interval)
                info = sweep_status(doc)
                live.update(render_status(info))
        return 0
    except KeyboardInterrupt:
        return 130


def cancel_main(args: Any, print_json: Any, err: Any) -> int:
    if args.checkpoint or args.requeue:
        err("relax-cancel --sweep: --checkpoint/--requeue are per run; cancel the sweep's runs one by one for that")
        return 2
    try:
        doc = load_sweep(args.sweep, args.runs_root)
    except RunNotFound as e:
        err(f"relax-cancel: {e}")
        return 2
    out = cancel_sweep(doc, args.grace)
    if args.json:
        print_json(out)
    else:
        for r in out["points"]:
            print(f"{r['run']} (job {r['job_id']}): {r['action'] if not r.get('error') else 'FAILED: ' + r['error']}")
    return 0 if out["ok"] else 1
