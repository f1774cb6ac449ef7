"""A chunk damaged after its announce is quarantined, its step generated again, and nothing damaged is trained on.

The controller's test hook ``RELAX_TEST_DAMAGE_CHUNK=<step>:truncate`` cuts step 2's chunk in half right after
its announce (deterministic: no timer races the actor). The train request's hand-out check finds it, the broker
quarantines it, the training loop voids step 2 and assigns ``generate(2)`` again: the run completes, state.json
has the ``chunk_quarantined`` event, the step's metrics count it, and the journal audit is exactly once (the
quarantined samples count neither as produced nor consumed). The run is test_segments.py's
(``damaged_segments_run``: some rollouts come as segments, which the regenerated step makes again).
"""

from __future__ import annotations

import pytest

from relax_hpc.exchange.audit import audit, exactly_once

from .conftest import SEGMENT_STEPS, metrics, state

STEPS = SEGMENT_STEPS


@pytest.mark.slow
def test_a_truncated_chunk_is_quarantined_and_its_step_generated_again(damaged_segments_run):
    run, final = damaged_segments_run
    assert final["state"] == "COMPLETED", final["reason"]
    events = [e for e in state(run)["events"] if e["event"] == "chunk_quarantined"]
    assert len(events) == 1 and events[0]["detail"].startswith("step 2: step_2/chunk_rollout_"), events
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["exchange/quarantined"] for r in rows] == [0.0, 1.0, 0.0]
    journal = run.path / "exchange" / "journal.jsonl"
    a = audit(journal)
    assert (len(a[2].quarantined), a[2].regenerated, a[2].lost) == (1, 1, 0)
    assert all(not x.quarantined for s, x in a.items() if s != 2)
    assert exactly_once(journal, ["train"]) == []
    assert list((run.path / "exchange" / "quarantine" / "step_2").iterdir())  # kept for post-mortem
