"""The journal: torn tails from a crash mid-append are ignored (and trimmed); other damage is an error."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax_hpc.exchange import Broker
from relax_hpc.exchange import journal as journal_mod
from relax_hpc.exchange.journal import Journal, JournalCorrupt, JournalLocked, replay

from .helpers import fresh_dir, sample_fields

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _journal_bytes(root, k=6):
    j = Journal(root / "j.jsonl")
    for i in range(k):
        j.append({"op": "x", "i": i, "text": "line\nwith newline é"})
    j.close()
    return (root / "j.jsonl").read_bytes()


@FAST
@given(cut=st.floats(0, 1), tail=st.sampled_from([b"", b"\0" * 37, b"\0" * 9 + b"\n", b'{"op":"x","i":', b"\xff\xfe garbage"]))
def test_torn_tail_is_ignored_then_trimmed(cut, tail):
    root = fresh_dir()
    try:
        full = _journal_bytes(root)
        lines = full.split(b"\n")[:-1]
        p = int(cut * len(full))
        torn = full[:p] + tail
        (root / "j.jsonl").write_bytes(torn)
        complete = full[:p].count(b"\n")
        recs = replay(root / "j.jsonl")
        assert len(recs) == complete
        assert [r.get("i") for r in recs[1:]] == list(range(complete - 1))
        # opening for append trims the tail; the next record lands on a clean line
        j = Journal(root / "j.jsonl")
        assert len(j.records) == max(complete, 1)
        j.append({"op": "after"})
        j.close()
        again = replay(root / "j.jsonl")
        assert again[-1]["op"] == "after" and len(again) == max(complete, 1) + 1
        assert (root / "j.jsonl").read_bytes().startswith(b"\n".join(lines[:complete]))
    finally:
        shutil.rmtree(root)


def test_damage_in_the_middle_is_an_error(xroot):
    full = _journal_bytes(xroot)
    lines = full.split(b"\n")
    lines[3] = lines[3][:10]  # a record that is not the last one is broken
    (xroot / "j.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(JournalCorrupt):
        replay(xroot / "j.jsonl")
    with pytest.raises(JournalCorrupt):
        Journal(xroot / "j.jsonl")


def test_not_a_journal(xroot):
    (xroot / "j.jsonl").write_bytes(b'{"op":"something"}\n')
    with pytest.raises(JournalCorrupt):
        Journal(xroot / "j.jsonl")


def test_one_writer_at_a_time(xroot):
    j = Journal(xroot / "j.jsonl")
    with pytest.raises(JournalLocked):
        Journal(xroot / "j.jsonl")
    with pytest.raises(JournalLocked):
        Broker(xroot, journal_path=xroot / "j.jsonl")
    j.close()
    Journal(xroot / "j.jsonl").close()


def test_broker_rebuilds_without_the_torn_record(xroot):
    from relax_hpc.exchange.chunk import write_chunk

    b = Broker(xroot, tasks={"t": ["tokens"]})
    b.start_step(0)
    r0 = write_chunk(xroot, 0, "p", 0, sample_fields([1], [3]))
    r1 = write_chunk(xroot, 0, "p", 1, sample_fields([2], [3]))
    b.announce(r0)
    b.announce(r1)
    b.close()
    data = (xroot / "journal.jsonl").read_bytes()
    (xroot / "journal.jsonl").write_bytes(data[:-5])  # the crash hit the last announce mid-append
    b = Broker(xroot, tasks={"t": ["tokens"]})
    assert b.torn_tail and [c.id for c in b.chunks()] == [r0.id]
    assert b.orphans() == [r1.dir / "chunk_p_1.h5"]  # on disk, never acknowledged: not in the exchange
    assert b.announce(r1) is True  # the producer that got no reply retries; announces are idempotent
    assert b.announce(r1) is False
    b.close()


def test_a_group_makes_its_records_durable_with_one_sync(xroot):
    """Group commit: every record is written when appended (a reader sees it), and one fdatasync at the end of the
    group covers them all, also when the block raises; outside a group each record is synced alone."""
    j = Journal(xroot / "j.jsonl")
    base = j.syncs
    with j.group():
        for i in range(5):
            j.append({"op": "x", "i": i})
        with j.group():  # nested: the outer end syncs
            j.append({"op": "x", "i": 5})
        assert j.syncs == base  # nothing synced yet
        assert len(replay(xroot / "j.jsonl")) == 1 + 6  # but written: the header record and six more
    assert j.syncs == base + 1
    with pytest.raises(RuntimeError):
        with j.group():
            j.append({"op": "x", "i": 6})
            raise RuntimeError("boom")
    assert j.syncs == base + 2
    with j.group():  # nothing appended: no sync
        pass
    j.append({"op": "x", "i": 7})
    assert j.syncs == base + 3
    j.close()


def test_when_durable_runs_after_the_records_are_synced(xroot, monkeypatch):
    """A deletion waits for its record: inside a group it runs after the group's one sync (none of its own), and
    not at all when that sync fails; outside a group it runs at once, after its sync."""
    j = Journal(xroot / "j.jsonl")
    seen = []
    with j.group():
        j.append({"op": "x"})
        j.when_durable(lambda: seen.append(j.syncs))
        assert seen == []
    assert seen == [j.syncs] and not j._unsynced
    j.append({"op": "y"})
    j.when_durable(lambda: seen.append("now"))
    assert seen[-1] == "now"
    def failing_sync(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(journal_mod, "_datasync", failing_sync)
    with pytest.raises(OSError):
        with j.group():
            j.append({"op": "z"})
            j.when_durable(lambda: seen.append("never"))
    monkeypatch.undo()
    assert "never" not in seen
    with j.group():  # the failed group's callbacks are gone, not carried into the next one
        j.append({"op": "w"})
    assert "never" not in seen
    j.close()


def test_a_broker_group_syncs_a_steps_announces_once(xroot):
    from relax_hpc.exchange.chunk import partition_dir, write_chunk

    b = Broker(xroot / "x", tasks={"train": ["sid", "tokens", "reward"]})
    b.start_step(1)
    refs = [write_chunk(b.root, 1, "p", i, sample_fields([2 * i, 2 * i + 1], [3, 4])) for i in range(4)]
    before = b.journal_syncs
    with b.group():
        for r in refs:
            b.announce(r)
        b.end_step(1)
    assert b.journal_syncs == before + 1 and partition_dir(b.root, 1).is_dir()
    lease = b.request("train", step=1, batch_size=100)
    assert len(lease.chunks) == 4
    b.close()
