"""The three commands: ``relax-submit``, ``relax-status``, ``relax-cancel`` (see docs/cli.md).

Only argument parsing, printing and exit codes live here; the work is in submit/status/cancel/follow.
Exit codes: 0 success (for a foreground local run: it COMPLETED); 1 the run failed or a Slurm command failed;
2 the recipe (or the run named) was refused before anything happened; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from relax_hpc.backends import container
from relax_hpc.launch import slurm
from relax_hpc.launch.attach import ATTACH_OPTIONS
from relax_hpc.launch.tools import launcher_for
from relax_hpc.launch.cancel import CancelError, cancel, checkpoint_then_stop
from relax_hpc.launch.follow import follow
from relax_hpc.launch.runs import DEFAULT_RUNS_ROOT, RunNotFound, find_run
from relax_hpc.launch.scale import ScaleError, scale
from relax_hpc.launch.status import audit_run, collect, is_final, render, render_audit
from relax_hpc.launch.submit import SubmitError, dry_run, plan, submit
from relax_hpc.recipe import RecipeError
from relax_hpc.recipe import memory_plan
from relax_hpc.recipe.errors import short_repr
from relax_hpc.ops.metrics import summary_line
from relax_hpc.rundir import FULL_BYTES, RESERVE_BYTES, RunDir, free_bytes, no_space_message

EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_INTERRUPTED = 0, 1, 2, 130


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True, default=str), flush=True)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _refused(e: RecipeError, as_json: bool) -> int:
    _err(e.render())
    if as_json:
        _print_json({"error": "recipe refused", "source": e.source,
                     "problems": [{"key": k, "value": short_repr(v), "message": m} for k, v, m in e.problems]})
    return EXIT_REFUSED


# -------------------------------------------------------------------------------------- relax-submit ---

def _submit_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="relax-submit",
        description="Submit a recipe as one Slurm heterogeneous job (or run it locally).",
        epilog="Overrides: key.sub=value, e.g. run.steps=20 roles.rollout.nodes=2. See docs/cli.md. "
               "relax-submit --from-relax-args ARGS... prints the recipe for a Relax launch script's flags.")
    ap.add_argument("recipe", help="recipe YAML file (with --resume: the run's name or directory)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    ap.add_argument("--local", action="store_true", help="run on this machine (the default without sbatch on PATH)")
    ap.add_argument("--dry-run", action="store_true", help="print the sbatch script and step commands; submit nothing")
    ap.add_argument("--render-only", action="store_true",
                    help="with --dry-run: the Slurm batch script and srun lines without the checks against a cluster "
                         "or this machine (partition, nodes, GPUs, the files the run opens), for a recipe whose "
                         "cluster cannot be reached from here; the recipe itself is still validated")
    ap.add_argument("--json", action="store_true", help="print one JSON object (run, run_dir, job_id, ...)")
    ap.add_argument("--detach", action="store_true", help="local runs: return at once instead of following the run")
    ap.add_argument("--resume", action="store_true",
                    help="start an ended run again from its latest checkpoint, in its own directory")
    ap.add_argument("--sweep", nargs="+", action="extend", metavar="KEY=V1,V2",
                    help="one run per point of the grid of these values, e.g. --sweep train.lr=1e-6,3e-6 "
                         "rollout.temperature=0.8,1.0 (4 runs); give plain overrides before it (docs/slurm.md)")
    ap.add_argument("--sweep-max-running", type=int, metavar="N",
                    help="with --sweep: at most N points run at once (Slurm dependencies hold the others)")
    ap.add_argument("--sweep-name", metavar="NAME", help="with --sweep: its name (default: <run.name>-<time>)")
    return ap


SKIPPED_CHECKS = ("the recipe was validated, but not checked against any cluster or this machine: partition, "
                  "node and GPU counts, memory, the files the run opens (model, data), the container runtime, the "
                  "SGLang interpreter")


def _next_commands(record: dict, named_by_path: bool) -> list[str]:
    ref = record["run_dir"] if named_by_path else record["run"]
    cmds = [f"relax-status {ref} --watch", f"relax-cancel {ref}"]
    log = record.get("batch_log") or record.get("local_log")
    if log:
        cmds.append(f"tail -f {log}")
    return cmds


def _from_relax_args(argv: list[str]) -> int:
    """``relax-submit --from-relax-args ARGS...``: print the recipe YAML for a Relax launch script's flags, given as
    words or as one quoted string (``"--flag a --flag b"``: split as the shell would)."""
    from relax_hpc.recipe import recipe_from_dict
    from relax_hpc.recipe.from_relax import convert, to_yaml

    if not argv:
        _err("relax-submit --from-relax-args: no flags given. Fix: relax-submit --from-relax-args --hf-checkpoint "
             "/models/Qwen3-4B --rollout-batch-size 32 ... (a launch script's flags)")
        return EXIT_REFUSED
    if len(argv) == 1 and any(c.isspace() for c in argv[0]):
        try:
            argv = shlex.split(argv[0])
        except ValueError as e:  # an unclosed quote
            _err(f"relax-submit --from-relax-args: cannot split {argv[0]!r} as a shell would: {e}")
            return EXIT_REFUSED
    try:
        data, notes = convert(argv)
        recipe_from_dict(data, source="relax-submit --from-relax-args")
    except ValueError as e:
        _err(f"relax-submit --from-relax-args: {e}")
        return EXIT_REFUSED
    except RecipeError as e:
        return _refused(e, False)
    print(to_yaml(data, notes, argv), end="")
    return EXIT_OK


def submit_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--from-relax-args"]:  # the rest are Relax's flags, not ours
        return _from_relax_args(argv[1:])
    ap = _submit_parser()
    args = ap.parse_intermixed_args(argv)
    if args.render_only and (not args.dry_run or args.local or args.resume):
        ap.error("--render-only goes with --dry-run, without --local or --resume (it shows the Slurm batch script)")
    console = Console(stderr=args.json)
    no_sbatch = not args.local and not args.render_only and not slurm.have_sbatch()
    executor = "local" if args.local or no_sbatch else "slurm"
    if no_sbatch:
        _err("relax-submit: no sbatch on PATH: running with the local executor (processes on this machine)")
    if args.sweep or args.sweep_max_running is not None or args.sweep_name:
        from relax_hpc.launch.sweep import submit_main as sweep_submit  # one run per point
        return sweep_submit(args, executor, console, _print_json, _err)
    if args.resume:
        return _resume(args, console)
    try:
        p = plan(args.recipe, args.overrides, executor, check_place=not args.render_only)
    except RecipeError as e:
        code = _refused(e, args.json)
        if args.dry_run and no_sbatch:  # checked against this machine, maybe for want of the cluster it is for
            _err("To see the batch script and srun lines for a cluster not reachable from here, without checking "
                 "the recipe against it: relax-submit --dry-run --render-only ...")
        return code

    if args.dry_run:
        mem, mem_problems, no_plan = memory_plan.for_recipe(p.recipe, Path.cwd())
        if args.render_only and mem_problems:  # the file checks, which refuse these, do not run with --render-only
            return _refused(RecipeError(mem_problems, source=args.recipe), args.json)
        d = dry_run(p)
        d["memory_plan"] = mem.as_dict() if mem else {"unavailable": no_plan}
        if args.render_only:
            d["render_only"] = True
            d["skipped_checks"] = SKIPPED_CHECKS
        if args.json:
            _print_json(d)
        else:
            how = "--dry-run --render-only" if args.render_only else "--dry-run"
            print(f"# relax-submit {how}: nothing submitted, nothing created. Executor: {d['executor']}.")
            if args.render_only:
                print(f"# NOT CHECKED (--render-only): {SKIPPED_CHECKS}. relax-submit checks them where Slurm is "
                      "reachable.")
            print(f"# Run directory would be: {d['run_dir']}")
            if d["script"] is not None:
                print("# ---------------- sbatch script ----------------")
                print(d["script"], end="" if d["script"].endswith("\n") else "\n")
            print("# ---------------- memory plan: one GPU, GiB (docs/gpu.md, Memory plan) ----------------")
            print("\n".join(f"# {ln}" for ln in (mem.table() if mem else f"none: {no_plan}").splitlines()))
            print("# ---------------- role steps (the controller starts these) ----------------")
            for line in d["steps"]:
                print(container.readable(line))  # the container's parts on lines of their own
        return EXIT_OK

    try:
        record, job = submit(p)
    except SubmitError as e:
        _err(f"relax-submit: {e}\nNothing was submitted and no run directory was kept.")
        if args.json:
            _print_json({"error": "submission failed", "message": str(e)})
        return EXIT_FAILED
    # relax-status looks under ./runs by default: elsewhere, name the run by its directory
    record["next"] = _next_commands(record, named_by_path=p.runs_root != Path(DEFAULT_RUNS_ROOT).resolve())
    rd = RunDir(p.runs_root / record["run"])

    backend = launcher_for(executor)
    if not backend.follows or args.detach:
        if args.json:
            _print_json(record)
        else:
            console.print(f"Submitted run [bold]{record['run']}[/bold] as {backend.job_label(record)}.",
                          highlight=False)
            console.print(f"Run directory: {record['run_dir']}", highlight=False)
            console.print("Next:", highlight=False)
            for c in record["next"]:
                console.print(f"  {c}", highlight=False, soft_wrap=True)
        return EXIT_OK
    return _foreground(rd, record, job, console, args.json)


def _resume(args: argparse.Namespace, console: Console) -> int:
    from relax_hpc.launch.submit import resume
    from relax_hpc.train.latest import BrokenLatest, read_latest

    try:
        rd = find_run(args.recipe)
    except RunNotFound as e:
        _err(f"relax-submit --resume: {e}")
        return EXIT_FAILED
    if args.overrides:
        _err("relax-submit --resume: a resumed run keeps its recipe (RUN_DIR/recipe.yaml); overrides are refused")
        return EXIT_FAILED
    try:  # a broken `latest` first: whatever the run's state, it is the news the user needs
        read_latest(rd.path / "checkpoints")
    except BrokenLatest as e:
        _err(f"relax-submit --resume: {e}")
        return EXIT_FAILED
    info = collect(rd)
    if not is_final(info) or info["state"] == "COMPLETED":
        _err(f"relax-submit --resume: run {rd.name} is {info['state']}: only a run that ended without "
             "completing can be resumed")
        return EXIT_FAILED
    room = rd.ensure_reserve()  # a disk without room for the run's reserve would end it as its last attempt did
    free = free_bytes(rd.path)
    if (free is not None and free < FULL_BYTES) or (not room and (free is None or free < RESERVE_BYTES + FULL_BYTES)):
        _err(f"relax-submit --resume: {no_space_message(rd, what=f'{free} bytes free')}")
        return EXIT_FAILED
    if not room:  # room on the disk, and still no reserve: not the disk's doing
        _err(f"relax-submit --resume: cannot write {rd.reserve} in the run directory. Fix: make {rd.path} "
             "writable by you (its permissions, a read-only filesystem), then resume")
        return EXIT_FAILED
    try:
        record, job = resume(rd.path, "local" if args.local else None)
    except Exception as e:
        _err(f"relax-submit --resume: {e}")
        return EXIT_FAILED
    if job is None or args.detach:
        if args.json:
            _print_json(record)
        else:
            console.print(f"Resumed run [bold]{rd.name}[/bold] as job {record['job_id']}.", highlight=False)
        return EXIT_OK
    return _foreground(rd, record, job, console, args.json)


def _foreground(rd: RunDir, record: dict, job: Any, console: Console, as_json: bool) -> int:
    """Follow a local run until it ends; Ctrl-C cancels it (its whole process group). Where this process was
    started with SIGINT ignored (a shell's background job, ``relax-submit ... &`` in a script), no Ctrl-C reaches
    it, and it says so rather than promise one: relax-cancel stops the run."""
    interruptible = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    if not as_json:
        how = "Ctrl-C cancels" if interruptible else (
            f"SIGINT is ignored here (started in the background): relax-cancel {record['run']} cancels")
        console.print(f"Running [bold]{record['run']}[/bold] locally (pid {record['pid']}); "
                      f"{how}. Run directory: {record['run_dir']}", highlight=False)
    proc = getattr(job, "_process", None)

    def ended(info: dict) -> bool:
        if proc is not None:
            proc.poll()  # reap the child so it is not a zombie
        return is_final(info)

    try:
        if as_json:
            info = collect(rd)
            while not ended(info):
                time.sleep(0.5)
                info = collect(rd)
        else:
            info = follow(rd, console, interval=0.5, stop=ended, settle_s=5.0)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave the run half-stopped
        _err("relax-submit: interrupted: cancelling the run ...")
        try:
            cancel(rd)
        finally:
            if proc is not None:
                proc.poll()
        info = collect(rd)
        if as_json:
            _print_json(dict(record, state=info["state"], reason=info["reason"]))
        else:
            _err(f"relax-submit: run {record['run']} {info['state']}")
        return EXIT_INTERRUPTED
    if as_json:
        _print_json(dict(record, state=info["state"], reason=info["reason"]))
    elif info["state"] == "COMPLETED":
        console.print(f"Run {record['run']} COMPLETED.", highlight=False)
        summary = rd.read_json(rd.path / "summary.json", None)
        if summary:  # the task's own measure where the recipe evaluates, as the run's last line
            console.print(summary_line(summary), highlight=False, soft_wrap=True)
    else:
        _err(f"relax-submit: run {record['run']} {info['state']}: {info.get('reason') or 'no reason recorded'}\n"
             f"Logs: {rd.logs}")
    return EXIT_OK if info["state"] == "COMPLETED" else EXIT_FAILED


# -------------------------------------------------------------------------------------- relax-status ---

def _status_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="relax-status",
                                 description="State of a run: Slurm's view (per het component) and the controller's "
                                             "(step, phase per role).")
    ap.add_argument("run", nargs="?", help="run name, run directory or job id (default: the latest run)")
    ap.add_argument("--sweep", metavar="NAME", help="a sweep's points, one row each (relax-submit --sweep)")
    ap.add_argument("--watch", action="store_true", help="refresh until the run ends (Ctrl-C stops watching only)")
    ap.add_argument("--json", action="store_true", help="print JSON (with --watch: one object per line, on change)")
    ap.add_argument("--runs-root", default=DEFAULT_RUNS_ROOT, help=f"where runs are (default {DEFAULT_RUNS_ROOT})")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    ap.add_argument("--audit", action="store_true",
                    help="the exchange journal's audit: samples produced and consumed per step and task, chunks "
                         "quarantined, prompts trained per epoch; exit 1 unless every sample was produced and "
                         "consumed exactly once and no prompt was trained twice in an epoch")
    return ap


def status_main(argv: list[str] | None = None) -> int:
    args = _status_parser().parse_args(argv)
    if args.sweep:
        from relax_hpc.launch.sweep import status_main as sweep_status
        return sweep_status(args, _print_json, _err)
    try:
        rd = find_run(args.run, args.runs_root)
    except RunNotFound as e:
        _err(f"relax-status: {e}")
        return EXIT_REFUSED
    console = Console()
    if args.audit:
        try:
            info = audit_run(rd)
        except Exception as e:  # a journal or recipe that cannot be read
            _err(f"relax-status --audit: {type(e).__name__}: {e}")
            return EXIT_FAILED
        _print_json(info) if args.json else console.print(render_audit(info))
        return EXIT_OK if info["exactly_once"] and info["prompts_once"] else EXIT_FAILED
    try:
        if args.watch:
            info = follow(rd, console, interval=args.interval, json_lines=args.json)
        else:
            info = collect(rd)
            if args.json:
                _print_json(info)
            elif not info["error"]:
                console.print(render(info))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except RunNotFound as e:  # job.json damaged since find_run read it
        _err(f"relax-status: {e}")
        return EXIT_FAILED
    if info["error"]:  # a run file that cannot be used: one line naming it, never a state that was not read
        _err(f"relax-status: {info['error']}")
        return EXIT_FAILED
    return EXIT_FAILED if info["state"] == "UNKNOWN" and info["source"] == "none" and \
        str(info.get("reason", "")).startswith("cannot ask Slurm") else EXIT_OK


# -------------------------------------------------------------------------------------- relax-cancel ---

def _cancel_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="relax-cancel", description="Cancel a run (scancel, or stop a local run).")
    ap.add_argument("run", nargs="?", help="run name, run directory or job id")
    ap.add_argument("--sweep", metavar="NAME", help="cancel every point of this sweep (relax-submit --sweep)")
    ap.add_argument("--runs-root", default=DEFAULT_RUNS_ROOT, help=f"where runs are (default {DEFAULT_RUNS_ROOT})")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="local runs: seconds between SIGTERM and SIGKILL (default 30)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--checkpoint", action="store_true",
                     help="let the step in flight finish, save a checkpoint, then cancel (resume later with "
                          "relax-submit --resume RUN)")
    how.add_argument("--requeue", action="store_true",
                     help="save a checkpoint, then end this attempt and come back (Slurm: requeue)")
    ap.add_argument("--wait", type=float, default=600.0,
                    help="with --checkpoint/--requeue: seconds to wait for the run to act (default 600)")
    return ap


def cancel_main(argv: list[str] | None = None) -> int:
    ap = _cancel_parser()
    args = ap.parse_args(argv)
    if bool(args.run) == bool(args.sweep):
        ap.error("name a run, or a sweep with --sweep NAME")
    if args.sweep:
        from relax_hpc.launch.sweep import cancel_main as sweep_cancel
        return sweep_cancel(args, _print_json, _err)
    try:
        rd = find_run(args.run, args.runs_root)
    except RunNotFound as e:
        _err(f"relax-cancel: {e}")
        return EXIT_REFUSED
    try:
        if args.checkpoint or args.requeue:
            out = checkpoint_then_stop(rd, "checkpoint_requeue" if args.requeue else "checkpoint_cancel", args.wait)
        else:
            out = cancel(rd, grace_s=args.grace)
    except (CancelError, slurm.SlurmError) as e:
        _err(f"relax-cancel: {e}")
        return EXIT_FAILED
    if args.json:
        _print_json(out)
    else:
        print(f"{'Cancelled' if out['action'] != 'requeue' else 'Requeued'} run {out['run']} "
              f"({out['executor']} job {out['job_id']}: {out['action']}).")
    return EXIT_OK


def _scale_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="relax-scale", description="Add or drain rollout engines of a running run (docs/elastic.md).",
        epilog="Examples: relax-scale RUN rollout=+2 --attach --partition preempt --time 1:00:00;  "
               "relax-scale RUN rollout=-1;  relax-scale RUN --cancel s3")
    ap.add_argument("run", help="run name, run directory or job id")
    ap.add_argument("target", nargs="?", help="rollout=+N (add N engines), rollout=-N (drain N), rollout=N (exactly N)")
    ap.add_argument("--attach", action="store_true",
                    help="add the engines as a separate Slurm job (any partition) instead of steps of the run's job")
    for opt in ATTACH_OPTIONS:
        ap.add_argument(f"--{opt}", help=f"with --attach: the attached job's --{opt} (default: rollout.elastic.attach, "
                                         "then the run's slurm.*)")
    ap.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                    help="with --attach: one more sbatch option, e.g. --sbatch=--reservation=r1 (repeatable)")
    ap.add_argument("--cancel", metavar="OP", help="withdraw scale operation OP (an attached job still pending)")
    ap.add_argument("--attach-url", metavar="URL", help="a running engine started by anyone (SGLang or the reference "
                                                       "engine) serves the run too; needs --key-file")
    ap.add_argument("--key-file", metavar="FILE", help="with --attach-url: the file (mode 0600) holding that engine's "
                                                      "API key; a key is never taken on the command line")
    ap.add_argument("--drain", metavar="URL", help="drain the external engine at URL (it keeps running)")
    ap.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the operation to finish (default 0)")
    ap.add_argument("--runs-root", default=DEFAULT_RUNS_ROOT, help=f"where runs are (default {DEFAULT_RUNS_ROOT})")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def scale_main(argv: list[str] | None = None) -> int:
    ap = _scale_parser()
    args = ap.parse_args(argv)
    if sum(bool(x) for x in (args.target, args.cancel, args.attach_url, args.drain)) != 1:
        ap.error("give one of: a target (rollout=+N, -N, N), --cancel OP, --attach-url URL --key-file FILE, "
                 "--drain URL")
    if bool(args.key_file) != bool(args.attach_url):
        ap.error("--attach-url URL and --key-file FILE go together (the key is read from the file, never given here)")
    opts = {k: getattr(args, k) for k in ATTACH_OPTIONS}
    if not args.attach and (any(v is not None for v in opts.values()) or args.sbatch):
        ap.error(f"{'/'.join(f'--{k}' for k in (*ATTACH_OPTIONS, 'sbatch'))} need --attach")
    attach = {**{k: v for k, v in opts.items() if v is not None}, "extra": args.sbatch} if args.attach else None
    try:
        rd = find_run(args.run, args.runs_root)
    except RunNotFound as e:
        _err(f"relax-scale: {e}")
        return EXIT_REFUSED
    try:
        out = scale(rd, args.target, attach=attach, cancel=args.cancel, wait_s=args.wait, attach_url=args.attach_url,
                    key_file=args.key_file, drain_url=args.drain)
    except ScaleError as e:
        _err(f"relax-scale: {e}")
        return EXIT_REFUSED
    if args.json:
        _print_json(out)
    else:
        print(f"{'accepted' if out['accepted'] else 'refused'}: {out['message']}")
        op = out.get("operation")
        if op:
            print(f"{op['id']}: {op['state']}: {op.get('detail', '')}")
    if not out["accepted"]:
        return EXIT_REFUSED
    return EXIT_FAILED if out.get("operation") and out["operation"].get("state") == "failed" else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(submit_main())
