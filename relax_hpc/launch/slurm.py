"""What the Slurm cluster says: ``sinfo``/``squeue``/``sacct`` in JSON, ``scancel``, and Slurm's own words for states.

Why one module: every call to a Slurm client goes through :func:`run` (argument lists, never a shell, a
timeout, stderr in the error), and the quirks of Slurm 22.05 are handled once, here:

* ``squeue --json`` ignores ``-j`` and lists every job (recently finished ones too), so we filter ourselves.
* ``sinfo --json`` lists nodes but not partitions; the default partition comes from ``sinfo -o %P``.
* ``sacct`` is eventually consistent (right after a job ends it may not know it yet): callers must poll.
* A het job is one record per component (``123+0``, ``123+1``); its state is :func:`aggregate_state`.

Polite to the scheduler (docs/slurm.md): a job's state comes from ONE ``squeue`` of all the user's jobs
(:func:`user_queue`), kept for :data:`CACHE_S` seconds in a per-user cache on this node (:func:`cached`) that every
process of the user shares (relax-status of many runs, ``--watch``, a sweep); ``sacct`` is asked only about the jobs
squeue no longer lists, all of them in one call. Where the JSON forms are missing (Slurm < 21.08, or a site without
the data_parser plugin), the formatted output (``--format``/``--parsable2``) is read instead (:func:`json_ok`).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Any

ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT")
# Finished states, worst first: the state a het job reports when its components ended differently.
FINISHED_BY_SEVERITY = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "TIMEOUT",
                        "CANCELLED", "PREEMPTED", "REVOKED", "COMPLETED")
FINISHED_STATES = frozenset(FINISHED_BY_SEVERITY)


class SlurmError(RuntimeError):
    """A Slurm client failed or printed something we cannot read; ``returncode``: the client's exit status
    (negative: killed by that signal), None when it never ran or answered."""

    def __init__(self, msg: str, returncode: int | None = None):
        super().__init__(msg)
        self.returncode = returncode


def have_sbatch() -> bool:
    return shutil.which("sbatch") is not None


def run(argv: list[str], timeout: float = 60) -> str:
    """Run a Slurm client; its stdout, or :class:`SlurmError` with its stderr."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: not found on PATH (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)}: no answer in {timeout:.0f} s (is slurmctld up?)") from None
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip()
        raise SlurmError(f"{' '.join(argv)} failed (exit {p.returncode}): {msg}", p.returncode)
    return p.stdout


def run_json(argv: list[str], timeout: float = 60) -> dict:
    """A client's JSON; squeue's and sacct's through this user's cache (:func:`cached`)."""
    return _loads(argv, cached(argv, CACHE_S, timeout) if argv[0] in ("squeue", "sacct") else run(argv, timeout))


def _loads(argv: list[str], out: str) -> dict:
    try:
        return json.loads(out)
    except json.JSONDecodeError as e:
        raise SlurmError(f"{' '.join(argv)}: output is not JSON ({e}); Slurm ≥ 21.08 is needed", 0) from None


def state_word(state: Any) -> str:
    """Slurm's state as one upper-case word: 'CANCELLED by 0' → CANCELLED, {'current': 'RUNNING'} → RUNNING."""
    if isinstance(state, dict):
        state = state.get("current", "")
    if isinstance(state, list):  # newer Slurm prints ["RUNNING", "COMPLETING"]
        state = state[0] if state else ""
    word = str(state or "UNKNOWN").split()[0].upper()
    return word.rstrip("+")


def aggregate_state(states: list[str]) -> str:
    """The state of a het job from its components' states (leader first).

    While any component is active the job is active: the leader's state if it is, else the first active one.
    Once all have ended, the worst ending wins (one FAILED component makes the job FAILED)."""
    words = [state_word(s) for s in states]
    if not words:
        return "UNKNOWN"
    active = [w for w in words if w not in FINISHED_STATES]
    if active:
        return words[0] if words[0] not in FINISHED_STATES else active[0]
    return min(words, key=FINISHED_BY_SEVERITY.index)


def is_finished(state: str) -> bool:
    return state_word(state) in FINISHED_STATES


# --------------------------------------------------------------------------------------------- time ---

_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def parse_time(text: str) -> int:
    """Slurm time syntax → seconds: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"not a Slurm time: {text!r}")
    d, a, b, c = (int(x) if x is not None else None for x in m.group("d", "a", "b", "c"))
    if d is not None:
        return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    if b is not None:
        return a * 60 + b
    return a * 60


def format_seconds(s: float | None) -> str:
    if s is None:
        return "UNLIMITED"
    s = max(0, int(s))
    d, rest = divmod(s, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{d}-{text}" if d else text


# -------------------------------------------------------------------------------------------- sinfo ---

@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    cpus: int
    gpus: int
    memory_mb: int
    state: str


def parse_gres_gpus(gres: str | None) -> int:
    """GPU count in a node's GRES string: 'gpu:4', 'gpu:a100:4(S:0-1)', 'gpu:a100:2,gpu:v100:2' → 4, 4, 4."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        item = re.sub(r"\(.*\)$", "", item.strip())
        parts = item.split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        try:
            total += int(parts[-1])
        except ValueError:
            total += 1  # 'gpu:a100' with no count means one
    return total


def sinfo_nodes() -> list[Node]:
    data = run_json(["sinfo", "--json"])
    nodes = []
    for n in data.get("nodes", []):
        nodes.append(Node(
            name=n.get("name", "?"),
            partitions=tuple(n.get("partitions") or ()),
            cpus=int(n.get("cpus") or 0),
            gpus=parse_gres_gpus(n.get("gres")),
            memory_mb=int(n.get("real_memory") or 0),
            state=str(n.get("state", "")).lower(),
        ))
    return nodes


def default_partition() -> str | None:
    """The cluster's default partition (``sinfo`` marks it with '*')."""
    for line in run(["sinfo", "-h", "-o", "%P"]).splitlines():
        if line.strip().endswith("*"):
            return line.strip()[:-1]
    return None


# -------------------------------------------------------------------------------------- squeue/sacct ---

@dataclass
class Component:
    """One het component (or a plain job) as squeue or sacct sees it."""

    het_job_id: int
    het_offset: int
    job_id: int  # the component's own id (what squeue -s / %j in srun patterns show)
    state: str
    reason: str | None
    nodes: str | None
    node_count: int | None
    partition: str | None
    name: str | None
    submit_time: int | None
    start_time: int | None
    end_time: int | None
    time_limit_s: int | None  # None: UNLIMITED
    restarts: int | None = None
    source: str = "squeue"
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.het_job_id}+{self.het_offset}"

    def time_left_s(self, now: float | None = None) -> int | None:
        now = time.time() if now is None else now
        if self.time_limit_s is None:
            return None
        if self.state == "RUNNING" and self.start_time:
            return max(0, int(self.start_time + self.time_limit_s - now))
        if self.state in FINISHED_STATES:
            return 0
        return self.time_limit_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["label"] = self.label
        d["time_left_s"] = self.time_left_s()
        return d


def _int(v: Any) -> int | None:
    if isinstance(v, dict):  # newer Slurm: {"set": true, "infinite": false, "number": 5}
        if not v.get("set", True) or v.get("infinite"):
            return None
        v = v.get("number")
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _reason(r: Any) -> str | None:
    r = str(r or "")
    return None if r in ("", "None", "none") else r


def _select(comps: list[Component], job_id: int, name: str | None) -> list[Component]:
    mine = [c for c in comps if c.het_job_id == job_id or (c.het_job_id == 0 and c.job_id == job_id)]
    if name is not None:  # job ids restart after a cluster reset: a foreign job may hold ours
        mine = [c for c in mine if c.name in (None, name)]
    for c in mine:
        if c.het_job_id == 0:
            c.het_job_id = c.job_id
    return sorted(mine, key=lambda c: c.het_offset)


# ------------------------------------------------------------------------------------- the cache ---

CACHE_ENV_S = "RELAX_SLURM_CACHE_S"  # a site's own period (seconds)
# one squeue/sacct answer serves every process of the user on this node for this long
CACHE_S = float(os.environ.get(CACHE_ENV_S, "") or 10.0) if re.fullmatch(
    r"\d+(\.\d*)?", os.environ.get(CACHE_ENV_S, "") or "10") else 10.0
JSON_ENV = "RELAX_SLURM_JSON"  # "0": read squeue/sacct's formatted output, as on a Slurm without --json
CACHE_ENV = "RELAX_SLURM_CACHE"  # "0": no cache across processes (each process asks for itself)
clock = time.time  # the cache's clock; tests put in a simulated one
_JSON_MISSING: set[str] = set()  # clients whose --json this process found missing


def cache_dir() -> Path | None:
    """This user's cache directory on this node, or None where it cannot be trusted.

    ``$XDG_RUNTIME_DIR/relax-hpc`` (a per-user tmpfs) or else ``/tmp/relax-<uid>``. Trusted only if it is a real
    directory (not a link), owned by us, with no access for anyone else: in a shared /tmp another user could
    create ``/tmp/relax-<uid>`` first and feed us a job's state."""
    uid = os.geteuid()
    base = os.environ.get("XDG_RUNTIME_DIR")
    # a batch job may inherit the login node's XDG_RUNTIME_DIR, missing on its compute node: then /tmp
    tries = [Path(base) / "relax-hpc"] if base and Path(base).is_absolute() and os.path.isdir(base) else []
    for path in [*tries, Path(tempfile.gettempdir()) / f"relax-{uid}"]:
        try:
            path.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
            return None  # someone else's, or open to others: no cache rather than a cache they can feed
        return path
    return None


def _own_file(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _read_cache(path: Path, argv: list[str], max_age: float) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not _own_file(fd):  # another user's file, or a FIFO: never read
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            doc = json.loads(f.read(64 << 20))
        age = clock() - float(doc["at"])
        if doc.get("argv") != argv or not 0 <= age <= max_age or not isinstance(doc.get("out"), str):
            return None
        return doc["out"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


def _write_cache(d: Path, path: Path, argv: list[str], out: str) -> None:
    """Atomically (a private temporary file, then rename): a reader sees the old answer or the new, never half."""
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"argv": argv, "at": clock(), "out": out}, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)


def cached(argv: list[str], max_age: float = CACHE_S, timeout: float = 60) -> str:
    """:func:`run`'s stdout, answered from this user's cache on this node while younger than ``max_age`` s.

    Keyed by the user, the command, the client and the cluster; processes asking at once take turns (a lock), so the second reads the
    first's answer instead of asking too. Failures are not kept. No trusted directory (:func:`cache_dir`) or
    ``RELAX_SLURM_CACHE=0``: :func:`run` itself."""
    d = cache_dir() if os.environ.get(CACHE_ENV) != "0" else None
    if d is None:
        return run(argv, timeout)
    # the same question to another client binary or another cluster (SLURM_CONF) is another question
    where = [shutil.which(argv[0]), os.environ.get("SLURM_CONF"), os.environ.get("SLURM_CLUSTERS")]
    key = hashlib.sha256(json.dumps([os.geteuid(), argv, where]).encode()).hexdigest()[:32]
    path = d / f"{key}.json"
    out = _read_cache(path, argv, max_age)
    if out is not None:
        return out
    try:
        lock = os.open(d / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return run(argv, timeout)
    try:
        if not _own_file(lock):
            return run(argv, timeout)
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = _read_cache(path, argv, max_age)  # asked while we waited for the lock
        if out is None:
            out = run(argv, timeout)
            _write_cache(d, path, argv, out)
        return out
    finally:
        os.close(lock)  # releases the lock


def json_ok(client: str) -> bool:
    """Whether to ask ``client`` (squeue, sacct) for JSON: not with ``RELAX_SLURM_JSON=0``, nor once it refused."""
    return os.environ.get(JSON_ENV, "1") != "0" and client not in _JSON_MISSING


def _no_json(e: Exception) -> bool:
    """Does this failure of ``--json`` mean the client has no JSON form (not that Slurm is down)?"""
    text = str(e).lower()
    return isinstance(e, SlurmError) and e.returncode is not None and (
        "not json" in text or "unrecognized option" in text or "invalid option" in text or "unknown option" in text
        or "data_parser" in text or "serializ" in text or "plugin" in text and "json" in text)


def _ask(client: str, json_argv: list[str], text_argv: list[str], since: float | None = None) -> tuple[str, Any]:
    """("json", the document) or ("text", the formatted output): JSON where the client has it. ``since``: not
    from a cached answer older than that."""
    max_age = CACHE_S if since is None else max(0.0, min(CACHE_S, clock() - since))
    if json_ok(client):
        try:
            return "json", run_json(json_argv) if since is None else _loads(json_argv, cached(json_argv, max_age))
        except SlurmError as e:
            if not _no_json(e):
                raise
            _JSON_MISSING.add(client)  # an older Slurm: its formatted output from now on
    return "text", cached(text_argv, max_age)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.geteuid())


# ------------------------------------------------------------------------------------------ queries ---

# squeue --format: the component's own id, its label (J+K, or J), ..., the name last (it may hold the separator)
_SQUEUE_FORMAT = "%A|%i|%T|%r|%N|%D|%P|%V|%S|%e|%l|%j"
_SACCT_FIELDS = "JobIDRaw,JobID,State,Reason,NodeList,NNodes,Partition,Submit,Start,End,Timelimit,ExitCode,JobName"


def _stamp(text: str) -> int | None:
    """squeue/sacct's local time (2026-12-07T06:01:36) → seconds since the epoch; None for N/A, Unknown, None."""
    try:
        return int(datetime.fromisoformat(text.strip()).timestamp())
    except ValueError:
        return None


def _limit(text: str) -> int | None:
    try:
        return parse_time(text)
    except ValueError:
        return None  # UNLIMITED, Partition_Limit, INVALID


def _label(text: str) -> tuple[int, int] | None:
    """'5+1' → (5, 1); '5' → (0, 0) (a plain job: no het id); an array task or anything else → None."""
    m = re.fullmatch(r"(\d+)(?:\+(\d+))?", text.strip())
    if not m:
        return None
    return (int(m.group(1)), int(m.group(2))) if m.group(2) is not None else (0, 0)


def _squeue_json(data: dict) -> list[Component]:
    comps = []
    for j in data.get("jobs", []):
        limit = _int(j.get("time_limit"))
        comps.append(Component(
            het_job_id=_int(j.get("het_job_id")) or 0,
            het_offset=_int(j.get("het_job_offset")) or 0,
            job_id=_int(j.get("job_id")) or 0,
            state=state_word(j.get("job_state")),
            reason=_reason(j.get("state_reason")),
            nodes=j.get("nodes") or None,
            node_count=_int(j.get("node_count")),
            partition=j.get("partition") or None,
            name=j.get("name"),
            submit_time=_int(j.get("submit_time")),
            start_time=_int(j.get("start_time")),
            end_time=_int(j.get("end_time")),
            time_limit_s=None if limit is None else limit * 60,
            restarts=_int(j.get("restart_cnt")),
            source="squeue",
        ))
    return comps


def _squeue_text(out: str) -> list[Component]:
    comps = []
    for line in out.splitlines():
        f = line.split("|", 11)
        het = _label(f[1]) if len(f) == 12 else None
        if het is None or not f[0].strip().isdigit():
            continue
        comps.append(Component(
            het_job_id=het[0], het_offset=het[1], job_id=int(f[0]), state=state_word(f[2]),
            reason=_reason(f[3]), nodes=f[4].strip() or None, node_count=_int(f[5]), partition=f[6] or None,
            name=f[11], submit_time=_stamp(f[7]), start_time=_stamp(f[8]), end_time=_stamp(f[9]),
            time_limit_s=_limit(f[10]), source="squeue"))
    return comps


def _sacct_json(data: dict) -> list[Component]:
    comps = []
    for j in data.get("jobs", []):
        het = j.get("het") or {}
        t = j.get("time") or {}
        limit = _int(t.get("limit"))
        state = j.get("state") or {}
        comps.append(Component(
            het_job_id=_int(het.get("job_id")) or 0,
            het_offset=_int(het.get("job_offset")) or 0,
            job_id=_int(j.get("job_id")) or 0,
            state=state_word(state),
            reason=_reason(state.get("reason") if isinstance(state, dict) else None),
            nodes=None if j.get("nodes") in (None, "", "None assigned") else j.get("nodes"),
            node_count=_int(j.get("allocation_nodes")),
            partition=j.get("partition") or None,
            name=j.get("name"),
            submit_time=_int(t.get("submission")),
            start_time=_int(t.get("start")),
            end_time=_int(t.get("end")),
            time_limit_s=None if limit is None else limit * 60,
            source="sacct",
            extra={"exit_code": (j.get("exit_code") or {}).get("return_code")},
        ))
    return comps


def _sacct_text(out: str) -> list[Component]:
    comps = []
    for line in out.splitlines():
        f = line.split("|", 12)
        het = _label(f[1]) if len(f) == 13 else None
        if het is None or not f[0].strip().isdigit():
            continue  # a step's row (J.batch), an array task
        code = f[11].split(":")[0]
        comps.append(Component(
            het_job_id=het[0], het_offset=het[1], job_id=int(f[0]), state=state_word(f[2]),
            reason=_reason(f[3]), nodes=None if f[4] in ("", "None assigned") else f[4], node_count=_int(f[5]),
            partition=f[6] or None, name=f[12], submit_time=_stamp(f[7]), start_time=_stamp(f[8]),
            end_time=_stamp(f[9]), time_limit_s=_limit(f[10]), source="sacct",
            extra={"exit_code": int(code) if code.isdigit() else None}))
    return comps


def user_queue(since: float | None = None) -> list[Component]:
    """Every job of this user that squeue knows (running, pending, ended < MinJobAge ago): ONE query for all
    the runs a user watches, kept :data:`CACHE_S` s (:func:`cached`). Slurm 22.05's ``--json`` lists every user's
    jobs whatever the filter; the caller picks its own. ``since``: an answer from before then will not do (a job
    submitted then cannot be in it)."""
    user = _user()
    form, data = _ask("squeue", ["squeue", "--json", "--user", user],
                      ["squeue", "--noheader", "--states=all", "--user", user, "--format", _SQUEUE_FORMAT], since)
    return _squeue_json(data) if form == "json" else _squeue_text(data)


_wanted: set[int] = set()  # job ids this process will ask about: one sacct for all of them (want())


def want(job_ids: list[int | str]) -> None:
    """Say which jobs this process is about to ask about (relax-status --sweep's runs): the first that squeue
    has forgotten fetches sacct's records of all of them in one call."""
    _wanted.update(int(str(j).split("+")[0]) for j in job_ids if str(j).split("+")[0].isdigit())


def accounting(job_ids: list[int]) -> list[Component]:
    """sacct's records of ``job_ids`` (one call for all; may lag behind the end of a job: poll)."""
    ids = ",".join(str(j) for j in sorted(set(job_ids)))
    try:
        form, data = _ask("sacct", ["sacct", "--json", "-j", ids],
                          ["sacct", "--noheader", "--parsable2", "--allocations", "-j", ids,
                           "--format", _SACCT_FIELDS])
    except SlurmError as e:
        if "Nothing found" in str(e):
            return []
        raise
    return _sacct_json(data) if form == "json" else _sacct_text(data)


def squeue_job(job_id: int | str, name: str | None = None, submitted_at: float | None = None) -> list[Component]:
    """The components of ``job_id`` that squeue still knows (from :func:`user_queue`). Not there, though
    submitted less than :data:`CACHE_S` s ago: asked again, unless the answer is from after its submission."""
    comps = _select(user_queue(), int(job_id), name)
    if not comps and submitted_at is not None and clock() - submitted_at < CACHE_S:
        comps = _select(user_queue(since=submitted_at), int(job_id), name)
    return comps


def sacct_job(job_id: int | str, name: str | None = None) -> list[Component]:
    """The components of ``job_id`` in accounting (with every job :func:`want` named that squeue forgot too)."""
    others = [j for j in _wanted if j != int(job_id)]
    if others:
        live = {c.het_job_id or c.job_id for c in user_queue()}
        others = [j for j in others if j not in live]
    return _select(accounting([int(job_id), *others]), int(job_id), name)


def job_components(job_id: int | str, name: str | None = None, submitted_at: float | None = None) -> list[Component]:
    """squeue first (live, and knows pending reasons), then sacct for jobs squeue has forgotten. A job of
    another user (a shared runs directory) is not in our queue: sacct has it."""
    comps = squeue_job(job_id, name, submitted_at)
    if comps:
        return comps
    try:
        return sacct_job(job_id, name)
    except SlurmError:
        return []  # no accounting on this cluster: the caller falls back to the run's state.json


def scancel(job_id: int | str, signal: str | None = None) -> None:
    argv = ["scancel"] + ([f"--signal={signal}"] if signal else []) + [str(job_id)]
    run(argv)


def scontrol_requeue(job_id: int | str, restart_count: int | None = None) -> None:
    """Requeue a job (a het job: all its components, same id). Slurm kills the calling batch script at once.

    Called from inside the job, scontrol can be killed by the very teardown its request started (it is a
    process of the job) and then reports failure for a requeue Slurm accepted; a continuation job submitted
    on that report would run the run twice. So a failure counts only if the job's ``Restarts`` did not grow
    past ``restart_count`` (default: this job's ``SLURM_RESTART_COUNT``)."""
    try:
        run(["scontrol", "requeue", str(job_id)])
    except SlurmError:
        before = int(os.environ.get("SLURM_RESTART_COUNT") or 0) if restart_count is None else restart_count
        if job_restarts(job_id) > before:
            return
        raise


def job_restarts(job_id: int | str) -> int:
    """How many times Slurm requeued ``job_id`` (``scontrol show job``'s ``Restarts``; -1 if unknown)."""
    try:
        out = run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
    except SlurmError:
        return -1
    counts = [int(m) for m in re.findall(r"\bRestarts=(\d+)", out)]
    return max(counts) if counts else -1
