"""The journal audit's count of prompts per epoch: from the prompt groups each chunk's attrs name (the rollout
role's :func:`prompt_attrs`), over the partitions' current lives, so a resume's rewound steps and a quarantined
chunk count for nothing, and a prompt trained twice in an epoch is a violation."""

from __future__ import annotations

import json

from relax_hpc.exchange.audit import chunk_prompts, epochs, prompt_attrs, prompt_violations
from relax_hpc.exchange.broker import Broker

from .helpers import flip_byte, produce, sample_fields

N = 4  # prompts in the dataset: group indices 0-3 are epoch 0, 4-7 epoch 1, ...


def step(b: Broker, root, n: int, groups: list[int], consume: bool = True):
    """Step ``n`` as the rollout role writes it: one chunk of two samples per prompt group, its groups in attrs."""
    b.start_step(n)
    sids = [g for g in groups for _ in range(2)]
    ref = produce(b, root, "rollout", n, sample_fields(sids, [3] * len(sids)), prompt_attrs(sids, N))
    b.end_step(n)
    if consume:
        b.ack(b.request("train", batch_size=100, step=n).id)
    return ref


def test_prompt_attrs_are_runs_of_group_indices():
    attrs = prompt_attrs([7, 3, 4, 4, None, 5, 9, 3], 6)
    assert attrs == {"prompts": {"per_epoch": 6, "groups": [[3, 6], [7, 8], [9, 10]]}}
    assert chunk_prompts(json.loads(json.dumps(attrs))) == (6, [3, 4, 5, 7, 9])
    assert chunk_prompts({"group_size": 2}) is None  # a chunk of an older run


def test_prompts_per_epoch_count_current_lives_only(xroot):
    """Epoch 0 is trained over steps 1-2 (prompt 3 late, as from partial rollout's buffer); a resume from step 2
    rewinds step 3 (its prompts count once, as produced again); step 4's chunk is quarantined and the step
    generated again. Then a bug trains prompt 5 of epoch 1 twice: the audit says so."""
    b = Broker(xroot, tasks={"train": ["tokens"]}, max_staleness=2)
    step(b, xroot, 1, [0, 1, 2])
    step(b, xroot, 2, [4, 3])
    step(b, xroot, 3, [5, 6], consume=False)  # the attempt ends before it is trained
    assert b.rewind(2) == [3]
    step(b, xroot, 3, [5, 6])
    bad = step(b, xroot, 4, [7], consume=False)
    flip_byte(bad.path, bad.size // 2)
    assert b.report_damaged(bad.id, "reader: checksum")
    b.regenerate(4, "damaged")
    step(b, xroot, 4, [7])
    per_epoch, unrecorded = epochs(xroot / "journal.jsonl")
    assert unrecorded == 0 and prompt_violations(per_epoch) == []
    assert {e: (a.prompts, a.trained, a.twice) for e, a in per_epoch.items()} == {0: (4, 4, []), 1: (4, 4, [])}

    step(b, xroot, 5, [8, 5])  # epoch 2's first prompt, and epoch 1's prompt 5 again
    per_epoch, _ = epochs(xroot / "journal.jsonl")
    assert (per_epoch[1].trained, per_epoch[1].twice, per_epoch[2].trained) == (4, [5], 1)
    assert prompt_violations(per_epoch) == ["epoch 1: 1 prompt(s) trained more than once (group indices [5])"]
    b.close()
