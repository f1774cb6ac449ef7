"""A fork server, both halves: processes of this machine that would start as ``python -m MODULE ARGS`` are forked
from one process that has imported torch, Megatron and transformers once, instead of importing them each.

Why: on a machine without a GPU a role or engine process spends 3-6 CPU-s importing (torch with dynamo and
DTensor, Megatron, transformers) before its first line of work; a local run starts four to ten of them, more with
restarts and elastic engines. The server imports once; a fork shares those pages and starts at once.

The server (``python -m relax_hpc.forkserver SOCKET``, its stdin a pipe from whoever started it: it ends when that
closes) listens on a Unix socket. :func:`popen` is the client: with ``RELAX_FORKSERVER`` set to the socket it asks
the server, and falls back to :class:`subprocess.Popen` whenever the server says no (another interpreter, options
before ``-m``, an environment variable read at interpreter or library start that differs from the server's, a
machine with a GPU: CUDA and fork do not mix) or cannot be reached. Without the variable nothing changes.

A forked child is what ``Popen(argv, stdin=DEVNULL, stdout=…, start_new_session=True)`` gives: its own session,
the caller's environment and working directory, stdout and stderr on the caller's descriptors (passed over the
socket), the same exit code (``-N`` for a signal), and it exits as ``python -m`` does (threads joined, atexit, the
streams flushed) but without tearing its modules down (:func:`_leave`).
The child's parent is the server, which reaps it and tells the caller its exit code on the request's connection
(:class:`ForkedProcess`, Popen's interface). ``dies_with``: the child gets SIGTERM when that process ends, as
``PR_SET_PDEATHSIG`` gives a child of the caller (the server is not the caller, so a pidfd is watched).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import logging
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import IO, Any, Iterator, Sequence, Union

log = logging.getLogger(__name__)

ENV = "RELAX_FORKSERVER"  # the socket of the server this process's children are forked from
OFF = "RELAX_NO_FORKSERVER"  # "1": no server is started (serving) and nothing is forked (popen): Popen throughout
# Imported (and, after a colon, called) before the server serves: what the roles and the CPU engine import first.
# compile_eagerly before Megatron: its fused ops then never import inductor (relax_hpc.train.cpu_compat).
PRELOAD = ("relax_hpc.train.cpu_compat:compile_eagerly", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "transformers", "transformers:AutoTokenizer",
           "transformers:AutoModelForCausalLM", "h5py", "httpx", "numpy")
# Variables read when an interpreter or a preloaded library starts: a request whose values differ from the server's
# would get the server's, so it is refused (and started by Popen). PYTHONUNBUFFERED is the one honoured per child.
_START_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "GOMP_", "KMP_", "TORCH", "CUDA", "NVIDIA", "NVTE_",
                   "HF_", "TRANSFORMERS_", "TOKENIZERS_", "LD_", "MALLOC_")
_PER_CHILD = ("PYTHONUNBUFFERED", "PYTHONPATH")  # PYTHONPATH may add folders (_path_refusal)
_HEADER = struct.Struct("!I")
_UNKNOWN = 255  # the exit code of a child whose server ended before it did (a PID's end can be waited for, not read)


# ------------------------------------------------------------------------------------------ the client ---
class ForkedProcess:
    """A child of the fork server, with :class:`subprocess.Popen`'s interface (``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``). Its exit code comes on the request's connection."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn: socket.socket | None = conn
        self._buf = b""

    def _read(self, timeout: float | None) -> None:
        if self._conn is None:  # the server ended before its child: the exit code is lost; wait for the PID's end
            try:
                fd = os.pidfd_open(self.pid)
            except ProcessLookupError:
                self.returncode = _UNKNOWN
                return
            try:
                sel = selectors.DefaultSelector()
                sel.register(fd, selectors.EVENT_READ)
                if sel.select(timeout):
                    self.returncode = _UNKNOWN
                sel.close()
            finally:
                os.close(fd)
            return
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                data = self._conn.recv(64)
                if not data:
                    self._conn.close()
                    self._conn = None
                    return self._read(timeout)
                self._buf += data
        except (BlockingIOError, socket.timeout):
            return
        self.returncode = int(self._buf.split(b"\n", 1)[0])
        self._conn.close()
        self._conn = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a PID whose exit is known (it may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode}>"


Process = Union[subprocess.Popen, ForkedProcess]  # what popen returns


def popen(argv: Sequence[str], *, env: dict[str, str], stdout: IO[Any], dies_with: int | None = None) -> Process:
    """``Popen(argv, env=env, stdin=DEVNULL, stdout=stdout, stderr=STDOUT, start_new_session=True)``, forked from
    the server that ``RELAX_FORKSERVER`` names where it can. ``dies_with``: a PID whose end sends the child SIGTERM
    (``PR_SET_PDEATHSIG`` for a Popen child, which must then be that PID's child)."""
    argv = list(argv)
    address = None if os.environ.get(OFF) == "1" else os.environ.get(ENV)
    if address and "SLURM_JOB_ID" not in os.environ:  # in a job Slurm must own (count, signal, end) what runs
        forked = _ask(address, argv, env, stdout, dies_with)
        if forked is not None:
            return forked
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=_pdeathsig(dies_with) if dies_with is not None else None)


def _ask(address: str, argv: list[str], env: dict[str, str], stdout: IO[Any],
         dies_with: int | None) -> ForkedProcess | None:
    cpus = None
    if argv[:2] == ["taskset", "-c"] and len(argv) > 3:  # the local backend's binding: the child sets it itself
        cpus, argv_py = argv[2], argv[3:]
    else:
        argv_py = argv
    if len(argv_py) < 3 or argv_py[1] != "-m":
        return None
    request = {"python": argv_py[0], "module": argv_py[2], "args": argv_py[3:], "env": env, "cwd": os.getcwd(),
               "cpus": cpus, "dies_with": dies_with}
    payload = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(300.0)  # it listens before it imports, and answers after: a request may wait that long
        conn.connect(address)
        socket.send_fds(conn, [_HEADER.pack(len(payload))], [stdout.fileno()])
        conn.sendall(payload)
        line = b""
        while not line.endswith(b"\n"):
            data = conn.recv(256)
            if not data:
                raise ConnectionError("the fork server closed the connection")
            line += data
    except OSError as e:
        conn.close()
        print(f"[forkserver] {address}: {e}; starting {argv_py[2]} with Popen", file=sys.stderr)
        return None
    word, _, rest = line.decode().strip().partition(" ")
    if word != "pid":
        conn.close()
        log.debug("the fork server does not start %s: %s", argv_py[2], rest)
        return None
    return ForkedProcess(argv, int(rest), conn)


def _pdeathsig(parent: int):
    """Popen's ``preexec_fn``: SIGTERM when ``parent`` (the caller) ends (Linux's ``PR_SET_PDEATHSIG``)."""
    if not sys.platform.startswith("linux"):
        return None

    def arm() -> None:  # runs in the child between fork and exec: no allocation-heavy work, no imports of ours
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before the prctl: nothing will send the signal
            os._exit(1)

    return arm


# ------------------------------------------------------------------------------------------ the server ---
@dataclass
class Job:
    """One request, in the forked child: what to run and how."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    out_fd: int
    cpus: str | None = None
    dies_with: int | None = None
    served_path: str | None = None  # the server's PYTHONPATH
    keep: list[Any] = field(default_factory=list)  # the server's standard streams, kept from the collector


def refusal(request: dict, server_env: dict[str, str], added: dict[str, str] | None = None) -> str | None:
    """Why a server started with ``server_env`` would not fork ``request`` (None: it would). ``added``: what its
    imports set in its environment, which a request may carry (a child of the server passes it on) or not."""
    if request.get("python") != sys.executable:
        return f"another interpreter ({request.get('python')}, the server runs {sys.executable})"
    if _gpu_machine():
        return "a machine with a GPU: CUDA and fork do not mix"
    env = request.get("env") or {}
    added = added or {}
    for key in sorted(set(env) | set(server_env)):
        if key in added and env.get(key) in (None, added[key]):
            continue
        if key.startswith(_START_PREFIXES) and key not in _PER_CHILD and env.get(key) != server_env.get(key):
            return f"{key} differs from the server's (read when an interpreter or library starts)"
    return _path_refusal(_entries(env.get("PYTHONPATH")), _entries(server_env.get("PYTHONPATH")))


def _entries(value: str | None) -> list[str]:
    return list(dict.fromkeys(os.path.abspath(p) for p in (value or "").split(os.pathsep) if p))


def _path_refusal(wanted: list[str], served: list[str]) -> str | None:
    """A PYTHONPATH may add folders to the server's, as long as none of them holds a module the server has
    imported (the child would get the server's, a fresh process the folder's)."""
    if not set(served) <= set(wanted):
        return "PYTHONPATH lacks some of the server's folders"
    loaded = {name.partition(".")[0] for name in sys.modules}
    for folder in wanted:
        if folder in served:
            continue
        try:
            names = {entry.partition(".")[0] for entry in os.listdir(folder)}
        except OSError:
            continue
        if names & loaded:
            return f"PYTHONPATH's {folder} holds {', '.join(sorted(names & loaded)[:3])}, which the server imported"
    return None


def _gpu_machine() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def _preload(names: Sequence[str]) -> None:
    for name in names:
        module, _, attr = name.partition(":")
        mod = importlib.import_module(module)
        if attr:
            obj = getattr(mod, attr)
            if callable(obj) and not isinstance(obj, type):
                obj()


def serve(path: str, preload: Sequence[str] = PRELOAD) -> Job | None:
    """Listen on ``path``, import ``preload``, then fork a child per request until stdin closes. Returns the
    :class:`Job` in a forked child (the caller runs it: :func:`run`), None in the server when it ends. Requests
    sent while it imports wait in the listen queue: whoever started it need not wait."""
    start_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # in a folder of the caller's, mode 0700; each request's sender is checked too (_take)
    listener.listen(128)
    print(f"listening {path}", flush=True)
    if not _gpu_machine():
        _preload(preload)
    # What is here now lives as long as the children: their collections never walk it, nor copy its pages. Without
    # this a forked child spent more CPU on collecting than the fork saved (the quickstart, 30 steps: 76 CPU-s with
    # every process started afresh, 77 forked, 65 forked after the freeze; one run each, this 2-core machine).
    gc.freeze()
    # what the imports set (submitit's helpers: TORCHINDUCTOR_CACHE_DIR), a fresh process would have set too
    added = {k: v for k, v in os.environ.items() if k not in start_env}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of each exit
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "lifeline")
    waiting: dict[int, socket.socket] = {}
    print(f"ready {path}", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                job = _take(conn, waiting, start_env, added)
                if job is not None:  # the child: drop the server's ends, then run the job
                    sel.close()
                    listener.close()
                    for c in waiting.values():
                        c.close()
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    return job
            elif key.data == "reap":
                while os.read(wake_r, 4096) == 4096:
                    pass
                _reap(waiting)
            elif not os.read(sys.stdin.fileno(), 4096):  # whoever started us is gone: stop serving
                listener.close()
                os.unlink(path)
                for c in waiting.values():
                    c.close()
                return None


def _take(conn: socket.socket, waiting: dict[int, socket.socket], start_env: dict[str, str],
          added: dict[str, str]) -> Job | None:
    """Read one request from ``conn``; fork it or say no. Returns the Job in the child, None in the server."""
    fds: list[int] = []
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():  # a fork runs what it is told: only for our own user
            raise PermissionError(f"a request from user {struct.unpack('3i', creds)[1]}")
        conn.settimeout(30.0)
        head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 1)
        (size,) = _HEADER.unpack(head)
        payload = b""
        while len(payload) < size:
            data = conn.recv(size - len(payload))
            if not data:
                raise ConnectionError("short request")
            payload += data
        request = json.loads(payload)
        why = refusal(request, start_env, added) if len(fds) == 1 else "no output descriptor"
        if why:
            print(f"[forkserver] {request.get('module')}: started by Popen: {why}", file=sys.stderr, flush=True)
            conn.sendall(f"no {why}\n".encode())
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                conn.close()
                return Job(request["module"], list(request["args"]), {**added, **request["env"]}, request["cwd"], fds[0],
                           request.get("cpus"), request.get("dies_with"), start_env.get("PYTHONPATH"))
            conn.sendall(f"pid {pid}\n".encode())
            conn.setblocking(True)
            waiting[pid] = conn
            conn = None
    except (OSError, ValueError, KeyError) as e:
        print(f"[forkserver] a request failed: {e}", file=sys.stderr, flush=True)
    for fd in fds:  # the child has its copy
        os.close(fd)
    if conn is not None:
        conn.close()
    return None


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the caller is gone
                pass
            conn.close()


def run(job: Job) -> None:
    """In the forked child: become what ``Popen`` would have started, then run the module as ``python -m``."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    if job.cpus:
        os.sched_setaffinity(0, _cpu_list(job.cpus))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(job.out_fd, 1)
    os.dup2(job.out_fd, 2)
    os.close(null)
    os.close(job.out_fd)
    job.keep += [sys.stdin, sys.stdout, sys.stderr]
    _std_streams(bool(job.env.get("PYTHONUNBUFFERED")))
    if "numpy" in sys.modules:  # its global generator was the server's; a fresh process seeds it from the OS
        sys.modules["numpy"].random.seed()
    if job.dies_with is not None:
        _die_with(job.dies_with)
    _set_title([sys.executable, "-m", job.module, *job.args])
    sys.argv = [job.module, *job.args]  # run_module puts the module's file first, as python -m does
    # as python -m makes it: the working directory, PYTHONPATH's folders, then the interpreter's own
    served = _entries(job.served_path)
    sys.path[:] = [job.cwd, *_entries(job.env.get("PYTHONPATH")),
                   *(p for p in sys.path[1:] if os.path.abspath(p) not in served)]
    importlib.invalidate_caches()
    code, interrupted = 0, False
    try:
        runpy.run_module(job.module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        interrupted = True
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    _leave()
    if interrupted:  # as the interpreter: die of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    os._exit(code)


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _leave() -> None:
    """What an interpreter's exit does that a program may count on (its threads joined, atexit, the streams
    flushed), without tearing down every module: with torch, Megatron and transformers imported that alone is
    ~1.2 CPU-s, spent touching pages the fork shared. A file left open and unflushed is lost, as in any
    multiprocessing child."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own wait for non-daemon threads
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _cpu_list(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _std_streams(unbuffered: bool) -> None:
    """The standard streams on descriptors 0-2 as a fresh interpreter makes them (``-u`` by PYTHONUNBUFFERED)."""
    enc = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), enc)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), enc,
                                  errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=fd == 2 and not unbuffered, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with(pid: int) -> None:
    """SIGTERM to this process when ``pid`` ends; exit at once if it already has (as the prctl check does)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        sel.select()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dies-with", daemon=True).start()


# ------------------------------------------------------------------------------------------ the titles ---
# A forked child's command line (/proc/PID/cmdline, what ps and psutil show) would be the server's. Each child
# writes its own over it, as setproctitle does, in the room the server's last argument (TITLE_ROOM bytes) leaves.
TITLE_ROOM = 2048


def _set_title(argv: Sequence[str]) -> None:
    """Write ``argv`` over this process's argument area, as setproctitle does: the words joined by spaces, cut
    to the room, a NUL, and a last byte that is not NUL (Linux then reads the title up to its NUL: psutil splits it
    at the spaces). The interpreter's path, the first word, is the server's too, so glibc's
    ``program_invocation_name`` (a pointer to it) still reads true."""
    import ctypes

    try:
        fields = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # proc(5) fields 48 and 49: arg_start, arg_end
    except (OSError, IndexError, ValueError):
        return
    room = end - start
    if room < 2:
        return
    title = " ".join(argv).encode(errors="replace")[:room - 2]
    ctypes.memmove(start, title + b"\0" * (room - 1 - len(title)) + b" ", room)


def start(path: str, *, log: IO[Any] | None = None, env: dict[str, str] | None = None,
          wait: bool = True) -> subprocess.Popen:
    """Start a server on ``path`` (in a folder only this user can enter) and, with ``wait``, wait until it
    serves (it has imported :data:`PRELOAD`; without, until it listens: requests then wait for the imports). It ends when the returned process's
    stdin closes (``proc.stdin.close(); proc.wait()``): when its starter ends, at the latest. Its children live on."""
    proc = subprocess.Popen([sys.executable, "-m", __name__, path, "-" * TITLE_ROOM], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
    for word in ("listening", "ready")[:2 if wait else 1]:  # it listens before it imports
        if not proc.stdout.readline().startswith(word.encode()):
            proc.kill()
            raise RuntimeError(f"the fork server on {path} did not start (exit {proc.wait()})")
    return proc


@contextlib.contextmanager
def serving(log_path: str | os.PathLike, env: dict[str, str] | None = None) -> Iterator[str | None]:
    """A server for what this process starts in the block (``RELAX_FORKSERVER`` set to it here, and so in the
    environment of what it starts), ended after. Its log: ``log_path``. Yields its socket; None, and nothing
    started, on a machine with a GPU or with ``RELAX_NO_FORKSERVER=1``."""
    if _gpu_machine() or os.environ.get(OFF) == "1":
        yield None
        return
    folder = tempfile.mkdtemp(prefix="relax-fs-")  # mode 0700; a short path (a socket's is at most 107 bytes)
    before = os.environ.get(ENV)
    with open(log_path, "ab") as log:
        server = start(os.path.join(folder, "sock"), log=log, env=env, wait=False)
    os.environ[ENV] = os.path.join(folder, "sock")
    try:
        yield os.environ[ENV]
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        raise SystemExit("usage: python -m relax_hpc.forkserver SOCKET [ROOM]  (stdin: a pipe; the server ends when "
                         "it closes; ROOM, any argument, is the room the children's command lines are written in)")
    _set_title([sys.executable, "-m", __spec__.name if __spec__ else "relax_hpc.forkserver", args[0]])
    job = serve(args[0])
    if job is not None:
        run(job)


if __name__ == "__main__":
    main()
