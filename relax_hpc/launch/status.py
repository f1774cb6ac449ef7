"""A run's status: what Slurm (or the local process) says, joined with what the controller wrote in ``state.json``.

Why both: Slurm knows the allocation (state per het component, nodes, time left, why it is pending) but not
training progress; the controller knows the step and each role's phase but not whether the job is still
queued, or was killed without a chance to write. The overall ``state`` is always in Slurm's words (PENDING,
RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...), for local runs too, so scripts need one vocabulary.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from typing import Any

from rich.console import Group as RichGroup
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from relax_hpc.launch import provenance, slurm
from relax_hpc.launch.tools import launcher_for
from relax_hpc.launch.runs import RunUnreadable, load_job
from relax_hpc.ops.metrics import REWARD, WINDOW
from relax_hpc.recipe import load_recipe
from relax_hpc.recipe.layout import role_steps
from relax_hpc.rundir import RunDir, RunFileError, is_regular, read_json_file

STATE_STYLE = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow", "FAILED": "bold red",
               "CANCELLED": "magenta", "TIMEOUT": "red", "UNKNOWN": "dim"}


def _epoch(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            return _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


# state.json's fields relax-status reads, as the controller writes them (controller/state.py): null or absent is
# allowed for all but "state"
_WORDS = frozenset(slurm.FINISHED_STATES | {"RUNNING", "PENDING", "REQUEUED"})
_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
_NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
_STR = (lambda v: isinstance(v, str), "a string")
_OBJECTS = (lambda v: isinstance(v, dict) and all(isinstance(x, dict) or x is None for x in v.values()),
            "an object of objects")
_SCALE_KEYS = ("id", "spec", "origin", "state")
_STATE_FIELDS = {
    "state": (lambda v: isinstance(v, str) and v in _WORDS, f"one of {', '.join(sorted(_WORDS))}"),
    "reason": _STR, "phase": _STR, "last_failure": _STR, "weights": _STR,
    "step": _INT, "total_steps": _INT, "attempt": _INT, "restarts": _INT,
    "reward": _NUMBER, "updated_at": (lambda v: _epoch(v) is not None, "a time"),
    "roles": _OBJECTS, "engines": _OBJECTS, "judges": _OBJECTS, "teachers": _OBJECTS,
    "events": (lambda v: isinstance(v, list), "an array"),
    "last_checkpoint": (lambda v: isinstance(v, dict), "an object"),
    "health": (lambda v: isinstance(v, dict), "an object"),
    "scale": (lambda v: isinstance(v, list) and all(isinstance(op, dict) and all(k in op for k in _SCALE_KEYS)
                                                    for op in v), f"an array of objects with {', '.join(_SCALE_KEYS)}"),
}


def read_state(rd: RunDir) -> tuple[dict, str | None]:
    """``state.json`` as the controller wrote it, checked: (the document, None); ({}, "missing") before the
    controller wrote one; ({}, "<file>: <what is wrong>") for one that cannot be used, whatever the damage (not
    a regular file, unreadable, empty, truncated, binary, not an object, a field of the wrong type)."""
    try:
        doc = read_json_file(rd.state, dict)
    except RunFileError as e:
        return {}, "missing" if e.missing else str(e)
    if doc.get("state") is None:
        return {}, f"{rd.state}: has no \"state\" field; the controller always writes one"
    bad = [f"field {k!r} is {_short(v)}, not {what}" for k, (ok, what) in _STATE_FIELDS.items()
           if (v := doc.get(k)) is not None and not ok(v)]
    return ({}, f"{rd.state}: {'; '.join(bad)}") if bad else (doc, None)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# A run's recipe, parsed once per version of its file rather than at every refresh (relax-submit follows a run
# every 2 s; its YAML took 0.04 CPU-s of each refresh's 0.045)
_LAYOUTS: dict[tuple, tuple] = {}


def _layout(rd: RunDir, state: dict) -> tuple[list[dict], str | None]:
    """Roles in het-group order from the run's recipe (or, if it cannot be read, from state.json), and the recipe's
    ``slurm.layout`` as relax-submit settled it (``hetjob`` or ``single``; None where the recipe cannot be read)."""
    try:
        if not is_regular(rd.recipe):  # a FIFO in its place would hang the read
            raise FileNotFoundError(rd.recipe)
        st = rd.recipe.stat()
        key = (str(rd.recipe), st.st_mtime_ns, st.st_size, st.st_ino)
        if key not in _LAYOUTS:
            recipe = load_recipe(rd.recipe)
            _LAYOUTS[key] = (tuple((s.role, s.het_group, s.shared, s.nodes, s.ntasks) for s in role_steps(recipe)),
                             recipe.slurm.layout)
        steps, layout = _LAYOUTS[key]
        return [{"role": role, "het_group": group, "shared": shared, "nodes_requested": nodes, "ntasks": ntasks}
                for role, group, shared, nodes, ntasks in steps], layout
    except Exception:
        roles = state.get("roles") or {}
        return [{"role": name, "het_group": (r or {}).get("het_group"), "shared": None, "nodes_requested": None,
                 "ntasks": None} for name, r in roles.items()], None


TAIL_BYTES = 256 << 10  # of metrics.jsonl read for the progress: its last rows (a row is a few hundred bytes)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _metric_rows(rd: RunDir) -> list[dict]:
    """The last rows of ``metrics.jsonl`` (its tail only: a long run's file is large and this is read every
    refresh); none when it is missing or cannot be read. A row cut by a kill, or text that is not JSON, is skipped."""
    path = rd.path / "metrics.jsonl"
    if not is_regular(path):  # missing, or a FIFO whose read would hang
        return []
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            start = max(0, size - TAIL_BYTES)
            f.seek(start)
            lines = f.read(TAIL_BYTES).decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines[1:] if start else lines:  # the first line of a tail is a piece of a row
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def progress(rd: RunDir, step: Any, total: Any, final: bool) -> dict:
    """What a user watching a run wants besides its state, from ``metrics.jsonl``'s last rows: the last step's mean
    reward (``reward_last``), the mean over the last :data:`~relax_hpc.ops.metrics.WINDOW` steps
    (``reward_mean``, over ``reward_window`` steps), seconds per step over the same steps (``step_time_s``: wall
    time between their rows, so the eval, the weight sync and a fully-async overlap are all in it) and the time
    left at that pace (``eta_s``; None once the run ended). Non-finite rewards are left out of the mean."""
    by_step: dict[int, dict] = {}
    for row in _metric_rows(rd):  # step 0's row (the eval before training) has no reward
        if isinstance(row.get("step"), int) and _finite(row.get(REWARD)) and _finite(row.get("time")):
            by_step[row["step"]] = row  # a step logged twice (a resumed run): the later row
    steps = sorted(by_step)[-(WINDOW + 1):]
    out: dict[str, Any] = {"reward_last": None, "reward_mean": None, "reward_window": 0, "metrics_step": None,
                           "step_time_s": None, "eta_s": None}
    if not steps:
        return out
    rewards = [by_step[s][REWARD] for s in steps[-WINDOW:]]
    out.update(reward_last=by_step[steps[-1]][REWARD], reward_mean=sum(rewards) / len(rewards),
               reward_window=len(rewards), metrics_step=steps[-1])
    if len(steps) > 1:
        out["step_time_s"] = (by_step[steps[-1]]["time"] - by_step[steps[0]]["time"]) / (steps[-1] - steps[0])
    elif _finite(by_step[steps[0]].get("perf/step_time")):
        out["step_time_s"] = float(by_step[steps[0]]["perf/step_time"])
    done = max(steps[-1], step if isinstance(step, int) else 0)
    if not final and isinstance(total, int) and out["step_time_s"] is not None:
        out["eta_s"] = max(0.0, (total - done) * out["step_time_s"])
    return out


def collect(rd: RunDir, now: float | None = None) -> dict:
    """Everything ``relax-status --json`` prints for one run.

    ``error``: None, or one line naming a run file that cannot be used and what is wrong with it; then ``state``
    is UNKNOWN (never a state that was not read) and ``reason`` is that line. A damaged state.json is one; so is a
    missing state.json once the job ended cleanly (the controller never wrote the run's end: submitit's result
    or Slurm's COMPLETED says only that the process returned). A damaged job.json raises
    :class:`~relax_hpc.launch.runs.RunUnreadable`: without it there is no job to ask about."""
    now = time.time() if now is None else now
    job = load_job(rd)
    executor = job.get("executor", "slurm")
    backend = launcher_for(executor)
    if backend.needs_pid and job.get("pid") is None:
        raise RunUnreadable(f"{rd.job}: field 'pid' is missing (a local run's process id)")
    ctl, problem = read_state(rd)
    overall, reason, components, source = backend.job_state(rd, job, ctl)
    error = None if problem == "missing" and overall != "COMPLETED" else problem
    if error == "missing":
        how = backend.ended_cleanly(job)
        error = (f"{rd.state}: missing, though {how}: the controller never wrote the run's state, so how the run "
                 f"ended is unknown. See {rd.logs}")
    if error:
        overall, reason, source = "UNKNOWN", error, "none"
    layout, slurm_layout = _layout(rd, ctl)
    # slurm.layout: single is one plain job, not a het job: one component, named as Slurm names it (J, not J+0),
    # holding every role (their groups are node ranges inside the one allocation)
    single = backend.batch_script and slurm_layout == "single"
    ctl_roles = ctl.get("roles") or {}
    final = slurm.is_finished(overall)
    roles: dict[str, dict] = {}
    for entry in layout:
        r = dict(entry)
        r.update({k: v for k, v in (ctl_roles.get(entry["role"]) or {}).items() if k != "het_group"})
        hb = _epoch(r.get("last_heartbeat"))
        # an ended run's roles send no more heartbeats: an age that grows forever says nothing
        r["heartbeat_age_s"] = None if hb is None or final else round(now - hb, 1)
        roles[entry["role"]] = r
    if not components:  # local, or Slurm forgot the job: one entry per het group from the recipe
        for k in [0] if single else sorted({e["het_group"] for e in layout if e["het_group"] is not None}):
            components.append({"het_group": k, "label": backend.component_label(job, k), "state": overall,
                               "reason": None, "nodes": backend.component_nodes,
                               "source": source})
    for c in components:
        k = c.get("het_offset", c.get("het_group"))
        c["het_group"] = k
        c["roles"] = [e["role"] for e in layout if single or e["het_group"] == k]
        if single:
            c["label"] = str(job.get("job_id"))
    time_left = next((c.get("time_left_s") for c in components if c.get("het_group") == 0), None)
    return {
        "run": rd.name,
        "run_dir": str(rd.path),
        "error": error,
        "job_id": str(job.get("job_id")),
        "job_name": job.get("job_name"),
        "executor": executor,
        "state": overall,
        "reason": reason,
        "source": source,
        "submitted_at": job.get("submitted_at"),
        "controller_state": ctl.get("state"),
        "attempt": ctl.get("attempt"),
        "restarts": ctl.get("restarts"),
        "health": ctl.get("health"),  # which tier of recovery acted, why, how long it took
        "last_checkpoint": ctl.get("last_checkpoint"),
        "last_failure": ctl.get("last_failure"),
        "events": (ctl.get("events") or [])[-5:],
        "phase": ctl.get("phase"),
        "weights": ctl.get("weights"),  # how the weights travel to the engines (the actor's connect)
        "reward": ctl.get("reward"),
        "step": ctl.get("step"),
        "total_steps": ctl.get("total_steps"),
        "updated_at": ctl.get("updated_at"),
        "time_left_s": time_left,
        "components": components,
        "roles": roles,
        "engines": [_engine(name, info, final) for name, info in (ctl.get("engines") or {}).items()],
        "judges": [{"name": name, **(info or {})} for name, info in (ctl.get("judges") or {}).items()],
        "teachers": [{"name": name, **(info or {})} for name, info in (ctl.get("teachers") or {}).items()],  # OPD
        "scale": list(ctl.get("scale") or []),  # relax-scale's operations, the newest last
        "progress": progress(rd, ctl.get("step"), ctl.get("total_steps"), final),
        "provenance": provenance.read(rd),  # the code the run ran (relax-submit's record)
        "logs": str(rd.logs),
    }


def _engine(name: str, info: dict | None, final: bool) -> dict:
    """An engine as state.json has it; once the run ended, one it last saw serving (``ready``, ``syncing``, ...) is
    ``stopped``: its process ended with the run, so neither that state nor its URL holds any more."""
    e = {"name": name, **(info or {})}
    if final and e.get("state") not in ("dead", "gone", None):
        e["last_state"], e["state"] = e["state"], "stopped"
    return e


def is_final(info: dict) -> bool:
    return slurm.is_finished(info["state"])


# --------------------------------------------------------------------------------------- display ---

def _styled(state: Any) -> Text:
    s = str(state or "-")
    return Text(s, style=STATE_STYLE.get(slurm.state_word(s) if state else "UNKNOWN", ""))


def _cell(v: Any) -> Text:
    """A table cell as plain text: a value from the run (an error's log line: ``[/pytorch/.../x.cc:78]``) is never
    read as rich markup."""
    if v is None or v == "":
        return Text("-")
    if isinstance(v, (list, tuple)):
        return Text(",".join("?" if x is None else str(x) for x in v) or "-")
    return Text(str(v))


def render(info: dict) -> RichGroup:
    """The rich view of :func:`collect`'s result (relax-status, and relax-submit's local progress view)."""
    step = "" if info.get("step") is None else f"  step {info['step']}/{info.get('total_steps') or '?'}"
    left = "" if not launcher_for(info["executor"]).time_limited or not info.get("components") else \
        f"  time left {slurm.format_seconds(info.get('time_left_s'))}"
    head = Text.assemble((info["run"], "bold"), f"  job {info['job_id']} ({info['executor']})  ",
                         _styled(info["state"]), step, left)
    parts: list[Any] = [head]
    bar = _progress_view(info)
    if bar is not None:
        parts.append(bar)
    life = _life_line(info)
    if life:
        parts.append(Text(life, style="dim"))
    if info.get("reason"):
        parts.append(Text(f"reason: {info['reason']}", style="yellow" if info["state"] == "PENDING" else "red"))
    comps = Table(title=None, box=None, pad_edge=False, header_style="bold")
    for col in ("het", "job", "state", "nodes", "time left", "reason", "roles"):
        comps.add_column(col)
    for c in info["components"]:
        comps.add_row(_cell(c.get("het_group")), _cell(c.get("label")), _styled(c.get("state")),
                      _cell(c.get("nodes")), _cell(c.get("time_left")), _cell(c.get("reason")), _cell(c.get("roles")))
    roles = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("role", "het", "phase", "nodes", "ranks", "heartbeat", "error"):
        roles.add_column(col)
    for name, r in info["roles"].items():
        hb = r.get("heartbeat_age_s")
        roles.add_row(Text(name), _cell(r.get("het_group")), _cell(r.get("phase")),
                      _cell(r.get("nodes") if r.get("nodes") else r.get("nodes_requested")),
                      _cell(r.get("ranks") if r.get("ranks") is not None else r.get("ntasks")),
                      "-" if hb is None else f"{hb:.0f}s ago", _cell(r.get("error")))
    parts += [Text(""), comps, Text(""), roles]
    if info.get("engines"):
        engines = Table(box=None, pad_edge=False, header_style="bold")
        for col in ("engine", "state", "weights", "origin", "node", "job", "url"):
            engines.add_column(col)
        for e in info["engines"]:
            where = f"{e.get('job_id')}.{e['step_id']}" if e.get("step_id") else e.get("job_id")
            url = "-" if e.get("state") == "stopped" else _cell(e.get("url"))  # gone with the run
            engines.add_row(Text(e["name"]), _styled_engine(e), _cell(e.get("weight_version")), _cell(e.get("origin")),
                            _cell(e.get("node")), _cell(where), url)
        parts += [Text(""), engines]
    if info.get("weights"):
        parts.append(Text(f"weights: {info['weights']}", style="dim"))
    for op in info.get("scale", [])[-3:]:
        job = f", job {op['job_id']}" if op.get("job_id") else ""
        parts.append(Text(f"scale {op['id']} {op['spec']} ({op['origin']}{job}): {op['state']}: {op.get('detail', '')}",
                          style="yellow" if op["state"] == "running" else "dim"))
    code = provenance.describe(info.get("provenance"))
    if code:
        parts.append(Text(code, style="dim"))
    parts.append(Text(f"logs: {info['logs']}", style="dim"))
    return RichGroup(*parts)


def duration(s: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``: a step time or a time left, read at a glance."""
    if s is None:
        return "-"
    if s < 10:
        return f"{s:.1f}s"
    s = int(round(s))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _reward(v: Any) -> str:
    return f"{v:.3f}" if _finite(v) else "-"


def progress_fields(info: dict, step: bool = True) -> list[str]:
    """The progress as words: ``step 37/100``, ``reward 0.412 (mean 0.380 over 10 steps)``, ``1.8s/step``,
    ``1m53s left``; what the live view and the log lines both show (``step``: with the step)."""
    prog = info.get("progress") or {}
    out = []
    if step and info.get("step") is not None:
        out.append(f"step {info['step']}/{info.get('total_steps') or '?'}")
    if prog.get("reward_last") is not None:
        out.append(f"reward {_reward(prog['reward_last'])} (mean {_reward(prog.get('reward_mean'))} over "
                   f"{prog.get('reward_window')} steps)")
    if prog.get("step_time_s") is not None:
        out.append(f"{duration(prog['step_time_s'])}/step")
    if prog.get("eta_s") is not None:
        out.append(f"{duration(prog['eta_s'])} left")
    return out


def _progress_view(info: dict) -> Table | None:
    """One row: a bar of steps done, then :func:`progress_fields`."""
    total, step = info.get("total_steps"), info.get("step")
    fields = progress_fields(info, step=False)  # the head line has the step
    bar = isinstance(total, int) and total > 0 and isinstance(step, int)
    if not fields and not bar:
        return None
    row = Table.grid(padding=(0, 2))
    cells: list[Any] = []
    if bar:
        row.add_column(no_wrap=True)
        done = min(step, total)
        cells.append(ProgressBar(total=total, completed=done, width=30,
                                 complete_style="green" if is_final(info) else "cyan"))
        row.add_column(no_wrap=True)
        cells.append(f"{100 * done // total:3d}%")
    for f in fields:
        row.add_column(no_wrap=True)
        cells.append(Text(f, style="bold" if f.startswith("reward") else ""))
    row.add_row(*cells)
    return row


def _styled_engine(e: dict) -> Text:
    state = str(e.get("state") or ("dead" if e.get("dead") else "-"))
    style = {"ready": "green", "dead": "red", "draining": "yellow", "syncing": "yellow", "starting": "yellow",
             "stopped": "dim"}
    why = e.get("dead") or (e.get("left") if state == "gone" else None)
    return Text(state + (f" ({why})" if why else ""), style=style.get(state, ""))


def _life_line(info: dict) -> str:
    """Attempts, restarts, the last checkpoint and the last failure (recovered or not), on one line."""
    bits = []
    if info.get("phase") and info["state"] == "RUNNING":
        bits.append(f"phase {info['phase']}")
    if isinstance(info.get("reward"), (int, float)) and (info.get("progress") or {}).get("reward_last") is None:
        bits.append(f"reward {info['reward']:.3f}")  # state.json's, where metrics.jsonl gave none
    if info.get("attempt"):
        bits.append(f"attempt {info['attempt']}")
    if info.get("restarts"):
        bits.append(f"{info['restarts']} step restart(s)")
    health = info.get("health") if isinstance(info.get("health"), dict) else {}
    if health.get("role_restarts"):
        bits.append(f"{health['role_restarts']} role restart(s) alone")
    last = (health.get("recoveries") or [None])[-1]
    if isinstance(last, dict):
        took = last.get("recovery_s")
        bits.append(f"last recovery: {last.get('tier')} tier ({last.get('role')}), "
                    + (f"{took:.1f}s" if isinstance(took, (int, float)) else "in progress"))
    ck = info.get("last_checkpoint")
    if isinstance(ck, dict) and ck.get("step") is not None:
        bits.append(f"last checkpoint step {ck['step']}")
    if info.get("last_failure") and info.get("last_failure") != info.get("reason"):
        bits.append(f"last failure: {info['last_failure']}")
    return "  ".join(bits)


def signature(info: dict) -> tuple:
    """What makes a status worth printing again (not clocks: time left, heartbeat ages, estimates)."""
    comps = tuple((c.get("label"), c.get("state"), c.get("reason"), c.get("nodes")) for c in info["components"])
    roles = tuple((n, r.get("phase"), r.get("error")) for n, r in info["roles"].items())
    return (info["state"], info.get("reason"), info.get("step"), info.get("controller_state"), comps, roles)


def summary_line(info: dict) -> str:
    """One line for output that is not a terminal (logs, CI): the run, its state, :func:`progress_fields`, each
    role's phase, the last failure."""
    phases = " ".join(f"{n}={r.get('phase') or '-'}" for n, r in info["roles"].items())
    failure = f"last failure: {info['last_failure']}" if info.get("last_failure") else ""
    return "  ".join(x for x in (f"{info['run']} {info['state']}", *progress_fields(info), phases, failure) if x)


# ------------------------------------------------------------------------------------------- audit ---

def consuming_tasks(recipe: Any) -> list[str]:
    """The exchange tasks of the training loop: ``train``, plus the forward roles with work to do
    (``reference`` with ``algorithm.use_kl_loss`` when enabled: with LoRA and no reference role the actor computes
    π_ref itself; ``actor_fwd`` when enabled), as the loop derives them."""
    ref = recipe.algorithm.use_kl_loss and recipe.roles.reference.enabled
    return ["train"] + [r for r, on in (("reference", ref),
                                        ("actor_fwd", recipe.roles.actor_fwd.enabled)) if on]


def audit_run(rd: RunDir) -> dict:
    """``relax-status RUN --audit``: the exchange journal's account of every sample, per step: produced,
    consumed by each task, chunks quarantined; ``exactly_once`` is true only when every sample was produced
    once and consumed once by every task (a run still in progress is not there yet). And of every prompt, per
    epoch of the dataset: how many were trained, and which more than once; ``prompts_once`` is true only when
    none was."""
    from relax_hpc.exchange.audit import audit, epochs, exactly_once, prompt_violations

    journal = rd.path / "exchange" / "journal.jsonl"
    for f in (rd.recipe, journal):
        if f.exists() and not is_regular(f):  # a FIFO would hang the read
            raise RunFileError(f, "is not a regular file")
    tasks = consuming_tasks(load_recipe(rd.recipe))
    if not journal.exists():
        return {"run": rd.name, "journal": str(journal), "tasks": tasks, "exactly_once": False, "steps": [],
                "prompts_once": False, "epochs": [], "unrecorded_chunks": 0,
                "violations": [f"{journal} does not exist: no step was generated yet"]}
    violations = exactly_once(journal, tasks)
    steps = [{"step": s, "produced": a.samples, "consumed": {t: a.consumed.get(t, 0) for t in tasks},
              "quarantined": list(a.quarantined), "regenerated": a.regenerated, "lost": a.lost,
              "rewinds": a.rewinds, "cleared": a.cleared, "forced": a.forced}
             for s, a in sorted(audit(journal).items())]
    per_epoch, unrecorded = epochs(journal)
    twice = prompt_violations(per_epoch)
    return {"run": rd.name, "journal": str(journal), "tasks": tasks, "exactly_once": not violations,
            "steps": steps, "prompts_once": not twice, "unrecorded_chunks": unrecorded,
            "epochs": [{"epoch": e, "prompts": a.prompts, "trained": a.trained, "twice": a.twice}
                       for e, a in sorted(per_epoch.items())],
            "violations": violations + twice}


def render_audit(info: dict) -> RichGroup:
    t = Table(title=f"exchange audit of {info['run']}", title_justify="left")
    for col in ("step", "produced", *[f"consumed by {x}" for x in info["tasks"]], "quarantined", "cleared"):
        t.add_column(col)
    for s in info["steps"]:
        q = ", ".join(c.split("/")[-1] for c in s["quarantined"])
        if s["regenerated"]:
            q += f" (generated again: {s['regenerated']}×)"
        t.add_row(str(s["step"]), str(s["produced"]), *[str(s["consumed"][x]) for x in info["tasks"]], q or "-",
                  "yes" if s["cleared"] else "no")
    e = Table(title="prompts trained per epoch of the dataset", title_justify="left")
    for col in ("epoch", "prompts", "trained", "more than once"):
        e.add_column(col)
    for a in info["epochs"]:
        e.add_row(str(a["epoch"]), str(a["prompts"]), str(a["trained"]), str(len(a["twice"])) if a["twice"] else "-")
    ok = info["exactly_once"] and info["prompts_once"]
    unrecorded = (f"\n{info['unrecorded_chunks']} trained chunk(s) name no prompts (written by an older version): "
                  "not counted" if info["unrecorded_chunks"] else "")
    verdict = (Text("exactly once: yes" + unrecorded, style="green") if ok else
               Text("exactly once: no\n" + "\n".join(f"  {v}" for v in info["violations"]) + unrecorded,
                    style="bold red"))
    return RichGroup(t, e, verdict)
