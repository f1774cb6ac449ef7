"""The broker, rule by rule: fields gate consumption, leases, restarts, damage, clearing."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from relax_hpc.exchange import (
    Broker,
    ChunkExists,
    ChunkQuarantined,
    DamagedChunk,
    FieldConflict,
    LeaseLost,
    StepCleared,
    StepEnded,
    StepNotComplete,
    StepNotStarted,
    UnknownChunk,
    UnknownTask,
    read_chunk,
    replay,
    write_chunk,
    write_fields,
)
from relax_hpc.exchange.chunk import partition_dir

from .helpers import add_fields, flip_byte, produce, sample_fields, tokens_for, truncate

TASKS = {"fwd": ["tokens"], "train": ["tokens", "log_probs"]}


def broker(root, **kw) -> Broker:
    return Broker(root, tasks=kw.pop("tasks", TASKS), max_staleness=kw.pop("max_staleness", 2), **kw)


def put(b, root, step, sids, producer="p"):
    return produce(b, root, producer, step, sample_fields(sids, [3] * len(sids)))


def lp_for(ref):
    return {"log_probs": [np.full(3, 0.5, np.float32)] * ref.n}


def test_a_consumer_gets_only_chunks_with_all_its_fields(xroot):
    b = broker(xroot)
    b.start_step(0)
    r0, r1 = put(b, xroot, 0, [0, 1]), put(b, xroot, 0, [2])
    assert b.request("train", batch_size=10) is None  # no log_probs yet
    lease = b.request("fwd", batch_size=10, holder="fwd0")
    assert [c.id for c in lease.chunks] == [r0.id, r1.id] and lease.n == 3
    assert b.request("fwd", batch_size=10) is None  # leased: not handed out twice
    assert add_fields(b, lease.chunks[1], "actor_fwd", lp_for(r1))
    got = b.request("train", batch_size=10, holder="a0")
    assert [c.id for c in got.chunks] == [r1.id] and "log_probs" in got.chunks[0].all_fields
    data = read_chunk(got.chunks[0], got.fields)
    assert data["tokens"][0].tolist() == tokens_for(2, 3).tolist()
    # asking for fewer fields than the task's is allowed (Relax's get_meta takes fields per call)
    b.ack(got.id)
    assert b.request("train", ["tokens"], 10).chunks[0].id == r0.id


def test_batches_are_fifo_prefixes_bounded_by_batch_size(xroot):
    b = broker(xroot)
    b.start_step(0)
    b.start_step(1)
    refs = [put(b, xroot, 1, [10, 11, 12]), put(b, xroot, 0, [0, 1]), put(b, xroot, 0, [2, 3, 4]), put(b, xroot, 0, [5])]
    lease = b.request("fwd", batch_size=4)
    assert [c.id for c in lease.chunks] == [refs[1].id]  # the next (3 samples) would make 5 > 4
    lease = b.request("fwd", batch_size=1)
    assert [c.id for c in lease.chunks] == [refs[2].id]  # a chunk larger than the batch comes alone
    assert b.request("fwd", batch_size=10, step=1).chunks[0].id == refs[0].id
    assert b.request("fwd", batch_size=10, min_samples=2) is None  # only refs[3] (1 sample) is left
    assert b.request("fwd", batch_size=10).chunks[0].id == refs[3].id


def test_request_waits_for_an_announce(xroot):
    """A request with a timeout blocks until an announce wakes it: the chunk is put only once the consumer is
    seen waiting on the broker's condition (no timer races the request)."""
    b = broker(xroot)
    b.start_step(0)
    got = []
    consumer = threading.Thread(target=lambda: got.append(b.request("fwd", batch_size=1, timeout=60)))
    consumer.start()
    deadline = time.monotonic() + 30
    while not b._cond._waiters and time.monotonic() < deadline:  # the request found nothing and waits
        time.sleep(0.001)
    assert b._cond._waiters, "the request never waited"
    ref = put(b, xroot, 0, [1])
    consumer.join(30)
    assert not consumer.is_alive() and [c.id for c in got[0].chunks] == [ref.id]


def test_ack_release_and_lost_leases(xroot):
    b = broker(xroot, auto_clear=False)
    b.start_step(0)
    put(b, xroot, 0, [1])
    lease = b.request("fwd", holder="h1")
    assert b.release(lease.id) is True and b.release(lease.id) is False
    with pytest.raises(LeaseLost):
        b.ack(lease.id)  # its chunks may be with someone else now
    again = b.request("fwd", holder="h2")
    assert again.chunks == lease.chunks
    b.ack(again.id)
    b.ack(again.id)  # idempotent: a consumer retrying after a lost reply
    assert b.request("fwd") is None
    with pytest.raises(LeaseLost):
        b.ack("L999")
    with pytest.raises(UnknownTask):
        b.request("nope")


def test_leases_survive_a_broker_restart(xroot):
    b = broker(xroot)
    b.start_step(0)
    put(b, xroot, 0, [1])
    put(b, xroot, 0, [2])
    l1 = b.request("fwd", holder="fwd-0")  # the reply to this was lost in the crash
    b.close()
    b = broker(xroot)
    assert [x.id for x in b.outstanding(holder="fwd-0")] == [l1.id]
    l2 = b.request("fwd", holder="fwd-1")
    assert l2.chunks[0].id != l1.chunks[0].id  # still leased: not handed out twice
    resumed = b.outstanding(holder="fwd-0", task="fwd")  # the restarted consumer takes its leases back
    assert [x.id for x in resumed] == [l1.id]
    assert read_chunk(resumed[0].chunks[0], resumed[0].fields)["tokens"][0].tolist() == tokens_for(1, 3).tolist()
    b.ack(l1.id)
    # a consumer that died: the controller releases what it held
    assert b.release_holder("fwd-1") == [l2.id]
    assert b.request("fwd", holder="fwd-2").chunks == l2.chunks


def test_an_orphans_name_is_never_replaced_after_a_restart(xroot):
    b = broker(xroot)
    b.start_step(0)
    put(b, xroot, 0, [1], producer="roll")
    # a producer died between its rename and its announce: the file is there, the broker never heard of it
    orphan = write_chunk(xroot, 0, "roll", 1, sample_fields([99], [3]))
    b.close()
    b = broker(xroot)
    assert b.next_seq("roll") == 1 and b.orphans() == [partition_dir(xroot, 0) / "chunk_roll_1.h5"]
    with pytest.raises(ChunkExists):  # the seq the controller hands out next: the orphan's file is not replaced
        write_chunk(xroot, 0, "roll", b.next_seq("roll"), sample_fields([2], [3]))
    assert read_chunk(orphan)["sid"].tolist() == [99]
    assert b.rewind(-1) == [0] and not partition_dir(xroot, 0).exists()  # a resumed run removes it with its step


def test_announce_checks(xroot):
    b = broker(xroot)
    partition_dir(xroot, 5).mkdir()
    with pytest.raises(StepNotStarted):
        b.announce(write_chunk(xroot, 5, "p", 0, {"tokens": [[1]]}))
    b.start_step(0)
    ref = write_chunk(xroot, 0, "p", 0, {"tokens": [[1]]})
    flip_byte(ref.path, 20)  # damaged before the announce: the header no longer matches
    with pytest.raises(DamagedChunk):
        b.announce(ref)
    ref2 = write_chunk(xroot, 0, "p", 1, {"tokens": [[1]]})
    b.announce(ref2)
    b.end_step(0)
    with pytest.raises(StepEnded):
        b.announce(write_chunk(xroot, 0, "p", 2, {"tokens": [[1]]}))
    with pytest.raises(UnknownChunk):
        b.add_fields(write_fields(ref, "w", {"log_probs": [[0.0]]}))


def test_field_writes_first_wins_and_are_idempotent(xroot):
    b = broker(xroot)
    b.start_step(0)
    ref = put(b, xroot, 0, [1, 2])
    side = write_fields(ref, "actor_fwd", lp_for(ref))
    assert b.add_fields(side) is True and b.add_fields(side) is False
    other = write_fields(ref, "actor_fwd-1", {"log_probs": [np.zeros(3, np.float32)] * 2})
    with pytest.raises(FieldConflict):
        b.add_fields(other)
    current = next(r for r in b.chunks(0) if r.id == ref.id)  # what a lease shows a writer now
    assert add_fields(b, current, "actor_fwd-1", {"log_probs": [np.ones(3, np.float32)] * 2}) is False
    files = sorted(os.listdir(ref.dir))
    assert files == sorted(["chunk_p_0.h5", side.file, other.file])  # a writer that sees the field writes nothing
    got = b.request("train", batch_size=2)
    assert read_chunk(got.chunks[0], ["log_probs"])["log_probs"][0].tolist() == [0.5] * 3


def test_truncated_file_is_quarantined_at_hand_out_and_never_delivered(xroot):
    b = broker(xroot)
    b.start_step(0)
    r0, r1 = put(b, xroot, 0, [1]), put(b, xroot, 0, [2])
    truncate(r0.path, 100)
    lease = b.request("fwd", batch_size=5)
    assert [c.id for c in lease.chunks] == [r1.id]
    assert [d["chunk"] for d in b.damaged()] == [r0.id]
    assert (xroot / "quarantine" / "step_0" / "chunk_p_0.h5").exists()
    with pytest.raises(ChunkQuarantined):
        b.add_fields(dataclasses.replace(write_fields(r1, "w", lp_for(r1)), chunk=r0.id))


def test_altered_file_is_reported_reverified_and_quarantined(xroot):
    b = broker(xroot)
    b.start_step(0)
    r0, r1 = put(b, xroot, 0, [1]), put(b, xroot, 0, [2])
    flip_byte(r0.path, r0.size - 10)  # same size: only a full read can tell
    lease = b.request("fwd", batch_size=5, holder="fwd0")
    assert [x.id for x in lease.chunks] == [r0.id, r1.id]  # same size: the hand-out stat cannot tell
    read = []
    for ref in lease.chunks:
        try:
            read_chunk(ref, lease.fields)
            read.append(ref.id)
        except DamagedChunk as e:  # the consumer reports it; the broker re-verifies and quarantines
            assert b.report_damaged(ref.id, e.reason) is True
    assert read == [r1.id]
    assert [d["chunk"] for d in b.damaged()] == [r0.id] and "altered" in b.damaged()[0]["reason"]
    b.ack(lease.id)
    # a consumer's report alone does not quarantine a sound chunk: the broker checks for itself
    assert b.report_damaged(r1.id, "my NFS mount is flaky") is False
    assert b.damaged()[-1]["chunk"] == r0.id
    b.close()
    b = broker(xroot)  # the quarantine is journaled
    assert [d["chunk"] for d in b.damaged()] == [r0.id]
    assert b.verify_all() == []


def test_verify_all_finds_silent_damage(xroot):
    b = broker(xroot)
    b.start_step(0)
    r0 = put(b, xroot, 0, [1])
    flip_byte(r0.path, 600)
    assert b.verify_all() == [r0.id]
    assert b.request("fwd") is None


def test_clear_when_complete_or_forced(xroot):
    b = broker(xroot, auto_clear=False)
    b.start_step(0)
    ref = put(b, xroot, 0, [1])
    with pytest.raises(StepNotComplete):
        b.clear(0)
    for task in ("fwd", "train"):
        if task == "train":
            add_fields(b, ref, "actor_fwd", lp_for(ref))
        b.ack(b.request(task).id)
    assert not b.complete(0)  # not ended: more chunks may come
    b.end_step(0)
    assert b.complete(0) and b.clear(0) and not partition_dir(xroot, 0).exists()
    assert b.clear(0) is False
    with pytest.raises(StepCleared):
        b.start_step(0)
    b.start_step(1)
    put(b, xroot, 1, [5])
    lease = b.request("fwd")
    assert b.clear(1, force=True)
    b.ack(lease.id)  # the lease was voided with its step; acking it is harmless
    rec = [r for r in replay(b.journal_path) if r["op"] == "cleared"]
    assert [(r["step"], r["forced"], r["unconsumed"]) for r in rec] == [(0, False, 0), (1, True, 1)]


def test_auto_clear_and_crash_between_journal_and_delete(xroot):
    b = broker(xroot)
    b.start_step(0)
    ref = put(b, xroot, 0, [1])
    b.end_step(0)
    b.ack(b.request("fwd").id)
    add_fields(b, ref, "actor_fwd", lp_for(ref))
    b.ack(b.request("train").id)
    assert b.uncleared() == [] and not partition_dir(xroot, 0).exists()
    b.close()
    partition_dir(xroot, 0).mkdir()  # as if the crash hit after the journal record, before the delete
    (partition_dir(xroot, 0) / "chunk_p_0.h5").write_bytes(b"left over")
    b = broker(xroot)
    assert not partition_dir(xroot, 0).exists() and b.stats()["cleared"] == 1


def test_a_cleared_step_is_deleted_off_the_callers_path(xroot):
    """Clearing renames the partition away at once (the name is free, the step gone from view) and a background
    thread deletes it; close() waits for that. A trash directory a crash left is removed at the next open."""
    b = broker(xroot)
    b.start_step(0)
    ref = put(b, xroot, 0, [1, 2])
    b.end_step(0)
    b.ack(b.request("fwd").id)
    add_fields(b, ref, "actor_fwd", lp_for(ref))
    with b.group():
        b.ack(b.request("train").id)  # completes the step: cleared, its files moved only after the group's sync
        assert partition_dir(xroot, 0).exists()
    assert not partition_dir(xroot, 0).exists()
    b.close()
    assert not [p for p in os.listdir(xroot) if p.startswith(".trash_")]
    left = xroot / ".trash_step_0_deadbeef"
    (left / "sub").mkdir(parents=True)
    (left / "sub" / "chunk_p_0.h5").write_bytes(b"x" * 100)
    broker(xroot).close()
    assert not left.exists()


def test_staleness_gate_rules(xroot):
    b = broker(xroot, max_staleness=1)
    assert b.may_start(0) and b.start_step(0)
    assert b.start_step(1)  # 1 - 0 <= 1
    assert not b.may_start(2) and b.start_step(2) is False
    assert b.start_step(1)  # already started: fine (a restarted producer)
    b.end_step(0)
    b.clear(0, force=True)
    assert b.start_step(2)
    st = b.stats()
    assert st["uncleared"] == [1, 2] and st["min_uncleared"] == 1
    # start_step can wait for the gate to open
    threading.Timer(0.2, lambda: (b.end_step(1), b.clear(1, force=True))).start()
    assert b.start_step(3, timeout=10)


def test_progress_and_stats(xroot):
    b = broker(xroot)
    b.start_step(0)
    r0, _r1 = put(b, xroot, 0, [1, 2]), put(b, xroot, 0, [3])
    b.request("fwd", batch_size=2)
    add_fields(b, r0, "actor_fwd", lp_for(r0))
    p = b.progress("train", 0)
    assert (p["samples"], p["ready"], p["waiting"], p["drained"]) == (3, 2, 1, False)
    assert b.progress("fwd", 0)["leased"] == 2
    s = b.stats()
    assert s["steps"]["0"]["samples"] == 3 and s["leases"] == 1 and s["samples_in"] == 3


def test_quarantined_is_never_handed_out_even_without_file_checks(xroot):
    b = broker(xroot, check_files=False)  # the broker's own stats off: only the quarantine flag stops it
    b.start_step(0)
    r0, r1 = put(b, xroot, 0, [1]), put(b, xroot, 0, [2])
    assert b.quarantine(r0.id, "operator says so") and not b.quarantine(r0.id, "again")
    assert [c.id for c in b.request("fwd", batch_size=5).chunks] == [r1.id]
    b.close()
    b = broker(xroot, check_files=False)
    assert b.request("fwd", batch_size=5) is None and [d["chunk"] for d in b.damaged()] == [r0.id]


def test_wire_forms_and_status_are_json(xroot):
    import json

    from relax_hpc.exchange import Lease

    b = broker(xroot)
    b.start_step(0)
    ref = put(b, xroot, 0, [1, 2])
    add_fields(b, ref, "actor_fwd", lp_for(ref))
    lease = b.request("train", batch_size=4, holder="a0")
    again = Lease.from_dict(json.loads(json.dumps(lease.to_dict())))
    assert again == lease and again.chunks[0].sides == lease.chunks[0].sides
    assert read_chunk(again.chunks[0], ["log_probs"])["log_probs"][1].tolist() == [0.5] * 3
    json.dumps(b.stats())
    json.dumps(b.progress("train", 0))
    json.dumps(b.damaged())


def test_rewind_voids_later_partitions_across_a_restart_and_the_audit_counts_once(xroot):
    """A run resumed from the checkpoint of step 1 produces steps 2.. again: rewind forgets them (cleared or
    not, and unannounced leftovers on disk), a restarted broker agrees, and the journal audit counts only
    the partitions' current lives."""
    from relax_hpc.exchange.audit import audit, exactly_once

    tasks = {"train": ["tokens"]}
    b = broker(xroot, tasks=tasks, max_staleness=0)
    for step in (1, 2):
        b.start_step(step)
        put(b, xroot, step, [step * 10, step * 10 + 1])
        b.end_step(step)
        b.ack(b.request("train", batch_size=10, step=step).id)  # consumed: cleared
    b.start_step(3)
    put(b, xroot, 3, [30])  # produced, not consumed: the attempt died here
    stray = partition_dir(xroot, 4)
    stray.mkdir()
    assert b.uncleared() == [3]
    assert b.rewind(1) == [2, 3, 4]
    assert not partition_dir(xroot, 3).exists() and not stray.exists()
    b.close()
    b = broker(xroot, tasks=tasks, max_staleness=0)
    assert b.uncleared() == [] and b.rewind(1) == []
    for step in (2, 3):  # produced again, with other content, and consumed
        assert b.start_step(step)
        put(b, xroot, step, [step * 100])
        b.end_step(step)
        b.ack(b.request("train", batch_size=10, step=step).id)
    b.close()
    a = audit(xroot / "journal.jsonl")
    assert {s: (x.samples, x.consumed, x.cleared, x.rewinds) for s, x in a.items()} == {
        1: (2, {"train": 2}, True, 0), 2: (1, {"train": 1}, True, 1), 3: (1, {"train": 1}, True, 1)}
    assert exactly_once(xroot / "journal.jsonl", ["train"]) == []


def test_a_damaged_step_is_regenerated_and_the_audit_counts_it_once(xroot):
    """Step 2's chunk is truncated after its announce: the train request quarantines it at hand-out, which
    empties (and auto-clears) the step; regenerate voids it (journaled), the step starts again and is
    produced and consumed anew. The reference had consumed the damaged chunk before: the audit counts that
    consumption neither, and exactly_once holds across a broker restart."""
    from relax_hpc.exchange.audit import audit, exactly_once

    tasks = {"ref": ["tokens"], "train": ["tokens"]}
    b = broker(xroot, tasks=tasks, max_staleness=1)
    b.start_step(1)
    put(b, xroot, 1, [10, 11])
    b.end_step(1)
    b.start_step(2)
    bad = put(b, xroot, 2, [20, 21])
    b.end_step(2)
    b.ack(b.request("ref", batch_size=10, step=2).id)  # the reference read it while it was sound
    truncate(bad.path, bad.size - 7)
    assert b.request("train", batch_size=10, step=2) is None
    assert [d["chunk"] for d in b.quarantined(2)] == [bad.id] and 2 not in b.uncleared()  # emptied, cleared
    assert b.quarantined(1) == []
    with pytest.raises(Exception, match="no quarantined chunk"):
        b.regenerate(1, "sound steps are never produced twice")
    assert b.regenerate(2, "damaged") == [bad.id]
    assert b.quarantined(2) == [] and not partition_dir(xroot, 2).exists()
    assert (xroot / "quarantine" / "step_2" / os.path.basename(bad.path)).exists()  # kept for post-mortem
    b.close()
    b = broker(xroot, tasks=tasks, max_staleness=1)  # the void survives a restart
    assert b.uncleared() == [1] and b.start_step(2)
    for step, sids in ((1, None), (2, [22, 23])):
        if sids:
            put(b, xroot, 2, sids)
            b.end_step(2)
        for task in ("ref", "train"):
            b.ack(b.request(task, batch_size=10, step=step).id)
    assert b.uncleared() == []
    b.close()
    a = audit(xroot / "journal.jsonl")
    assert (a[2].samples, a[2].consumed, a[2].quarantined, a[2].regenerated, a[2].lost) == \
        (2, {"ref": 2, "train": 2}, [bad.id], 1, 0)
    assert exactly_once(xroot / "journal.jsonl", ["ref", "train"]) == []


def test_audit_reports_quarantined_samples_never_produced_again(xroot):
    from relax_hpc.exchange.audit import audit, exactly_once

    b = broker(xroot, tasks={"train": ["tokens"]})
    b.start_step(1)
    ok, bad = put(b, xroot, 1, [1]), put(b, xroot, 1, [2, 3])
    b.end_step(1)
    flip_byte(bad.path, bad.size // 2)
    assert b.report_damaged(bad.id, "reader: checksum") is True
    b.ack(b.request("train", batch_size=10, step=1).id)
    assert [c.id for c in b.chunks()] == [] and 1 not in b.uncleared()  # complete: consumed or quarantined
    b.close()
    a = audit(xroot / "journal.jsonl")[1]
    assert (a.samples, a.consumed, a.quarantined, a.lost) == (1, {"train": 1}, [bad.id], 2)
    assert exactly_once(xroot / "journal.jsonl", ["train"]) == [
        "step 1: 2 samples of quarantined chunks were never produced again"]
    assert ok.id not in a.quarantined


def test_a_chunk_written_but_never_announced_is_set_aside_so_its_step_can_be_written_again(xroot):
    """A producer killed between writing its chunk and reporting it leaves the file; the step generated again
    takes the same seq (the broker's next) and must not fail on that name."""
    b = broker(xroot)
    b.start_step(0)
    kept = put(b, xroot, 0, [0])  # announced: stays
    seq = b.next_seq("p")
    write_chunk(xroot, 0, "p", seq, sample_fields([1], [3]))  # written, never announced: its writer died
    with pytest.raises(ChunkExists):  # the failure a restarted producer met
        write_chunk(xroot, 0, "p", seq, sample_fields([2], [3]))
    assert b.set_aside_unannounced(0, "p") == [f"chunk_p_{seq}.h5"]
    assert (xroot / "quarantine" / "step_0" / f"chunk_p_{seq}.h5.unannounced").exists()
    assert b.announce(write_chunk(xroot, 0, "p", seq, sample_fields([2], [3])))
    assert b.set_aside_unannounced(0, "p") == []  # announced chunks are never moved
    assert [c.id for c in b.request("fwd", batch_size=10).chunks] == [kept.id, f"step_0/chunk_p_{seq}"]
