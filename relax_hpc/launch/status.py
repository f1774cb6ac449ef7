"""A run's status: what Slurm (or the local process) says, joined with what the controller wrote in ``state.json``.

Why both: Slurm knows the allocation (state per het component, nodes, time left, why it is pending) but not
training progress; the controller knows the step and each role's phase but not whether the job is still
queued, or was killed without a chance to write. The overall ``state`` is always in Slurm's words (PENDING,
RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...), for local runs too, so scripts need one vocabulary.
"""

from __future__ import annotations

import datetime as _dt
import time
from typing import Any

from rich.console import Group as RichGroup
from rich.table import Table
from rich.text import Text

from relax_hpc.launch import slurm
from relax_hpc.launch.backend import launcher_for
from relax_hpc.launch.runs import RunUnreadable, load_job
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


def _layout(rd: RunDir, state: dict) -> list[dict]:
    """Roles in het-group order from the run's recipe (or, if it cannot be read, from state.json)."""
    try:
        if not is_regular(rd.recipe):  # a FIFO in its place would hang the read
            raise FileNotFoundError(rd.recipe)
        recipe = load_recipe(rd.recipe)
        return [{"role": s.role, "het_group": s.het_group, "shared": s.shared, "nodes_requested": s.nodes,
                 "ntasks": s.ntasks} for s in role_steps(recipe)]
    except Exception:
        roles = state.get("roles") or {}
        return [{"role": name, "het_group": (r or {}).get("het_group"), "shared": None, "nodes_requested": None,
                 "ntasks": None} for name, r in roles.items()]


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
    layout = _layout(rd, ctl)
    ctl_roles = ctl.get("roles") or {}
    roles: dict[str, dict] = {}
    for entry in layout:
        r = dict(entry)
        r.update({k: v for k, v in (ctl_roles.get(entry["role"]) or {}).items() if k != "het_group"})
        hb = _epoch(r.get("last_heartbeat"))
        r["heartbeat_age_s"] = None if hb is None else round(now - hb, 1)
        roles[entry["role"]] = r
    if not components:  # local, or Slurm forgot the job: one entry per het group from the recipe
        for k in sorted({e["het_group"] for e in layout if e["het_group"] is not None}):
            components.append({"het_group": k, "label": backend.component_label(job, k), "state": overall,
                               "reason": None, "nodes": backend.component_nodes,
                               "source": source})
    for c in components:
        k = c.get("het_offset", c.get("het_group"))
        c["het_group"] = k
        c["roles"] = [e["role"] for e in layout if e["het_group"] == k]
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
        "engines": [{"name": name, **(info or {})} for name, info in (ctl.get("engines") or {}).items()],
        "judges": [{"name": name, **(info or {})} for name, info in (ctl.get("judges") or {}).items()],
        "teachers": [{"name": name, **(info or {})} for name, info in (ctl.get("teachers") or {}).items()],  # OPD
        "scale": list(ctl.get("scale") or []),  # relax-scale's operations, the newest last
        "logs": str(rd.logs),
    }


def is_final(info: dict) -> bool:
    return slurm.is_finished(info["state"])


# --------------------------------------------------------------------------------------- display ---

def _styled(state: Any) -> Text:
    s = str(state or "-")
    return Text(s, style=STATE_STYLE.get(slurm.state_word(s) if state else "UNKNOWN", ""))


def _cell(v: Any) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, (list, tuple)):
        return ",".join("?" if x is None else str(x) for x in v) or "-"
    return str(v)


def render(info: dict) -> RichGroup:
    """The rich view of :func:`collect`'s result (relax-status, and relax-submit's local progress view)."""
    step = "" if info.get("step") is None else f"  step {info['step']}/{info.get('total_steps') or '?'}"
    left = "" if not launcher_for(info["executor"]).time_limited or not info.get("components") else \
        f"  time left {slurm.format_seconds(info.get('time_left_s'))}"
    head = Text.assemble((info["run"], "bold"), f"  job {info['job_id']} ({info['executor']})  ",
                         _styled(info["state"]), step, left)
    parts: list[Any] = [head]
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
        roles.add_row(name, _cell(r.get("het_group")), _cell(r.get("phase")),
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
            engines.add_row(e["name"], _styled_engine(e), _cell(e.get("weight_version")), _cell(e.get("origin")),
                            _cell(e.get("node")), _cell(where), _cell(e.get("url")))
        parts += [Text(""), engines]
    if info.get("weights"):
        parts.append(Text(f"weights: {info['weights']}", style="dim"))
    for op in info.get("scale", [])[-3:]:
        job = f", job {op['job_id']}" if op.get("job_id") else ""
        parts.append(Text(f"scale {op['id']} {op['spec']} ({op['origin']}{job}): {op['state']}: {op.get('detail', '')}",
                          style="yellow" if op["state"] == "running" else "dim"))
    parts.append(Text(f"logs: {info['logs']}", style="dim"))
    return RichGroup(*parts)


def _styled_engine(e: dict) -> Text:
    state = str(e.get("state") or ("dead" if e.get("dead") else "-"))
    style = {"ready": "green", "dead": "red", "draining": "yellow", "syncing": "yellow", "starting": "yellow"}
    why = e.get("dead") or (e.get("left") if state == "gone" else None)
    return Text(state + (f" ({why})" if why else ""), style=style.get(state, ""))


def _life_line(info: dict) -> str:
    """Attempts, restarts, the last checkpoint and the last failure (recovered or not), on one line."""
    bits = []
    if info.get("phase") and info["state"] == "RUNNING":
        bits.append(f"phase {info['phase']}")
    if isinstance(info.get("reward"), (int, float)):
        bits.append(f"reward {info['reward']:.3f}")
    if info.get("attempt"):
        bits.append(f"attempt {info['attempt']}")
    if info.get("restarts"):
        bits.append(f"{info['restarts']} step restart(s)")
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
    """One line for terminals that are not interactive (logs, CI)."""
    phases = " ".join(f"{n}={r.get('phase') or '-'}" for n, r in info["roles"].items())
    step = "" if info.get("step") is None else f" step {info['step']}/{info.get('total_steps') or '?'}"
    return f"{info['run']} {info['state']}{step} {phases}".rstrip()


# ------------------------------------------------------------------------------------------- audit ---

def consuming_tasks(recipe: Any) -> list[str]:
    """The exchange tasks of the training loop: ``train``, plus the forward roles with work to do
    (``reference`` with ``algorithm.use_kl_loss``, ``actor_fwd`` when enabled), as the loop derives them."""
    return ["train"] + [r for r, on in (("reference", recipe.algorithm.use_kl_loss),
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
