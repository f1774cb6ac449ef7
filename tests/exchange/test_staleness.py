"""The staleness gate with a fast rollout and a slow trainer, asserted from the journal alone."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax_hpc.exchange import Broker, read_chunk, replay
from relax_hpc.exchange.staleness import audit, satisfies

from .helpers import produce

STEPS = 6


def test_rule():
    assert satisfies(5, [], 0)  # nothing uncleared
    assert not satisfies(1, [0], 0)  # k=0: step N+1 waits for N to be cleared
    assert satisfies(1, [0], 1) and not satisfies(2, [0, 1], 1)
    assert satisfies(3, [1, 2], 2) and not satisfies(3, [0, 2], 2)


@given(events=st.lists(st.tuples(st.sampled_from(["start", "cleared"]), st.integers(0, 6)), max_size=30),
       k=st.integers(0, 3))
@settings(max_examples=200, deadline=None)
def test_audit_agrees_with_the_rule(events, k):
    uncleared, recs, bad = set(), [], 0
    for op, step in events:
        if op == "start":
            bad += not satisfies(step, uncleared, k)
            uncleared.add(step)
        else:
            uncleared.discard(step)
        recs.append({"op": op, "step": step, "max_staleness": k})
    assert len(audit(recs)["violations"]) == bad


@pytest.mark.parametrize("k", [0, 1, 2])
def test_rollout_never_runs_more_than_k_steps_ahead(xroot, k):
    """Rollout produces as fast as the gate lets it; the trainer acks step s only once rollout has started
    step s+k (an event, not a timer), so the gate is what holds rollout back and the lead k is reached on
    every run. From the journal: with k=0 every step starts with nothing uncleared (strictly on-policy);
    with k, no start is more than k steps past the oldest uncleared one, and k is reached."""
    b = Broker(xroot, tasks={"train": ["tokens"]}, max_staleness=k)
    errors = []
    started = [threading.Event() for _ in range(STEPS)]

    def rollout():
        try:
            for s in range(STEPS):
                assert b.start_step(s, timeout=30), f"step {s} never started"
                started[s].set()
                for _ in range(2):
                    produce(b, xroot, "rollout", s, {"tokens": [[s, 1, 2]] * 2, "step": [s, s]})
                b.end_step(s)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def train():
        try:
            deadline = time.monotonic() + 30
            for s in range(STEPS):  # the actor trains on step s's partition: 4 samples in 2 chunks
                leases = []
                while sum(x.n for x in leases) < 4 and time.monotonic() < deadline:
                    if s in b.uncleared():
                        lease = b.request("train", ["tokens", "step"], 4, step=s, holder="actor-0", timeout=0.1)
                        if lease is not None:
                            steps = {int(x) for ref in lease.chunks for x in read_chunk(ref, lease.fields)["step"]}
                            assert steps == {s}
                            leases.append(lease)
                    else:
                        time.sleep(0.005)
                # the optimizer step lasts until rollout is as far ahead as the gate allows
                assert started[min(s + k, STEPS - 1)].wait(30), f"rollout never started step {min(s + k, STEPS - 1)}"
                for lease in leases:
                    b.ack(lease.id)  # the last ack of an ended step clears it (auto_clear)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rollout), threading.Thread(target=train)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    b.close()

    records = replay(xroot / "journal.jsonl")
    result = audit(records)
    assert result["violations"] == [] and result["starts"] == STEPS
    starts = [r for r in records if r["op"] == "start"]
    if k == 0:
        assert all(r["min_uncleared"] is None for r in starts)  # never ahead
        assert result["max_lead"] == -1
    else:
        assert result["max_lead"] == k  # ahead by k at most, and the fast rollout got there
    # training saw every step once, in order
    cleared = [r["step"] for r in records if r["op"] == "cleared"]
    assert cleared == list(range(STEPS))
