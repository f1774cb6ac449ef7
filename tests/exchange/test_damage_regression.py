"""Damage reports that arrive after the quarantine they are about already emptied and cleared the step.

Found by tests/exchange/test_stateful.py: a consumer holds a lease on chunks A and B; B was damaged before it
took the lease (its read failed, it reported B, B was quarantined), A is damaged after. The consumer comes
back and works through the lease again: A fails, is reported and quarantined, and with every chunk of the
step quarantined the step is complete and cleared. B then fails too (its file is in ``quarantine/``) and is
reported again: the broker must still say it is quarantined, not that it found nothing wrong.
"""

from __future__ import annotations

import pytest

from relax_hpc.exchange import Broker, DamagedChunk, read_chunk
from relax_hpc.exchange.chunk import partition_dir

from .helpers import bump_byte, produce, sample_fields

TASKS = {"fwd": ["tokens"], "train": ["tokens"]}


def put(b, root, step, sids):
    return produce(b, root, "roll-a", step, sample_fields(sids, [3] * len(sids)))


def read_or_report(b, lease) -> dict[str, bool]:
    """What a consumer does with a lease: read each chunk, report the ones that fail. chunk -> report's answer."""
    out = {}
    for ref in lease.chunks:
        try:
            read_chunk(ref, lease.fields)
        except DamagedChunk as e:
            out[ref.id] = b.report_damaged(ref.id, e.reason)
    return out


@pytest.mark.parametrize("restart", [False, True])
def test_a_report_after_the_quarantine_cleared_the_step_still_says_quarantined(xroot, restart):
    b = Broker(xroot, tasks=TASKS, auto_clear=True)
    b.start_step(0)
    a, bb = put(b, xroot, 0, [0]), put(b, xroot, 0, [1])
    b.end_step(0)
    bump_byte(bb.path, bb.size - 10)  # same size: the hand-out stat cannot tell
    lease = b.request("fwd", batch_size=2, holder="fwd-0")
    assert [r.id for r in lease.chunks] == [a.id, bb.id]
    assert read_or_report(b, lease) == {bb.id: True}  # the consumer holds the lease (no ack yet)
    bump_byte(a.path, a.size - 10)
    if restart:
        b.close()
        b = Broker(xroot, tasks=TASKS, auto_clear=True)
    (lease,) = b.outstanding(holder="fwd-0")  # the consumer comes back and works through its lease again
    assert read_or_report(b, lease) == {a.id: True, bb.id: True}
    assert b.uncleared() == [] and not partition_dir(xroot, 0).exists()  # all quarantined: complete, cleared
    assert sorted(d["chunk"] for d in b.damaged()) == sorted([a.id, bb.id])
    assert b.quarantined(0) and (xroot / "quarantine" / "step_0" / (a.name + ".h5")).exists()
    b.ack(lease.id)  # the lease was dropped with the step: a late ack is a no-op
    b.close()


def test_a_report_for_a_chunk_consumed_and_cleared_is_false(xroot):
    """A chunk every task consumed before its step was cleared was never found damaged: nothing to quarantine."""
    b = Broker(xroot, tasks=TASKS, auto_clear=True)
    b.start_step(0)
    r = put(b, xroot, 0, [0])
    b.end_step(0)
    for task in TASKS:
        b.ack(b.request(task, batch_size=1).id)
    assert b.uncleared() == []
    assert b.report_damaged(r.id, "late reader") is False
    assert b.damaged() == []
    b.close()


def test_verify_all_survives_a_quarantine_that_clears_the_step(xroot):
    """verify_all lists the chunks first; quarantining one may complete and clear its step, with a consumed chunk
    of that step still on the list after it."""
    b = Broker(xroot, tasks=TASKS, max_staleness=1, auto_clear=True)
    b.start_step(0)
    bad, done = put(b, xroot, 0, [0]), put(b, xroot, 0, [1])
    b.end_step(0)
    b.ack(b.request("fwd", batch_size=2).id)
    held = b.request("train", batch_size=1, holder="train-0")  # train holds the first, consumes the second
    assert [r.id for r in held.chunks] == [bad.id]
    b.ack(b.request("train", batch_size=1).id)
    b.start_step(1)  # a step that stays
    other = put(b, xroot, 1, [2])
    bump_byte(bad.path, bad.size - 10)
    assert b.verify_all() == [bad.id]
    assert b.uncleared() == [1] and [r.id for r in b.chunks()] == [other.id]
    assert [d["chunk"] for d in b.damaged()] == [bad.id]
    assert b.outstanding() == []  # the held lease went with the step
    b.close()


class Draws:
    """hypothesis' ``data`` for a rule called by hand: each ``draw`` from a ``sampled_from`` takes the first element
    the next predicate accepts."""

    def __init__(self, *picks):
        self.picks = list(picks)

    def draw(self, strategy):
        pick = self.picks.pop(0)
        return next(e for e in strategy.elements if pick(e))


def test_the_property_test_s_sequence_a_held_chunk_reported_after_its_step_cleared(monkeypatch):
    """The sequence tests/exchange/test_stateful.py found, replayed through its own state machine (every model
    check on): step 0's chunks are made, ``fwd`` consumes them, the other tasks consume the first; one chunk file is
    bit-flipped and ``ref`` holds a batch of the other two (it reads them, the flipped one is quarantined); a second
    chunk file is bit-flipped and ``ref`` comes back to its lease: the first read fails and its quarantine completes
    and clears step 0, then ``step_0/chunk_roll-a_2`` fails to read (its file is in ``quarantine/``, already gone)
    and is reported: the broker must say it is quarantined (it used to say False, failing the model's assertion)."""
    from . import test_stateful
    from .test_stateful import Exchange

    monkeypatch.setattr(test_stateful, "event", lambda *a, **k: None)  # hypothesis' statistics: only inside a test

    def chunk(name):
        return lambda c: c.ref.name == f"chunk_{name}"

    def main_file(c):
        return c.endswith(".h5") and c.count(".") == 1

    m = Exchange()
    try:
        m.setup(k=0, auto=True, first=[[1]])
        m.produce_into_the_newest_step(producer="roll-a", lens=[1])  # a step's chunks are made
        m.produce_into_the_newest_step(producer="roll-a", lens=[1])
        m.end_step_(0)
        m.consume(task="fwd", batch=8, data=Draws(lambda h: h == "fwd-0"), outcome="ack")
        for task in ("ref", "adv", "train"):  # the first chunk: consumed by every task
            m.consume(task=task, batch=1, data=Draws(lambda h, t=task: h == f"{t}-0"), outcome="ack")
        m.damage_a_file(data=Draws(chunk("roll-a_2"), main_file), mode="flip", frac=0.5)
        m.consume(task="ref", batch=8, data=Draws(lambda h: h == "ref-1"), outcome="hold")
        assert [d["chunk"] for d in m.b.damaged()] == ["step_0/chunk_roll-a_2"]
        m.damage_a_file(data=Draws(chunk("roll-a_1"), main_file), mode="flip", frac=0.5)
        m.consumer_reconnects(holder="ref-1")  # asserts report_damaged is True for both
        assert m.b.uncleared() == [] and sorted(d["chunk"] for d in m.b.damaged()) == [
            "step_0/chunk_roll-a_1", "step_0/chunk_roll-a_2"]
    finally:
        m.teardown()
