"""Rollout samples → chunk file → the actor's batch: the fields survive the trip, checksums guard it, and
advantages are the normalized rewards over the response tokens."""

import numpy as np
import pytest
import torch

from relax_hpc.algo import AlgorithmConfig
from relax_hpc.exchange.chunk import DamagedChunk
from relax_hpc.roles import samples as S
from relax_hpc.rollout.driver import RolloutResult
from relax_hpc.rollout.sample import Sample, SampleStatus


def result() -> RolloutResult:
    samples = []
    for i, (prompt, resp, lp) in enumerate([([5, 6, 7], [8], [-0.5]), ([5, 6, 7], [9, 2], [-1.0, -0.1]),
                                            ([3, 4], [1], [-2.0]), ([3, 4], [1, 2, 2], [-0.3, -0.2, -0.1])]):
        s = Sample(group_index=i // 2, index=i, prompt=f"p{i // 2}", label=str(i), tokens=list(prompt))
        s.append_response(resp, f"r{i}", lp)
        s.weight_versions.append("7")
        s.status = SampleStatus.COMPLETED
        samples.append(s)
    samples[3].loss_mask = [1, 1, 0]
    return RolloutResult(samples=samples, raw_rewards=[1.0, 0.0, 0.5, 0.5], rewards=[0.7, -0.7, 0.0, 0.0],
                         metrics={}, group_size=2)


def test_chunk_round_trip_and_train_batch(tmp_path):
    ref = S.write_step(tmp_path, 3, result())
    assert ref.step == 3 and ref.n == 4 and (tmp_path / "exchange" / "step_3").is_dir()
    rows = S.read_samples([ref.to_dict()])
    assert [list(r["tokens"]) for r in rows] == [[5, 6, 7, 8], [5, 6, 7, 9, 2], [3, 4, 1], [3, 4, 1, 2, 2]]
    assert [r["weight_version"] for r in rows] == ["7"] * 4 and [int(r["index"]) for r in rows] == [0, 1, 2, 3]
    batch = S.to_train_batch(rows, AlgorithmConfig())
    assert [b["response_start"] for b in batch] == [3, 3, 2, 2]
    assert torch.allclose(batch[1]["advantages"], torch.tensor([-0.7, -0.7]))
    assert torch.equal(batch[3]["loss_mask"], torch.tensor([1.0, 1.0, 0.0]))
    assert torch.allclose(batch[3]["advantages"], torch.zeros(3))  # A = R̃ on valid tokens, 0 under the mask
    assert torch.allclose(batch[1]["rollout_log_probs"], torch.tensor([-1.0, -0.1]))


def test_a_damaged_chunk_is_never_read(tmp_path):
    ref = S.write_step(tmp_path, 1, result())
    data = bytearray(open(ref.path, "rb").read())
    data[-100] ^= 0xFF
    open(ref.path, "wb").write(bytes(data))
    with pytest.raises(DamagedChunk):
        S.read_samples([ref])
