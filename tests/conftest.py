"""Shared pytest fixtures. Keep this file small; add fixtures below."""

from __future__ import annotations

import atexit
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEV_SLURM = REPO / "tools" / "dev-slurm"

# The suite's processes share one user on one node: a squeue answer cached for 10 s across them (relax_hpc.launch.slurm)
# would let one test see another's old view of the queue. Off for the suite; tests/launch/test_status_polling.py
# turns it on where the cache itself is tested.
os.environ.setdefault("RELAX_SLURM_CACHE", "0")


# Under pytest-xdist (`tools/test -n 2`), the tests that share one of these session fixtures run on one worker, each
# test file's tests too (module fixtures), so no expensive setup is made twice. slurm_cluster is among them: the dev
# cluster's four nodes fit one test's het job at a time, and a second one would only wait in the queue; so is
# gpu_slurm_cluster (one tools/dev-slurm up and down, not one per worker on the same directory and port).
SHARED_FIXTURES = ("slurm_cluster", "gpu_slurm_cluster", "single_run", "multi_run", "fully_async_run",
                   "damaged_segments_run", "_prestarted_engines")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # xdist's workers see dist "no" and their own flag loadgroup; the main process sees dist "loadgroup"
    if not (getattr(config.option, "loadgroup", False) or getattr(config.option, "dist", "no") == "loadgroup"):
        return
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    for item in items:
        keys = [f"file:{item.path}"] + [f"fixture:{f}" for f in SHARED_FIXTURES if f in item.fixturenames]
        keys += [f"group:{m.args[0] if m.args else m.kwargs.get('name')}" for m in item.iter_markers("xdist_group")]
        for k in keys[1:]:
            parent[find(k)] = find(keys[0])
    for item in items:
        name = find(f"file:{item.path}").split(":", 1)[1].removeprefix(str(REPO / "tests") + "/")
        _group(item, name)


def _group(item, name: str) -> None:
    """Put ``item`` in xdist group ``name``: the scheduler reads it from the node id's ``@name`` suffix. xdist 3.8
    writes that suffix to ``_nodeid``, which pytest 9.2 no longer reads (its node id is ``_id``), so it is set here."""
    nodeid = f"{item.nodeid}@{name}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


# Every process the session starts carries SESSION_MARK in its environment (inherited across setsid, detached local
# runners and sbatch's --export=ALL); what still carries it when the session ends was left running by a test and
# would eat the CPU of every later test (and the next session's). The main process names it, the xdist workers
# inherit it; a pytest run inside a test names its own, so it never reaches the outer session's processes.
SESSION_MARK = "PYTEST_RELAX_SESSION"  # not RELAX_*: the local executor logs those of each rank
# the dev clusters' daemons outlive the session on purpose (tools/test leaves the cluster up)
_DAEMONS = {"slurmctld", "slurmd", "slurmstepd", "slurmdbd", "slurmscriptd", "mariadbd", "munged"}


def left_running(mark: str) -> dict[int, str]:
    """The processes whose environment holds ``SESSION_MARK=mark``, not this one nor its ancestors, nor a dev
    cluster's daemons and their kicker loop (its ``sleep`` too): pid -> command line."""
    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    mine, pid = set(), os.getpid()
    while pid > 1:  # this process and its ancestors (pytest's parent may carry the mark too)
        mine.add(pid)
        pid = parent(pid)
    want = f"{SESSION_MARK}={mark}".encode()
    found: dict[int, str] = {}
    keep: set[int] = set()  # the daemons
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in mine:
            continue
        try:
            if want not in (d / "environ").read_bytes().split(b"\0"):
                continue
            argv = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        args = " ".join(a.decode(errors="replace") for a in argv if a)
        if state == "Z" or not args:
            continue
        exe = Path(argv[0].decode(errors="replace")).name.split(":")[0]  # slurmstepd's argv[0]: "slurmstepd: [12.0]"
        if exe in _DAEMONS or "relax-dev-slurm-kicker" in args:
            keep.add(int(d.name))
        else:
            found[int(d.name)] = args
    return {p: a for p, a in found.items() if parent(p) not in keep}


def stop_left(pids, grace_s: float = 5.0) -> None:
    """SIGTERM each of ``pids``; SIGKILL those alive after ``grace_s``."""
    import signal

    def alive(p: int) -> bool:
        try:
            return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in pids:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def pytest_configure(config):
    _cpu_log(config)  # taken out of the environment before any worker or test process starts
    if not hasattr(config, "workerinput"):  # the main process (xdist's workers inherit its environment)
        config._relax_mark = (os.environ.get(SESSION_MARK), f"{os.getpid()}-{time.time_ns()}")
        os.environ[SESSION_MARK] = config._relax_mark[1]


# Per-test CPU-seconds (tools/test sets RELAX_TEST_CPU_LOG where root can make cgroups): each worker moves itself
# into a cpuacct cgroup of its own, so what its tests start (engines, runs, detached runners) is charged to the test
# that was running; Slurm job steps are started by slurmd, outside it. One JSON line per test: where the CPU goes.
def _cpu_cgroup_of_worker() -> Path | None:
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if "cpuacct" in line.split(":", 2)[1].split(","))
        mine = Path("/sys/fs/cgroup/cpuacct") / rel.lstrip("/") / f"worker-{os.getpid()}"
        mine.mkdir(exist_ok=True)
        (mine / "tasks").write_text(str(os.getpid()))
    except (OSError, StopIteration, IndexError):
        return None

    def leave() -> None:  # back to the cgroup it came from, and its own removed (once what it started is gone too)
        try:
            (mine.parent / "tasks").write_text(str(os.getpid()))
            mine.rmdir()
        except OSError:
            pass

    atexit.register(leave)
    return mine


CPU_LOG = "RELAX_TEST_CPU_LOG"


def _cpu_log(config) -> str | None:
    """The CPU log of this session: the main process takes it out of the environment (a pytest run inside a test
    must not write to it), its xdist workers get it as worker input."""
    if hasattr(config, "workerinput"):
        return config.workerinput.get(CPU_LOG)
    if not hasattr(config, "_relax_cpu_log"):
        config._relax_cpu_log = os.environ.pop(CPU_LOG, None)
    return config._relax_cpu_log


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist, in the main process: each worker's input
    log = _cpu_log(node.config)
    if log:
        node.workerinput[CPU_LOG] = log


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = _cpu_log(item.config)
    cg = getattr(item.config, "_relax_cpu_cgroup", None)
    if log and cg is None:
        cg = item.config._relax_cpu_cgroup = _cpu_cgroup_of_worker() or False
    if not (log and cg):
        yield
        return
    import json

    c0, t0 = int((cg / "cpuacct.usage").read_text()), time.monotonic()
    yield
    cpu, wall = (int((cg / "cpuacct.usage").read_text()) - c0) / 1e9, time.monotonic() - t0
    with open(log, "a") as f:  # one short write per line: the workers' lines never interleave
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}) + "\n")


def pytest_unconfigure(config):
    before, _ = getattr(config, "_relax_mark", (None, None))
    if hasattr(config, "_relax_mark"):  # as it was (an enclosing session's, if any)
        if before is None:
            os.environ.pop(SESSION_MARK, None)
        else:
            os.environ[SESSION_MARK] = before


@pytest.hookimpl(trylast=True)  # after xdist's, which ends the workers
def pytest_sessionfinish(session):
    # the main process, after every worker and fixture is done: what is still running was leaked; stop it (by PID)
    # so it cannot slow the next session, and name it in the summary so the test that left it gets fixed
    config = session.config
    if not hasattr(config, "_relax_mark"):
        return
    left = left_running(config._relax_mark[1])
    if left:
        stop_left(list(left))
    config._relax_left = left


def pytest_terminal_summary(terminalreporter, config):
    left = getattr(config, "_relax_left", None)
    if left:
        terminalreporter.section("processes left running by tests (stopped)", yellow=True)
        for pid, args in sorted(left.items()):
            terminalreporter.write_line(f"{pid} {args[:300]}")


# Each pytest process (each xdist worker) starts one fork server (relax_hpc.forkserver): the engines its tests start
# themselves are forked from it instead of importing torch, Megatron and transformers each (~4 CPU-s a process, and
# ~1 more to tear those modules down at exit).
# A local run's controller starts its own for its roles and engines. RELAX_NO_FORKSERVER=1 turns both off.
@pytest.fixture(scope="session", autouse=True)
def _forkserver(tmp_path_factory):
    from relax_hpc import forkserver

    if os.environ.get(forkserver.ENV):  # a pytest run inside a test: the enclosing session's serves it too
        yield os.environ[forkserver.ENV]
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    with forkserver.serving(tmp_path_factory.mktemp("forkserver") / "forkserver.log", env=env) as address:
        yield address


@dataclass(frozen=True)
class SlurmCluster:
    """A reachable Slurm cluster. ``env`` is os.environ plus SLURM_CONF: pass it to
    subprocesses (SLURM_CONF is also exported into os.environ for the session)."""

    conf: str
    env: dict = field(repr=False)
    started: bool = False  # True if this session ran tools/dev-slurm up


def _sinfo_works(conf: str | None, patience_s: float = 0.0) -> bool:
    """Whether ``sinfo`` answers with ``conf``; asks again for up to ``patience_s`` (a loaded slurmctld is slow
    to answer, which is not the same as absent)."""
    if shutil.which("sinfo") is None:
        return False
    env = dict(os.environ)
    if conf:
        env["SLURM_CONF"] = conf
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=30).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(2)


def _require_slurm() -> bool:
    """CI sets RELAX_REQUIRE_SLURM=1: there a cluster that does not answer fails the slurm tests, never skips them."""
    return os.environ.get("RELAX_REQUIRE_SLURM") == "1"


def _dev_slurm_conf() -> str:
    """The SLURM_CONF of tools/dev-slurm's cluster (RELAX_DEV_SLURM_DIR honoured)."""
    out = subprocess.run([str(DEV_SLURM), "env"], capture_output=True, text=True, timeout=30).stdout
    return out.strip().removeprefix("export SLURM_CONF=")


@pytest.fixture(scope="session")
def slurm_cluster():
    """Use, in this order: $SLURM_CONF if sinfo works with it; tools/dev-slurm's
    cluster if it is already up; a fresh `tools/dev-slurm up` if root and
    RELAX_DEV_SLURM_AUTO=1. Otherwise skip, or fail with RELAX_REQUIRE_SLURM=1."""
    conf, started = os.environ.get("SLURM_CONF"), False
    patience = 180.0 if _require_slurm() else 0.0
    if not (conf and _sinfo_works(conf, patience)):
        conf = _dev_slurm_conf()
        if not (Path(conf).is_file() and _sinfo_works(conf, patience)):
            if os.geteuid() == 0 and os.environ.get("RELAX_DEV_SLURM_AUTO") == "1":
                p = subprocess.run([str(DEV_SLURM), "up"], capture_output=True, text=True, timeout=900)
                if p.returncode != 0:
                    pytest.fail(f"tools/dev-slurm up failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
                conf, started = p.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF="), True
            elif _require_slurm():
                pytest.fail(f"RELAX_REQUIRE_SLURM=1 but the Slurm cluster (SLURM_CONF={conf}) does not answer "
                            "sinfo: see tools/dev-slurm status and its logs")
            else:
                pytest.skip("dev Slurm cluster not up: run tools/dev-slurm up")
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield SlurmCluster(conf=conf, env=dict(os.environ), started=started)
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


# A second dev cluster, of 8-GPU nodes (fake GPUs): the real recipes' and Relax's scripts' dry runs check their srun
# lines against it. Its own directory and port, no accounting, no munge: up in a second, beside slurm_cluster.
GPU_CLUSTER = {"RELAX_DEV_SLURM_DIR": "/tmp/relax-dev-slurm-gpu", "RELAX_DEV_SLURM_PORT": "7917",
               "RELAX_DEV_SLURM_NODES": "4", "RELAX_DEV_SLURM_CPUS": "64", "RELAX_DEV_SLURM_GPUS": "8",
               "RELAX_DEV_SLURM_MEM_MB": "500000", "RELAX_DEV_SLURM_ACCOUNTING": "none",
               "RELAX_DEV_SLURM_AUTH": "none", "RELAX_DEV_SLURM_LINK_ETC": "0", "RELAX_DEV_SLURM_KICK": "0"}


@pytest.fixture(scope="session")
def gpu_slurm_cluster():
    """A dev cluster of four nodes of 8 GPUs and 64 CPUs (the async script's four roles are four het components),
    up for the session; the environment to run ``relax-submit`` in (its SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("tools/dev-slurm needs root")
    env = {**os.environ, **GPU_CLUSTER}
    env.pop("SLURM_CONF", None)
    up = subprocess.run([str(DEV_SLURM), "up"], capture_output=True, text=True, env=env, timeout=600)
    assert up.returncode == 0, up.stderr[-3000:]
    env["SLURM_CONF"] = up.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    try:
        yield env
    finally:
        subprocess.run([str(DEV_SLURM), "down"], capture_output=True, env=env, timeout=120)


@contextmanager
def locally(folder: Path, **env: str):
    """The local executor (``RELAX_EXECUTOR=local``), no role told to fail by an earlier test's environment,
    ``folder`` importable by the roles (the stub rewards, generate functions and environments beside the tests),
    ``env`` set; undone at the end (pytest's ``monkeypatch`` is function-scoped: this also serves session-scoped
    fixtures, tests/e2e/conftest.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAX_EXECUTOR", "local")
        mp.delenv("RELAX_TEST_FAIL_ROLE", raising=False)
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
        for k, v in env.items():
            mp.setenv(k, v)
        yield


@pytest.fixture
def local_executor(request):
    """Runs started by the test go as local processes (:func:`locally`), its own folder importable by the roles."""
    with locally(request.path.parent):
        yield


def make_tiny_model(out: Path, **kw) -> Path:
    """tools/make-tiny-model's ``make_tiny_model`` (the tool has no .py suffix: loaded as a module)."""
    loader = importlib.machinery.SourceFileLoader("relax_make_tiny_model", str(REPO / "tools" / "make-tiny-model"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return Path(mod.make_tiny_model(out, **kw))


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """The vision quickstart's model, made once per session: tools/make-tiny-model --arch qwen2_5_vl --seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl", arch="qwen2_5_vl", seed=0)


class SmallDisk:
    """A real filesystem of its own (tmpfs, ``size_mib``) at ``path``, to fill up: a full disk, not a fake one."""

    def __init__(self, path: Path):
        self.path = path

    def fill(self) -> Path:
        """Take every byte left (``path/filler``): the next write that needs a new block fails with ENOSPC."""
        filler = self.path / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            st = os.statvfs(self.path)
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, st.f_bavail * st.f_frsize)
            except OSError:
                pass
            for block in (1 << 16, 1 << 12, 1):  # whatever fallocate left, down to the last byte
                try:
                    while True:
                        os.write(fd, b"\0" * block)
                except OSError:
                    pass
        finally:
            os.close(fd)
        return filler

    def free(self) -> None:
        (self.path / "filler").unlink(missing_ok=True)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size_mib)``: a :class:`SmallDisk` mounted under ``tmp_path`` (``mount -t tmpfs``; root only:
    CI runs as root; skips where mounting is not allowed), unmounted at the end."""
    mounted: list[Path] = []

    def make(size_mib: int = 8) -> SmallDisk:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"mount -t tmpfs was refused here: {p.stderr.strip()}")
        mounted.append(d)
        return SmallDisk(d)

    yield make
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
