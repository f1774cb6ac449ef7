"""Find a run from what a user types: a run name, a run directory, a job id, or nothing (the latest run).

``relax-status`` and ``relax-cancel`` take the same argument; the run directory's ``job.json`` (written by
``relax-submit``) is what ties a name to a job id and an executor. A ``job.json`` that cannot be read (garbage,
a directory or a FIFO in its place, a field of the wrong type) is :class:`RunUnreadable`, one line naming the
file and what is wrong with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relax_hpc.backends import BACKENDS
from relax_hpc.launch.tools import launcher_for
from relax_hpc.rundir import RunDir, RunFileError, named_like, read_json_file

DEFAULT_RUNS_ROOT = "./runs"


class RunNotFound(LookupError):
    pass


class RunUnreadable(RunNotFound):
    """The run's ``job.json`` exists but cannot be used; the message names it and says why."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(v: Any) -> bool:
    return isinstance(v, str)


# job.json's fields that relax-status, relax-cancel and --resume read: (test, what it must be); absent or null is
# allowed for all but job_id
_JOB_FIELDS = {
    "job_id": (lambda v: _text(v) or isinstance(v, int) and not isinstance(v, bool), "a job id (text or a number)"),
    "executor": (lambda v: v in ("slurm", "local"), '"slurm" or "local"'),
    "job_name": (_text, "a string"), "host": (_text, "a string"), "submitit_folder": (_text, "a string"),
    "submitted_at": (_number, "a number (seconds since the epoch)"),
    "pid": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a process id (a positive integer)"),
    "pid_start": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
}


def job_problem(job: dict) -> str | None:
    """What is wrong with ``job.json``'s fields (one phrase), or None."""
    bad = [f"field {k!r} is {_short(v)}, not {what}" for k, (ok, what) in _JOB_FIELDS.items()
           if (v := job.get(k)) is not None and not ok(v)]
    jid = job.get("job_id")
    if jid is None:
        bad.insert(0, "field 'job_id' is missing")
    elif (job.get("executor") or "slurm") in BACKENDS and not launcher_for(job.get("executor")).job_id_ok(jid):
        bad.insert(0, f"field 'job_id' is {_short(jid)}, not a Slurm job id (digits)")  # a local run's is any text
    return "; ".join(bad) or None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def load_job(rd: RunDir) -> dict:
    """``job.json``, checked; :class:`RunUnreadable` (a :class:`RunNotFound`) where it cannot be used."""
    try:
        job = read_json_file(rd.job, dict)
    except RunFileError as e:
        hint = " (was it submitted with relax-submit?)" if e.missing else ""
        raise RunUnreadable(f"{e}{hint}") from None
    problem = job_problem(job)
    if problem:
        raise RunUnreadable(f"{rd.job}: {problem}")
    return job


def _submitted(rd: RunDir) -> list[tuple[float, RunDir]]:
    """(when submitted, rd) for a run directory with a job.json; a damaged one by the job.json's own time, so
    that naming no run finds it when it is the latest, and says what is wrong."""
    if not os.path.lexists(rd.job):
        return []
    try:
        return [(float(load_job(rd).get("submitted_at") or rd.job.stat().st_mtime), rd)]
    except (RunNotFound, OSError):
        try:
            return [(rd.job.lstat().st_mtime, rd)]
        except OSError:
            return []


def list_runs(runs_root: str | Path) -> list[RunDir]:
    """Run directories under ``runs_root`` (each with a job.json, readable or not), oldest first."""
    root = Path(runs_root).expanduser()
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir():
            found += _submitted(RunDir(d.resolve()))
    return [rd for _, rd in sorted(found, key=lambda t: (t[0], t[1].name))]


def find_run(arg: str | None, runs_root: str | Path = DEFAULT_RUNS_ROOT) -> RunDir:
    """The run ``arg`` names (a run directory, a name under ``runs_root``, a job id, or a recipe's ``run.name``:
    the latest run of that name); raises :class:`RunNotFound` with what exists instead, or :class:`RunUnreadable`
    when the run it names has a job.json that cannot be used."""
    root = Path(runs_root).expanduser()
    if not arg:
        runs = list_runs(root)
        if not runs:
            raise RunNotFound(f"no runs under {root.resolve()} (use --runs-root, or name a run directory)")
        load_job(runs[-1])
        return runs[-1]
    direct = Path(arg).expanduser()
    for cand in (direct, root / arg):
        if os.path.lexists(cand / "job.json"):
            rd = RunDir(cand.resolve())
            load_job(rd)
            return rd
    job_id = arg.split("+", 1)[0]
    if job_id.isdigit():
        matches = [rd for rd in list_runs(root) if str(_job_or_none(rd).get("job_id")) == job_id]
        if matches:
            return matches[-1]
    # the recipe's run.name (what a user remembers): the latest run of that name, <name>-<stamp>[-i]
    named = named_like(arg)
    matches = [rd for rd in list_runs(root) if named.fullmatch(rd.name)]
    if matches:
        load_job(matches[-1])
        return matches[-1]
    names = [rd.name for rd in list_runs(root)][-5:]
    hint = f" Recent runs: {', '.join(names)}." if names else ""
    raise RunNotFound(f"no run or job id {arg!r} under {root.resolve()}.{hint}")


def _job_or_none(rd: RunDir) -> dict:
    try:
        return load_job(rd)
    except RunNotFound:
        return {}
