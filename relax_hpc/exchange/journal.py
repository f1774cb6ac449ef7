"""The exchange journal: an append-only JSON-lines file, one fsynced record per broker decision.

Every change of the broker's state is first appended here, then applied; replaying the file rebuilds the
state (``Broker`` does exactly that on construction). A record is one JSON object on one line, with ``op``
and ``t`` (wall-clock time of the append):

==================  ==========================================================================================
``journal``         first line: ``v`` (format version)
``config``          ``tasks`` ({task: [fields]}), ``max_staleness`` — written when they change
``start``           ``step``, ``min_uncleared`` (None if none), ``max_staleness``: the producer began a step
``produced``        ``step``, ``chunk`` (id), ``producer``, ``seq``, ``n``, ``fields``, ``checksum``, ``size``, ``attrs``
``end``             ``step``: the producer will announce no more chunks for it
``fields_added``    ``chunk``, ``writer``, ``file``, ``fields``, ``checksum``, ``size``
``leased``          ``lease``, ``task``, ``holder``, ``chunks`` ([ids]), ``fields``: handed out, not yet consumed
``consumed``        ``lease``, ``task``, ``chunks``: the consumer acknowledged the lease
``released``        ``lease``, ``reason``: given back unconsumed; its chunks may be handed out again
``quarantined``     ``chunk``, ``reason``
``cleared``         ``step``, ``forced``, ``unconsumed`` (samples not consumed by every task)
==================  ==========================================================================================

Durability: a record is written with one ``write`` on an ``O_APPEND`` descriptor and ``fdatasync``-ed before
the call returns, so a record the broker acted on (replied to) is on disk. Inside :meth:`Journal.group` the
records are synced once, at its end, and before any file is deleted or moved on one of them (``flush``). A crash mid-append can leave a
torn or garbage tail (a prefix of a line, or NUL bytes on some filesystems); replay ignores it and
:class:`Journal` truncates it before appending. Damage anywhere else raises :class:`JournalCorrupt`.

One writer at a time: :class:`Journal` holds an exclusive ``flock`` on the file while open (best effort on
network filesystems that lack it), so a second broker on the same journal fails instead of interleaving.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from relax_hpc.rundir import fsync_dir as _fsync_dir

VERSION = 1


class JournalCorrupt(Exception):
    """A record that is not the last one cannot be read: the journal was damaged, not torn by a crash."""


class JournalLocked(Exception):
    """Another process has this journal open for writing."""


def _parse(data: bytes, path: str) -> tuple[list[dict], int, bytes]:
    """(records, length of the valid prefix, torn tail)."""
    records: list[dict] = []
    pos = 0
    bad_at: int | None = None
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:  # no newline: the last append was cut short
            bad_at = pos if bad_at is None else bad_at
            break
        line = data[pos:nl]
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "op" not in rec:
                raise ValueError("not a record")
        except (ValueError, UnicodeDecodeError):
            if bad_at is None:
                bad_at = pos
        else:
            if bad_at is not None:
                raise JournalCorrupt(f"{path}: unreadable record at byte {bad_at} is followed by valid ones")
            records.append(rec)
        pos = nl + 1
    good = len(data) if bad_at is None else bad_at
    return records, good, data[good:]


def replay(path: str | os.PathLike) -> list[dict]:
    """The records of a journal, a torn tail ignored (read-only; safe while a broker appends)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    return _parse(data, str(path))[0]


def iter_ops(records: list[dict], *ops: str) -> Iterator[dict]:
    return (r for r in records if r.get("op") in ops)


class Journal:
    """The open journal: ``records`` (what was there at open, for the caller to replay and drop) and
    :meth:`append`."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True):
        self.path = Path(path)
        self._fsync = fsync
        self._groups = 0  # > 0: inside group(): records are written now, made durable once at its end
        self._unsynced = False
        self._after: list = []  # when_durable callbacks waiting for the group's sync
        self.appended = 0
        self.syncs = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise JournalLocked(f"{self.path} is open in another broker") from None
            except OSError:
                pass  # no locks on this filesystem
            data = _read_all(self._fd)
            self.records, good, self.torn_tail = _parse(data, str(self.path))
            if self.torn_tail:
                os.ftruncate(self._fd, good)
                os.fsync(self._fd)
            if not self.records:
                self.records = [self.append({"op": "journal", "v": VERSION})]
            if created:
                _fsync_dir(self.path.parent)
        except BaseException:
            os.close(self._fd)
            raise
        if self.records[0].get("op") != "journal" or self.records[0].get("v") != VERSION:
            os.close(self._fd)
            raise JournalCorrupt(f"{self.path}: not a version-{VERSION} exchange journal")

    def append(self, rec: dict[str, Any]) -> dict:
        """Write ``rec`` (``t`` added) as one line and make it durable; returns the written record."""
        rec = {"op": rec["op"], "t": round(time.time(), 6), **{k: v for k, v in rec.items() if k != "op"}}
        line = json.dumps(rec, separators=(",", ":")).encode() + b"\n"
        mv = memoryview(line)
        while mv:
            mv = mv[os.write(self._fd, mv) :]
        if self._fsync:
            if self._groups:
                self._unsynced = True
            else:
                self._sync()
        self.appended += 1
        return rec

    def _sync(self) -> None:
        _datasync(self._fd)
        self.syncs += 1
        self._unsynced = False

    def flush(self) -> None:
        """Make what is written durable now (inside a group: before a file is deleted or moved on its record)."""
        if self._unsynced and self._fd >= 0:
            self._sync()

    def when_durable(self, fn) -> None:
        """Run ``fn`` once the records written so far are durable: now (after a sync, if one is owed) outside a
        group; after the group's one sync inside one. For what may only happen after its record, such as
        deleting a cleared step's files, without a sync of its own."""
        if self._groups and self._fsync:
            self._after.append(fn)
        else:
            self.flush()
            fn()

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Group commit: the records appended inside are written as they come and made durable together, with one
        fdatasync at the end (also when the block raises). Whoever acts on them must wait for the end: the
        controller sends the tasks a message's handling produced only after it (one sync per report, not one per
        record: a step's announces, its end, a lease)."""
        self._groups += 1
        try:
            yield
        finally:
            self._groups -= 1
            if not self._groups:
                after, self._after = self._after, []
                if self._unsynced and self._fd >= 0:
                    self._sync()  # (if it raises, nothing in ``after`` runs: the records may not be durable)
                errors = []
                for fn in after:  # every one, even after one failed: each acts on a durable record of its own
                    try:
                        fn()
                    except Exception as e:  # noqa: BLE001 - raised below, after the others ran
                        errors.append(e)
                if errors:
                    raise errors[0]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0


_datasync = getattr(os, "fdatasync", os.fsync)  # fdatasync is Linux's; elsewhere fsync


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    parts = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(parts)
        parts.append(b)


