"""``relax-doctor``: is this node, or every node of a partition, ready for a run? A table of checks, each failure
with its fix.

    relax-doctor [--run-dir DIR] [--partition P] [--json]              this machine
    relax-doctor --nodes N [--partition P] [--gpus-per-node G] ...    one task per node, as a Slurm job (srun)

Both end with the partition's answer to a heterogeneous job (``sbatch --test-only``: what ``slurm.layout: auto``
picks, :func:`choose_layout`).

The checks: Python and torch against relax_hpc's requirements, the CUDA driver/runtime and GPUs (skipped on a CPU
build of torch), NCCL, Transformer Engine (optional), SGLang in ``RELAX_SGLANG_PYTHON`` against the releases
relax_hpc speaks (:func:`relax_hpc.engines.client.update_protocol`), a free port, the interfaces NCCL would use,
and the run directory: a probe file written there from the submitting node must be the same file (inode, and the
token in it) from every node. Nothing of Megatron is imported; torch and TE only inside their checks.

:func:`submit_problems` is the part ``relax-submit`` runs in its preflight: milliseconds, and right on a login node.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import platform
import re
import secrets
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relax_hpc.engines.client import OLDEST_SGLANG, SESSION_SGLANG, update_protocol
from relax_hpc.launch import slurm
from relax_hpc.launch.layouts import het_jobs_allowed
from relax_hpc.launch.runs import DEFAULT_RUNS_ROOT

OK, FAIL, WARN, SKIP = "ok", "fail", "warn", "skip"
STYLE = {OK: "green", FAIL: "bold red", WARN: "yellow", SKIP: "dim"}
SGLANG_ENV = "RELAX_SGLANG_PYTHON"
SUPPORTED_SGLANG = f"{'.'.join(map(str, OLDEST_SGLANG))}+ (tested: {'.'.join(map(str, SESSION_SGLANG))})"
PROBE_PREFIX = ".relax-doctor-"
_VERSION_SCRIPT = "import importlib.metadata as m; print(m.version('sglang'))"  # metadata only: no sglang import


@dataclass
class Check:
    """One check's result on one node. ``fix`` is empty unless the status is fail or warn."""

    name: str
    status: str
    detail: str
    fix: str = ""
    node: str = ""


def _pinned(name: str) -> str | None:
    """The ``==`` version relax_hpc's metadata requires of ``name`` (setup.cfg), or None."""
    try:
        reqs = md.requires("relax_hpc") or []
    except md.PackageNotFoundError:
        return None
    for r in reqs:
        m = re.match(rf"^{re.escape(name)}\s*==\s*([^\s;,]+)", r)
        if m:
            return m.group(1)
    return None


# ---- checks of this node ----

def check_python() -> Check:
    v = sys.version_info
    text = f"{platform.python_version()} ({sys.executable})"
    if v < (3, 11):
        return Check("python", FAIL, text, "relax_hpc needs Python 3.11+: make the venv from a newer python3")
    return Check("python", OK, text)


def check_torch() -> Check:
    want = _pinned("torch")
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken install is a finding, not a crash
        return Check("torch", FAIL, f"does not import: {e}", "tools/install (CPU) or tools/install --gpu")
    v = torch.__version__
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    if want and v.split("+")[0] != want:
        return Check("torch", FAIL, f"{v} ({build}); relax_hpc pins {want}",
                     f"tools/install{' --gpu' if torch.version.cuda else ''} (installs torch {want})")
    return Check("torch", OK, f"{v} ({build})")


def _driver() -> str | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.splitlines()[0].strip() if p.returncode == 0 and p.stdout.strip() else None


def check_cuda() -> Check:
    try:
        import torch
    except Exception:  # noqa: BLE001 - said by check_torch
        return Check("cuda", SKIP, "torch does not import")
    if not torch.version.cuda:
        return Check("cuda", SKIP, "torch is a CPU build (on a GPU node: tools/install --gpu)")
    driver = _driver()
    if not torch.cuda.is_available():
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        return Check("cuda", FAIL, f"runtime {torch.version.cuda}, driver {driver or 'not found (nvidia-smi)'}, "
                     f"no device visible (CUDA_VISIBLE_DEVICES={vis!r})",
                     "run on a GPU node and ask Slurm for its GPUs (--gpus-per-node); a driver older than the "
                     "runtime needs a torch built for an older CUDA")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    kinds = ", ".join(f"{names.count(n)}× {n}" for n in dict.fromkeys(names))
    totals = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    return Check("cuda", OK, f"runtime {torch.version.cuda}, driver {driver or '?'}, {kinds}; {gpu_memory_key(totals)}")


def gpu_memory_key(totals: list[int]) -> str:
    """The recipe line for the memory plan (``slurm.gpu_memory_gb``, GiB) from the cards' total bytes: the smallest
    card's, rounded down to 0.1 GiB, so a plan that fits it fits every card of the node."""
    if not totals:
        return "no card: slurm.gpu_memory_gb unknown"
    return f"recipe: slurm.gpu_memory_gb: {math.floor(min(totals) / (1 << 30) * 10) / 10:g}"


def check_nccl() -> Check:
    try:
        import torch
    except Exception:  # noqa: BLE001
        return Check("nccl", SKIP, "torch does not import")
    if not torch.version.cuda:
        return Check("nccl", SKIP, "CPU build of torch (gloo only)")
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001
        return Check("nccl", FAIL, f"torch has no NCCL: {e}", "tools/install --gpu (the nvidia-nccl wheel)")
    return Check("nccl", OK, ".".join(map(str, v)) if isinstance(v, tuple) else str(v))


def check_te() -> Check:
    if importlib.util.find_spec("transformer_engine") is None:
        return Check("transformer_engine", SKIP, "not installed (optional: megatron-core falls back to torch; "
                     "tools/install --gpu --te)")
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # noqa: BLE001 - present but broken: built against another torch, common on clusters
        return Check("transformer_engine", FAIL, f"installed but does not import: {str(e)[:200]}",
                     "reinstall it against this torch (tools/install --gpu --te), or uninstall it")
    return Check("transformer_engine", OK, getattr(te, "__version__", "?"))


def sglang_version(python: str, timeout: float = 30) -> str:
    """The SGLang release installed for ``python`` (its metadata; SGLang itself is not imported).
    :class:`ValueError` naming why not."""
    try:
        p = subprocess.run([python, "-c", _VERSION_SCRIPT], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"{python} does not run: {e}") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        raise ValueError(f"{python} has no sglang ({last})")
    return p.stdout.strip()


def sglang_finding(version: str) -> tuple[str, str, str]:
    """(status, detail, fix) of an SGLang release against the range relax_hpc speaks."""
    try:
        protocol = update_protocol(version)
    except ValueError:
        return FAIL, f"SGLang {version}: older than {SUPPORTED_SGLANG}", \
            "tools/install --gpu --sglang DIR (a supported release), then export RELAX_SGLANG_PYTHON=DIR/bin/python"
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", version)
    if m and tuple(int(x) for x in m.groups()) > SESSION_SGLANG:
        return WARN, f"SGLang {version}: newer than the release relax_hpc follows ({SUPPORTED_SGLANG})", \
            "works if its update API is unchanged; tools/install --gpu --sglang DIR installs the tested one"
    return OK, f"SGLang {version} ({protocol} weight updates)", ""


def check_sglang(python: str | None = None) -> Check:
    python = python if python is not None else os.environ.get(SGLANG_ENV)
    if not python:
        return Check("sglang", SKIP, f"{SGLANG_ENV} not set: engines are relax_hpc's reference engine")
    bad = _not_executable(python)
    if bad:
        return Check("sglang", FAIL, f"{SGLANG_ENV}={python}: {bad}", _SGLANG_FIX)
    try:
        version = sglang_version(python)
    except ValueError as e:
        return Check("sglang", FAIL, str(e), _SGLANG_FIX)
    status, detail, fix = sglang_finding(version)
    return Check("sglang", status, detail, fix)


_SGLANG_FIX = "tools/install --gpu --sglang DIR (on a GPU node; --sglang alone: the CPU layer for the contract tests), then export RELAX_SGLANG_PYTHON=DIR/bin/python (or source DIR/relax-sglang.env)"


def _not_executable(path: str) -> str | None:
    p = Path(path)
    if not p.exists():
        return "no such file"
    if p.is_dir():
        return "a directory, not an interpreter"
    if not os.access(p, os.X_OK):
        return "not executable"
    return None


def check_port() -> Check:
    """A port the kernel hands out (what every relax_hpc server binds) can be bound on all interfaces."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", 0))
            s.listen(1)
    except OSError as e:
        return Check("ports", FAIL, f"cannot bind a free TCP port: {e}",
                     "free ports (ip_local_port_range, ss -tan), or ask the admins about this node")
    lo_hi = _read("/proc/sys/net/ipv4/ip_local_port_range")
    return Check("ports", OK, "a free TCP port binds" + (f" (range {' - '.join(lo_hi.split())})" if lo_hi else ""))


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def nccl_interfaces(spec: str | None, ifaces: dict[str, list[str]]) -> list[str]:
    """The interfaces NCCL's socket transport would pick from ``ifaces`` (up ones, name → addresses): those
    ``NCCL_SOCKET_IFNAME`` names (prefixes; ``=`` exact names; ``^`` excludes), else all but lo* and docker*."""
    if not spec:
        return [n for n in ifaces if not n.startswith(("lo", "docker"))]
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]

    def hit(i: str) -> bool:
        return any(i == n if exact else i.startswith(n) for n in names)

    return [i for i in ifaces if hit(i) != exclude]


def _up_interfaces() -> dict[str, list[str]]:
    import psutil

    stats, addrs = psutil.net_if_stats(), psutil.net_if_addrs()
    return {n: [a.address for a in addrs.get(n, []) if a.family in (socket.AF_INET, socket.AF_INET6)]
            for n, st in stats.items() if st.isup}


def check_interfaces(spec: str | None = None) -> Check:
    spec = spec if spec is not None else os.environ.get("NCCL_SOCKET_IFNAME")
    ifaces = _up_interfaces()
    picked = [n for n in nccl_interfaces(spec, ifaces) if ifaces[n]]
    where = f"NCCL_SOCKET_IFNAME={spec}" if spec else "NCCL_SOCKET_IFNAME unset"
    if not picked:
        others = ", ".join(f"{n} ({' '.join(a[:1])})" for n, a in ifaces.items() if a) or "none"
        return Check("network", FAIL, f"{where}: no interface that is up with an address matches",
                     f"set NCCL_SOCKET_IFNAME to this node's fabric interface; up here: {others}")
    v4 = {n: [a for a in ifaces[n] if ":" not in a][:1] or ifaces[n][:1] for n in picked}
    return Check("network", OK, f"{where}: " + ", ".join(f"{n} {' '.join(a)}" for n, a in v4.items()))


def write_probe(root: str | Path, create: bool = False) -> dict[str, Any]:
    """A fresh probe file in ``root``: path, token, and (dev, ino) as this node sees it. A missing ``root`` is a
    DoctorError naming it (a typo must not make a directory and pass), unless ``create`` (the default runs root,
    which relax-submit makes anyway)."""
    root = Path(root).absolute()
    if create:
        root.mkdir(parents=True, exist_ok=True)
    elif not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise DoctorError(f"--run-dir {root} {what}. Fix: give the runs root your recipes use (run.runs_root), as "
                          f"it is on this node, or leave --run-dir out for {DEFAULT_RUNS_ROOT}")
    token = secrets.token_hex(8)
    path = root / f"{PROBE_PREFIX}{token}"
    path.write_text(token)
    st = path.stat()
    return {"path": str(path), "token": token, "dev": st.st_dev, "ino": st.st_ino}


def look_at_probe(path: str, token: str) -> dict[str, Any]:
    """What this node sees at ``path``: {"found", "same_token", "dev", "ino", "error"}."""
    try:
        st = os.stat(path)
        text = Path(path).read_text()
    except OSError as e:
        return {"found": False, "same_token": False, "dev": None, "ino": None, "error": e.strerror or str(e)}
    return {"found": True, "same_token": text == token, "dev": st.st_dev, "ino": st.st_ino, "error": None}


def check_filesystem(probe: dict[str, Any], seen: dict[str, Any]) -> Check:
    """The run directory's probe as one node saw it (``seen``), against the writer's (``probe``)."""
    root = str(Path(probe["path"]).parent)
    fix = (f"put runs on a filesystem every node mounts at the same path (recipe run.runs_root, "
           f"relax-doctor --run-dir); {root} is not one")
    if not seen["found"]:
        return Check("run dir", FAIL, f"{root}: the probe written by the submitting node is not there "
                     f"({seen['error']})", fix)
    if not seen["same_token"] or seen["ino"] != probe["ino"]:
        return Check("run dir", FAIL, f"{root}: another file at the probe's path (inode {seen['ino']}, "
                     f"written {probe['ino']})", fix)
    dev = "" if seen["dev"] == probe["dev"] else f", device {seen['dev']} here vs {probe['dev']} (a network mount)"
    return Check("run dir", OK, f"{root}: the same file (device {probe['dev']}, inode {probe['ino']}){dev}")


def local_checks(probe: dict[str, Any] | None = None) -> list[Check]:
    """Every check on this node; the run directory's against ``probe`` (written by the submitting node)."""
    host = socket.gethostname()
    checks = [check_python(), check_torch(), check_cuda(), check_nccl(), check_te(), check_sglang(),
              check_port(), check_interfaces()]
    if probe is not None:
        checks.append(check_filesystem(probe, look_at_probe(probe["path"], probe["token"])))
    for c in checks:
        c.node = os.environ.get("SLURMD_NODENAME") or host
    return checks


# ---- the same on N nodes ----

class DoctorError(RuntimeError):
    """The doctor itself could not run (Slurm refused the job, a task's output unreadable)."""


def partition_nodes(partition: str | None) -> list[slurm.Node]:
    """The nodes of ``partition`` (the cluster's default one if None), from ``sinfo``."""
    part = partition or slurm.default_partition()
    return [n for n in slurm.sinfo_nodes() if part in n.partitions]


def srun_argv(nodes: int, partition: str | None, gpus: int, probe: dict[str, Any], time_min: int = 5) -> list[str]:
    argv = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--job-name=relax-doctor",
            f"--time={time_min}", "--kill-on-bad-exit=0"]
    if partition:
        argv.append(f"--partition={partition}")
    if gpus:
        argv.append(f"--gpus-per-node={gpus}")
    return argv + [sys.executable, "-m", "relax_hpc.launch.doctor", "--node-task",
                   json.dumps(probe, separators=(",", ":"))]


def cluster_checks(nodes: int, partition: str | None, gpus: int | None, run_dir: str,
                   timeout: float = 900) -> list[Check]:
    """:func:`local_checks` on ``nodes`` nodes (one srun task each), the run directory's probe written here."""
    have = partition_nodes(partition)
    if have and nodes > len(have):  # srun would wait for ever (a partition not known: srun itself says so)
        raise DoctorError(f"--nodes {nodes}: the partition has {len(have)} node(s). Fix: ask for at most {len(have)}")
    if gpus is None:  # all of the smallest node's, so that its cgroup shows them to the task
        gpus = min((n.gpus for n in have), default=0)
    probe = write_probe(run_dir)
    try:
        argv = srun_argv(nodes, partition, gpus, probe)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise DoctorError("srun not found on PATH (is this a Slurm login node?)") from None
        except subprocess.TimeoutExpired:
            raise DoctorError(f"the doctor's job did not finish in {timeout:.0f} s (squeue -n relax-doctor)") from None
    finally:
        Path(probe["path"]).unlink(missing_ok=True)
    checks = []
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            try:
                checks.append(Check(**json.loads(line)))
            except (ValueError, TypeError):
                raise DoctorError(f"a task's output is not a check: {line[:200]!r}") from None
    hosts = {c.node for c in checks}
    if p.returncode != 0 or len(hosts) < nodes:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise DoctorError(f"{' '.join(argv[:-5])} …: {len(hosts)} of {nodes} node(s) answered "
                          f"(exit {p.returncode}): {err}")
    return checks


# ---- heterogeneous jobs: does the site take them? (slurm.layout) ----

def check_hetjobs(partition: str | None = None) -> Check:
    """relax-doctor's line for ``slurm.layout``: whether the partition takes het jobs."""
    v = het_jobs_allowed(partition)
    if v.allowed is None:
        return Check("het jobs", SKIP if not slurm.have_sbatch() else WARN, v.detail,
                     "" if not slurm.have_sbatch() else "check slurm.partition / slurm.account (sinfo, sacctmgr)")
    if not v.allowed:
        return Check("het jobs", WARN, v.detail, "runs go as one allocation: slurm.layout: single (auto does it)")
    return Check("het jobs", OK, v.detail + "; slurm.layout: auto -> hetjob")


# ---- relax-submit's preflight ----

def submit_problems(recipe: Any, executor: str) -> list[tuple[str, object, str]]:
    """The doctor's checks that cost milliseconds and cannot be wrong on a login node: ``RELAX_SGLANG_PYTHON``
    (from ``slurm.env``, else this environment), when set, names something that cannot run (on Slurm: exists here
    but is not executable; locally: also missing), and, when ``rollout.engine.kind`` is ``sglang``, an SGLang
    release outside the range relax_hpc speaks (its metadata, read by that interpreter: tens of ms).
    (key, value, message with fix) triples. Unset is no finding: the steps may get it elsewhere."""
    from relax_hpc.launch.tools import launcher_for

    kind = recipe.rollout.engine.kind
    if kind == "reference":
        return []
    in_recipe = SGLANG_ENV in recipe.slurm.env
    python = recipe.slurm.env.get(SGLANG_ENV) if in_recipe else os.environ.get(SGLANG_ENV)
    key = f"slurm.env.{SGLANG_ENV}" if in_recipe else f"${SGLANG_ENV} (environment)"
    if not python:  # may be set where the steps run (a container's env, a site module): not wrong for sure
        return []
    bad = _not_executable(python)
    if bad == "no such file" and not launcher_for(executor).steps_here:
        return []  # may exist on the compute nodes only: relax-doctor --nodes N looks there
    if bad:
        return [(key, python, f"{bad}: engines could not start. Fix: {_SGLANG_FIX}")]
    if kind != "sglang":
        return []
    try:
        version = sglang_version(python, timeout=10)
    except ValueError as e:
        return [(key, python, f"{e}. Fix: {_SGLANG_FIX}")]
    status, detail, fix = sglang_finding(version)
    if status == FAIL:
        return [("rollout.engine.kind", kind, f"{key}={python}: {detail}. Fix: {fix}")]
    return []


# ---- the command ----

def render(checks: list[Check]) -> Any:
    """A rich table: one row per check and result, the nodes that share it together."""
    from rich.table import Table
    from rich.text import Text

    rows: dict[tuple, list[str]] = {}
    for c in checks:
        rows.setdefault((c.name, c.status, c.detail, c.fix), []).append(c.node)
    t = Table(header_style="bold", show_lines=False)
    for col in ("check", "node(s)", "status", "detail", "fix"):
        t.add_column(col, overflow="fold")
    for (name, status, detail, fix), hosts in rows.items():
        t.add_row(name, ",".join(sorted(hosts)), Text(status, style=STYLE[status]), Text(detail), Text(fix))
    return t


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="relax-doctor", description="Check this node, or N nodes of a Slurm "
                                 "partition, before a run: a table of checks, each failure with its fix.")
    ap.add_argument("--nodes", type=int, default=0, help="run as a Slurm job on N nodes (one task each)")
    ap.add_argument("--partition", help="the partition for --nodes and the het-job check (default: the cluster's "
                    "default)")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs each task asks for (default: all of the partition's smallest node)")
    ap.add_argument("--run-dir", default=None,
                    help=f"the runs root to check, an existing directory (recipe run.runs_root; default "
                         f"{DEFAULT_RUNS_ROOT}, made if missing)")
    ap.add_argument("--json", action="store_true", help="print the checks as JSON")
    ap.add_argument("--node-task", help=argparse.SUPPRESS)  # one srun task: the probe, as JSON
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when no check failed, 1 when one did, 2 when the doctor could not run."""
    args = _parser().parse_args(argv)
    if args.node_task:  # one short line per check: srun interleaves the tasks' output, but not within a line
        for c in local_checks(json.loads(args.node_task)):
            print(json.dumps(asdict(c)), flush=True)
        return 0
    try:
        if args.run_dir is None:  # the default runs root: made, as relax-submit would; a given one must exist
            Path(DEFAULT_RUNS_ROOT).mkdir(parents=True, exist_ok=True)
        run_dir = args.run_dir or DEFAULT_RUNS_ROOT
        if args.nodes > 0:
            checks = cluster_checks(args.nodes, args.partition, args.gpus_per_node, run_dir)
        else:
            probe = write_probe(run_dir)
            try:
                checks = local_checks(probe)
            finally:
                Path(probe["path"]).unlink(missing_ok=True)
        het = check_hetjobs(args.partition)  # asked from here, the submitting node: what relax-submit will see
        het.node = socket.gethostname()
        checks.append(het)
    except (DoctorError, slurm.SlurmError, OSError) as e:
        print(f"relax-doctor: {e}", file=sys.stderr)
        return 2
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=1))
    else:
        from rich.console import Console

        console = Console()
        console.print(render(checks))
        console.print(f"{len(failed)} failure(s)" if failed else "all checks passed",
                      style=STYLE[FAIL] if failed else STYLE[OK])
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
