"""The run directory: the one place a run's state lives, on the shared filesystem.

Everything that must survive a crash or be read by another process (the login node's ``relax-status``,
a requeued job, a role on another node) is a file here, written atomically. Owner-only permissions:
the token in it is what lets a process talk to the controller.

A full filesystem must not silence the run (``docs/reliability.md``, "A full disk"): ``RUN_DIR/.reserve`` holds
:data:`RESERVE_BYTES` of it from the start, and when a write of ``state.json`` fails for want of space the controller
writes it into the reserve's blocks (:meth:`RunDir.write_in_reserve`), freeing the rest, so that its last words (state.json: FAILED, "no space left on <mount>",
summary.json, the events) still land. :func:`no_space_message` is that reason, in one place.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import functools
import json
import os
import re
import secrets
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.errors import no_space

RESERVE_BYTES = 2 << 20  # the controller's last words on a full disk: state.json, summary.json, reward.png, events
FULL_BYTES = 1 << 20  # free space under this (for an unprivileged user) counts as a full filesystem
MAX_JSON_BYTES = 16 << 20  # a run directory's JSON files are kilobytes; more is not one of ours


class RunFileError(ValueError):
    """A run directory's file that cannot be used: missing, not a regular file, unreadable, too large, not UTF-8
    JSON, or not the shape it should have. ``str(e)`` is one line: the file, then what is wrong with it."""

    def __init__(self, path: str | os.PathLike, what: str, missing: bool = False):
        self.path, self.what, self.missing = Path(path), what, missing
        super().__init__(f"{path}: {what}")


@dataclass(frozen=True)
class RunDir:
    path: Path

    # files (each written by exactly one party)
    @property
    def recipe(self) -> Path:  # resolved recipe, by relax-submit
        return self.path / "recipe.yaml"

    @property
    def script(self) -> Path:  # rendered sbatch script, by relax-submit
        return self.path / "job.sbatch"

    @property
    def job(self) -> Path:  # {run, run_dir, job_id, executor, submitted_at, ...}, by relax-submit
        return self.path / "job.json"

    @property
    def token_file(self) -> Path:  # shared secret for the control socket, by relax-submit
        return self.path / "token"

    @property
    def secrets_file(self) -> Path:  # the recipe's secrets (slurm.env's values, ...), by relax-submit (secrets, below)
        return self.path / "secrets.json"

    @property
    def api_key_file(self) -> Path:  # the run's inference-engine API key, by the first caller of api_key()
        return self.path / "engine_api_key"

    @property
    def state(self) -> Path:  # controller's view of the run, for relax-status
        return self.path / "state.json"

    @property
    def controller_addr(self) -> Path:  # {host, port} of the control socket, by the controller
        return self.path / "controller.json"

    @property
    def draining(self) -> Path:  # JSON list of the engines leaving (no new requests), by the controller
        return self.path / "draining"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def reserve(self) -> Path:  # RESERVE_BYTES held for the controller's writes on a full disk, by whoever makes it
        return self.path / ".reserve"

    @property
    def rendezvous(self) -> Path:  # local-mode handshake files
        return self.path / "rendezvous"

    @property
    def name(self) -> str:
        return self.path.name

    def token(self) -> str:
        return self.token_file.read_text().strip()

    def api_key(self) -> str:
        """The run's API key for its inference engines (``Authorization: Bearer KEY``): without it anyone on
        the cluster's network could generate with, or overwrite the weights of, a run's engines.

        Generated once, on first use, and kept (mode 0600) in the run directory, so every rank, a requeued job
        and a restarted engine agree on it. Ranks on several nodes may ask at once: the file is written
        whole under a private name and linked into place, and a rank that loses the race reads the winner's."""
        try:
            return self.api_key_file.read_text().strip()
        except FileNotFoundError:
            pass
        tmp = self.api_key_file.with_name(f".{self.api_key_file.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        write_private(tmp, secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, self.api_key_file)  # atomic, and fails if another rank got there first
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return self.api_key_file.read_text().strip()

    def read_json(self, which: Path, default: Any = None) -> Any:
        """``which``'s JSON value, or ``default`` where it is missing or cannot be read (:func:`read_json_file`
        says why; callers that must tell the user use that)."""
        try:
            return read_json_file(which)
        except RunFileError:
            return default

    def ensure_reserve(self, nbytes: int = RESERVE_BYTES) -> bool:
        """Hold ``nbytes`` of the run directory's filesystem in :attr:`reserve` (made if missing or short:
        by relax-submit, and again by each controller, as a resume after a full disk finds it gone). Blocks
        really allocated (``posix_fallocate``; where that is not supported, random bytes, which neither a sparse
        file nor a compressing filesystem gives back). Returns False, touching nothing, where it cannot be had
        (the disk is full already): the run goes on without it."""
        try:
            if self.reserve.stat().st_blocks * 512 >= nbytes:
                return True
        except FileNotFoundError:
            pass
        tmp = self.reserve.with_name(f".reserve.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    _write_all(fd, os.urandom(nbytes))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.reserve)
            return True
        except OSError:
            tmp.unlink(missing_ok=True)
            return False

    def write_in_reserve(self, path: Path, text: str) -> bool:
        """Write ``text`` to ``path`` in :attr:`reserve`'s own blocks, with nothing new to allocate: on a full disk
        no other writer (a role still writing its checkpoint) can take the space first, as it could once the
        reserve were deleted. The reserve is renamed to a temporary name, overwritten from its start, cut to the
        text's length (freeing the rest for the end's other writes), fsynced and renamed over ``path``. False,
        touching nothing, where there is no reserve as large as the text: the caller writes as usual."""
        data = text.encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.reserve")
        try:
            if self.reserve.stat().st_blocks * 512 < len(data):
                return False
            os.replace(self.reserve, tmp)
        except OSError:
            return False
        try:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                _write_all(fd, data)  # from offset 0, over blocks allocated already
                os.ftruncate(fd, len(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return True
        except OSError:
            tmp.unlink(missing_ok=True)
            return False

    def release_reserve(self) -> int:
        """Free :attr:`reserve` for the controller's own writes (a write failed for want of space); the bytes freed."""
        try:
            size = self.reserve.stat().st_blocks * 512
            self.reserve.unlink()
            return size
        except FileNotFoundError:
            return 0


def named_like(name: str) -> "re.Pattern[str]":
    """The directory names of runs of recipe ``run.name`` ``name``: ``<name>-<stamp>[-i]`` (:func:`create_run_dir`);
    what lets a user say ``relax-status quickstart`` for the latest of them."""
    return re.compile(re.escape(name) + r"-\d{8}-\d{6}(-\d+)?")


def create_run_dir(runs_root: str | Path, name: str) -> RunDir:
    """A new, private run directory ``<runs_root>/<name>-<timestamp>`` with a fresh token."""
    root = Path(runs_root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = root / (f"{name}-{stamp}" if i == 0 else f"{name}-{stamp}-{i}")
        try:
            path.mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover
        raise RuntimeError(f"could not make a new run directory under {root}")
    os.chmod(path, 0o700)  # mkdir's mode is masked by umask
    rd = RunDir(path)
    for sub in (rd.logs, rd.rendezvous):
        sub.mkdir(mode=0o700)
    write_private(rd.token_file, secrets.token_hex(32) + "\n")
    rd.ensure_reserve()
    return rd


def write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically (tmp + fsync + rename), readable by the owner only. A write that fails (a full
    disk) leaves ``path`` as it was and no temporary file behind to hold the space."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            _write_all(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written: a filesystem filling up takes part of a write without an
    error; the next call raises ENOSPC."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the filesystem holding ``path`` (or its nearest existing parent): what a user frees
    space on."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    dev = p.stat().st_dev
    while p != p.parent and p.parent.stat().st_dev == dev:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int | None:
    """Space an unprivileged user may still write on ``path``'s filesystem (None where it cannot be asked)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def no_space_message(run: RunDir, path: str | os.PathLike | None = None, what: str = "") -> str:
    """The reason of a run ended by a full disk: the mount point (of ``path``, the file that could not be written,
    if known, else of the run directory), the fix. ``what``: how it was seen (e.g. "Disk quota exceeded")."""
    try:
        where = str(mount_point(path or run.path))
    except OSError:
        where = str(Path(path or run.path).parent)
    detail = "; ".join(x for x in (f"writing {path}" if path else "", what) if x)
    return (f"no space left on {where}{f' ({detail})' if detail else ''}. Fix: free space on {where} (or raise "
            f"the quota), then relax-submit --resume {run.path}")


def run_disk_full(run: RunDir, error: BaseException) -> bool:
    """Whether ``error`` is the run directory's full disk (:func:`relax_hpc.errors.no_space` says it is a full disk):
    the file it names is on the run directory's filesystem, or it names none and that filesystem is full now. A
    full node-local disk (``/dev/shm``, ``/tmp``) is the node's, not the run's: a restart may help there."""
    e = no_space(error)
    if e is None:
        return False
    name = getattr(e, "filename", None)
    if isinstance(name, (str, os.PathLike)):
        try:
            return mount_point(name) == mount_point(run.path)
        except OSError:
            pass
    free = free_bytes(run.path)
    return free is not None and free < FULL_BYTES


def no_space_reason(run: RunDir, error: BaseException, path: str | os.PathLike | None = None) -> str:
    """:func:`no_space_message` for ``error`` (a full disk, see :func:`relax_hpc.errors.no_space`): the file
    it names if ``path`` is not given, and what the system said."""
    e = no_space(error) or error
    name = getattr(e, "filename", None)
    path = path or (name if isinstance(name, (str, os.PathLike)) else None)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = os.strerror(e.errno)  # not e.strerror: HDF5 puts a page of its own there
    else:
        lines = str(e).strip().splitlines()
        what = lines[-1][:200] if lines else type(e).__name__
    return no_space_message(run, path, what)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries durable (a create, rename or unlink in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range  # ctypes drops the GIL in the call
    except (AttributeError, OSError, TypeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return f


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the device now, without waiting
    for it (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; the call itself may block while the device's queue is
    full). A large file written piece by piece, each piece started as it lands, then overlaps the device's
    writing with the copying of the rest, and the closing ``fsync`` waits only for the tail: 14 MB went from
    10.6 to 7 ms here. Durability is still the ``fsync``'s job; where the call is
    missing (not Linux) or fails, this does nothing. Returns whether the kernel took the request (if not,
    ``ctypes.get_errno()`` says why)."""
    f = _sync_file_range()
    return f is not None and f(fd, offset, nbytes, 2) == 0  # SYNC_FILE_RANGE_WRITE


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file (following links): what may be opened without a FIFO blocking the
    open or a device answering without end."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _not_regular(path: str | os.PathLike, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "something else")
    raise RunFileError(path, f"is {kind}, not a regular file")


def read_bytes(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of regular file ``path``, or :class:`RunFileError`. Never blocks: anything but a regular file is
    refused by its type before it is opened, the open is non-blocking (a file swapped for a FIFO in between
    cannot hang it either) and its type is checked again on the open file; more than ``limit`` bytes are
    refused, not read."""
    def unreadable(e: OSError) -> RunFileError:
        if isinstance(e, FileNotFoundError):
            return RunFileError(path, "missing", missing=True)
        return RunFileError(path, f"cannot be read ({e.strerror or type(e).__name__})")

    try:
        _not_regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise unreadable(e) from None
    try:
        st = os.fstat(fd)
        _not_regular(path, st.st_mode)
        if st.st_size > limit:
            raise RunFileError(path, f"is {st.st_size} bytes, more than the {limit} a run directory's file may be")
        parts, size = [], 0
        while size <= limit:
            part = os.read(fd, min(1 << 20, limit + 1 - size))
            if not part:
                break
            parts.append(part)
            size += len(part)
    except OSError as e:
        raise unreadable(e) from None
    finally:
        os.close(fd)
    if size > limit:
        raise RunFileError(path, f"grew past the {limit} bytes a run directory's file may be")
    return b"".join(parts)


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def read_json_file(path: str | os.PathLike, kind: type | None = None, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value of regular file ``path`` (read by :func:`read_bytes`: no hang, at most ``limit`` bytes), of
    type ``kind`` if given (``dict``: a JSON object); else :class:`RunFileError` saying what is wrong in one line:
    missing, not a regular file, unreadable, empty, not UTF-8, not JSON (a truncated file says so), too deep."""
    data = read_bytes(path, limit)
    if not data.strip():
        raise RunFileError(path, "is empty" if not data else "holds only whitespace, no JSON")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunFileError(path, f"is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): "
                                 "binary data where JSON should be") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        cut = "; it ends early: truncated?" if e.pos >= len(text.rstrip()) else ""
        raise RunFileError(path, f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}{cut})") from None
    except RecursionError:
        raise RunFileError(path, "is JSON nested too deeply to read") from None
    if kind is not None and not isinstance(value, kind):
        want = "a JSON object" if kind is dict else "a JSON array" if kind is list else kind.__name__
        raise RunFileError(path, f"holds {_json_kind(value)} where {want} should be")
    return value


def json_text(data: Any) -> str:
    """How the run directory's JSON files are written (:func:`write_json`)."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def write_json(path: Path, data: Any) -> None:
    write_private(path, json_text(data))


# -- the recipe's secrets and RUN/secrets.json -------------------------------------------------------------------
# Which values of a recipe are secrets (docs/controller.md, "Secrets"):
#
# * every value of ``slurm.env`` (a token such as ``HF_TOKEN`` or ``WANDB_API_KEY`` is set there);
# * a value of ``slurm.container.env`` whose name says TOKEN, KEY, SECRET, PASSWORD (:func:`secret_name`);
# * every ``logging.notify_urls`` entry (an Apprise URL carries its service's password or token in the URL itself).
#
# Masked at the source: the recipe copy (``RUN/recipe.yaml``) and ``job.json`` hold :data:`MASK` where the value was,
# so nothing that reads or uploads them (relax-status --json, the dry run, W&B's config, a run directory attached to
# a bug report) can show one. The values are in one file, ``RUN/secrets.json`` (0600, :func:`write_secrets`), as
# ``{override key: value}``; the controller loads the recipe with them as overrides (:func:`secret_overrides`), so a
# requeued or resumed attempt has them too. Roles read the masked copy: none needs a secret's value, which reaches
# the steps through their environment (never a command line). Only these keys are masked: the roles read every
# other value of the copy. Here, with the run directory, because the W&B writer (which the recipe validator
# imports) masks with it too: nothing of the recipe's is imported.

MASK = "***"
SECRET_ENV = "slurm.env"  # every value a secret
SECRET_NAMED_ENV = "slurm.container.env"  # the values whose names say so (secret_name)
SECRET_URLS = "logging.notify_urls"  # every entry
_NAME = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(?![A-Za-z])", re.IGNORECASE)


def secret_name(name: str) -> bool:
    """An environment variable whose name says it holds a secret: TOKEN, KEY, SECRET, PASSWORD (PASSWD, CREDENTIAL)
    not followed by another letter (``HF_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``, ``DB_PASSWORD``; not
    ``TOKENIZERS_PARALLELISM``)."""
    return bool(_NAME.search(str(name)))


def masked_url(url: str) -> str:
    """A notification URL as the recipe copy and W&B show it: its scheme, the rest masked."""
    return f"{url.split('://', 1)[0]}://{MASK}" if "://" in url else MASK


def is_masked(value: Any) -> bool:
    """True for a value :func:`split_secrets` put in place of a secret (the validator passes it over)."""
    return isinstance(value, str) and (value == MASK or value.endswith(f"://{MASK}"))


def _dig(data: Any, path: str) -> Any:
    for part in path.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def split_secrets(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A recipe as a dict (``recipe_to_dict``) → (a copy with each secret masked, the secrets as
    ``{override key: value}``). A value masked already (a copy's) is not a secret of its own."""
    masked, found = copy.deepcopy(data), {}
    env = _dig(masked, SECRET_ENV)
    named = _dig(masked, SECRET_NAMED_ENV)
    for mapping, every in ((env, True), (named, False)):
        if not isinstance(mapping, dict):
            continue
        prefix = SECRET_ENV if every else SECRET_NAMED_ENV
        for k, v in list(mapping.items()):
            if isinstance(v, str) and (every or secret_name(k)) and not is_masked(v):
                found[f"{prefix}.{k}"] = v
                mapping[k] = MASK
    urls = _dig(masked, SECRET_URLS)
    if isinstance(urls, list) and any(isinstance(u, str) and not is_masked(u) for u in urls):
        found[SECRET_URLS] = list(urls)
        section = _dig(masked, SECRET_URLS.rpartition(".")[0])
        section[SECRET_URLS.rpartition(".")[2]] = [masked_url(u) if isinstance(u, str) else u for u in urls]
    return masked, found


def mask_secrets(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a recipe as a dict) with its secrets masked."""
    return split_secrets(data)[0]


def secret_overrides(found: dict[str, Any]) -> list[str]:
    """The secrets as the recipe loader's overrides (``key=value``, the value as JSON, which YAML reads alike)."""
    return [f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in found.items()]  # \ud83d escapes: YAML keeps surrogates


def _secret_key(key: str) -> bool:
    """An override key that sets a secret or a section holding one."""
    for path in (SECRET_ENV, SECRET_NAMED_ENV, SECRET_URLS):
        if path == key or path.startswith(key + ".") or key.startswith(path + "."):
            return True
    return False


def mask_override(item: str) -> str:
    """A command-line override (``key=value``) as ``job.json`` keeps it: the value masked where it sets a secret,
    or a section holding one (``slurm.env={HF_TOKEN: x}``); the item as it is otherwise."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not _secret_key(key):
        return item
    parts = key.split(".")
    if key.startswith(SECRET_ENV + ".") and len(parts) == 3:
        return f"{key}={MASK}"
    if key.startswith(SECRET_NAMED_ENV + ".") and len(parts) == 4:  # one variable: its name decides
        return f"{key}={MASK}" if secret_name(parts[-1]) else item
    import yaml

    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return f"{key}={MASK}"
    tree: dict[str, Any] = {}
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    if key == SECRET_URLS and isinstance(value, str):  # one URL given where a list belongs (the validator says so)
        return f"{key}={masked_url(value)}"
    out = _dig(mask_secrets(tree), key)
    return f"{key}={out if isinstance(out, str) else json.dumps(out)}"


def write_secrets(run: RunDir, found: dict[str, Any]) -> None:
    """``RUN/secrets.json`` (0600, atomic): the recipe's secrets, by relax-submit (written even when empty, so that
    a run says it has none)."""
    write_private(run.secrets_file, json.dumps({"recipe": found}, indent=1) + "\n")


def read_secrets(run: RunDir) -> dict[str, Any]:
    """The recipe's secrets of a run (``{override key: value}``); {} for a run without the file (made before it
    existed, or by hand). RunFileError for one that cannot be used: a run must not start without its secrets."""
    try:
        doc = read_json_file(run.secrets_file, dict)
    except RunFileError as e:
        if e.missing:
            return {}
        raise
    found = doc.get("recipe")
    if not isinstance(found, dict) or not all(isinstance(k, str) for k in found):
        raise RunFileError(run.secrets_file, 'has no "recipe" object of override keys')
    return found
