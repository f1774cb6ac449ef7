"""Rollout samples → chunk file → the actor's batch (relax_hpc.train.samples, relax_hpc.train.plan): the fields survive the trip, checksums guard it, and
advantages are the rewards, group-normalized on the training side, over the response tokens."""

import numpy as np
import pytest
import torch

from relax_hpc.algo import AlgorithmConfig
from relax_hpc.exchange.chunk import DamagedChunk
from relax_hpc.train import plan as P
from relax_hpc.train.batch import TrainingSample
from relax_hpc.train.samples import read_samples
from relax_hpc.rollout.driver import RolloutResult
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.rollout.write import write_step


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
    return RolloutResult(samples=samples, raw_rewards=[1.0, 0.0, 0.5, 0.5], metrics={}, group_size=2)


def test_chunk_round_trip_and_train_batch(tmp_path):
    ref = write_step(tmp_path, 3, result())
    assert ref.step == 3 and ref.n == 4 and (tmp_path / "exchange" / "step_3").is_dir()
    rows = read_samples([ref.to_dict()])
    assert [list(r["tokens"]) for r in rows] == [[5, 6, 7, 8], [5, 6, 7, 9, 2], [3, 4, 1], [3, 4, 1, 2, 2]]
    assert [r["weight_version"] for r in rows] == ["7"] * 4 and [int(r["index"]) for r in rows] == [0, 1, 2, 3]
    assert "rewards" not in ref.all_fields and "raw_reward" in ref.all_fields  # R travels, R̃ is computed by the actor
    batch, metrics = P.read_train_batch([ref.to_dict()], AlgorithmConfig(), group_size=2)
    assert [b.response_start for b in batch] == [3, 3, 2, 2]
    # group (1, 0): mean 0.5, unbiased std of (0.5, -0.5) = √0.5, so R̃ = ±0.5/√0.5 = ±0.7071; group (0.5, 0.5): 0
    assert torch.allclose(batch[0].advantages, torch.tensor([0.70711]), atol=1e-5)
    assert torch.allclose(batch[1].advantages, torch.tensor([-0.70711, -0.70711]), atol=1e-5)
    assert metrics["rollout/rewards"] == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(batch[3].loss_mask, torch.tensor([1.0, 1.0, 0.0]))
    assert torch.allclose(batch[3].advantages, torch.zeros(3))  # A = R̃ on valid tokens, 0 under the mask
    assert torch.allclose(batch[1].rollout_log_probs, torch.tensor([-1.0, -0.1]))


def test_a_damaged_chunk_is_never_read(tmp_path):
    ref = write_step(tmp_path, 1, result())
    data = bytearray(open(ref.path, "rb").read())
    data[-100] ^= 0xFF
    open(ref.path, "wb").write(bytes(data))
    with pytest.raises(DamagedChunk):
        read_samples([ref])


def test_normalization_settings_reach_the_training_side(tmp_path):
    """Dr.GRPO (no std) and no normalization at all: R̃ computed from the raw rewards in the chunk."""
    ref = write_step(tmp_path, 1, result())
    drgrpo, m = P.read_train_batch([ref], AlgorithmConfig(disable_grpo_std_normalization=True), group_size=2)
    assert [float(b.advantages[0]) for b in drgrpo] == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert m["rollout/rewards"] == pytest.approx(0.0)
    raw, m = P.read_train_batch([ref], AlgorithmConfig(disable_rewards_normalization=True), group_size=2)
    assert [float(b.advantages[0]) for b in raw] == pytest.approx([1.0, 0.0, 0.5, 0.5])
    assert m["rollout/rewards"] == pytest.approx(0.5)


def test_whitened_advantages_match_the_padded_computation(tmp_path):
    """``normalize_advantages`` whitens over the loss-mask tokens of the batch, as the padded [B, T] form does."""
    from relax_hpc.algo.advantages import compute_advantages

    ref = write_step(tmp_path, 1, result())
    cfg = AlgorithmConfig(normalize_advantages=True)
    batch, _ = P.read_train_batch([ref], cfg, group_size=2)
    lens = [1, 2, 1, 3]
    mask = torch.zeros(4, 3)
    for i, n in enumerate(lens):
        mask[i, :n] = 1.0
    mask[3, 2] = 0.0
    want = compute_advantages(cfg, torch.tensor([1.0, 0.0, 0.5, 0.5]), 2, mask)
    for i, b in enumerate(batch):
        assert torch.allclose(b.advantages, want[i, : lens[i]], atol=1e-6)


def test_two_chunks_read_as_one_batch(tmp_path):
    """A train task over several chunks: columns concatenate in order, ragged offsets included."""
    a = write_step(tmp_path, 1, result(), seq=0)
    b = write_step(tmp_path, 1, result(), seq=1)
    batch, _ = P.read_train_batch([a, b], AlgorithmConfig(), group_size=2)
    assert len(batch) == 8
    assert [b.tokens.tolist() for b in batch[4:]] == [b.tokens.tolist() for b in batch[:4]]
    rows = read_samples([a, b], ("tokens", "index"))
    assert [int(r["index"]) for r in rows] == [0, 1, 2, 3] * 2 and list(rows[5]["tokens"]) == [5, 6, 7, 9, 2]


def _bigger(n_groups: int = 6, g: int = 2) -> RolloutResult:
    samples, rewards = [], []
    for i in range(n_groups * g):
        s = Sample(group_index=i // g, index=i, prompt=f"p{i // g}", label="x", tokens=[3, 4 + i % 5])
        s.append_response([1 + (i % 3)] * (1 + i % 4), "r", [-0.1] * (1 + i % 4))
        s.status = SampleStatus.COMPLETED
        samples.append(s)
        rewards.append(float((i * 7) % 3))
    return RolloutResult(samples=samples, raw_rewards=rewards, metrics={}, group_size=g)


def test_train_plan_splits_the_step_into_mini_batches_and_dp_shares(tmp_path):
    """k mini-batches × dp shares cover every sample exactly once; every rank sees the same global statistics;
    the split is a function of (seed, step) only; advantages are normalized over the whole step, not per share."""
    ref = write_step(tmp_path, 1, _bigger())
    cols = P.read_train_columns([ref])
    cfg = AlgorithmConfig(normalize_advantages=True)
    whole, _ = P.train_batch(cols, cfg, 2)
    key = [(tuple(b.tokens.tolist()), tuple(b.advantages.tolist())) for b in whole]
    plans = [P.train_plan(cols, cfg, 2, k=3, seed=9, step=4, dp=2, dp_rank=r) for r in (0, 1)]
    assert [len(p.shares) for p in plans] == [3, 3]
    for j in range(3):
        a, b = plans[0].shares[j], plans[1].shares[j]
        assert a.stats == b.stats and a.stats.n == 4 and len(a.samples) == len(b.samples) == 2
        want = sum(float(s.loss_mask.sum()) for s in a.samples + b.samples)
        assert a.stats.loss_tokens == want
        assert a.stats.max_seq_len == max(s.tokens.numel() for s in a.samples + b.samples)
    seen = [(tuple(s.tokens.tolist()), tuple(s.advantages.tolist())) for p in plans for s in p.samples]
    assert sorted(seen) == sorted(key)  # each sample once, with the advantages the whole-step batch gives it
    order = [int(i) for part in P.mini_batch_order(12, 3, 9, 4) for i in part]
    assert order == [int(i) for part in P.mini_batch_order(12, 3, 9, 4) for i in part]  # a redone step splits alike
    assert order != list(range(12)) and sorted(order) == list(range(12))
    assert order != [int(i) for part in P.mini_batch_order(12, 3, 9, 5) for i in part]
    assert [list(p) for p in P.mini_batch_order(5, 1, 9, 4)] == [[0, 1, 2, 3, 4]]  # k = 1: in order, unshuffled


def test_segments_travel_with_their_rollout_and_normalize_over_rollouts(tmp_path):
    """A rollout returned as segments: each segment is a sample of its own in the chunk, with its rollout_id; R̃
    takes the group's statistics over rollouts (segments of one rollout count once)."""
    r = result()  # groups (0: samples 0, 1) and (1: samples 2, 3)
    seg = Sample(group_index=0, index=1, rollout_id=1, prompt="p0", label="1", tokens=[5, 6, 7])
    seg.append_response([4], "r1b", [-0.2])
    seg.weight_versions.append("7")
    seg.status = SampleStatus.COMPLETED
    r.samples[1].rollout_id = 1
    r.samples.insert(2, seg)  # rollout 1 = samples[1] and this segment
    r.raw_rewards.insert(2, 1.0)  # rollout 1's segments score 0 and 1: its value 0.5
    ref = write_step(tmp_path, 1, r)
    cols = P.read_train_columns([ref])
    assert list(cols["rollout_id"]) == [0, 1, 1, 2, 3] and list(cols["group_index"]) == [0, 0, 0, 1, 1]
    batch, metrics = P.train_batch(cols, AlgorithmConfig(), group_size=2)
    # group 0 over rollouts: values (1, 0.5), mean 0.75, std of (0.25, -0.25) = √0.125
    s = 0.125 ** 0.5 + 1e-6
    got = [float(b.advantages[0]) for b in batch[:3]]
    assert got == pytest.approx([0.25 / s, -0.75 / s, 0.25 / s], abs=1e-4)
    assert metrics["rollout/zero_std_group_ratio"] == 0.5  # group 1's segments all score 0.5


def _with(cols: dict, name: str, sample: int, token: int, value: float) -> dict:
    """The columns with one value of a ragged column changed (a copy: read columns are views of verified bytes)."""
    from relax_hpc.exchange.chunk import Ragged

    src = cols.get(name) or cols["rollout_log_probs"]
    r = Ragged(np.array(src.data, dtype=np.float32), np.array(src.offsets))
    r.data[r.offsets[sample] + token] = value
    return {**cols, name: r}


def test_values_no_update_may_use_stop_the_step_at_the_trainers_door(tmp_path):
    """The trainer's last check: a reward that is inf as stored (1e39 in float32), a NaN, inf or positive log-prob
    in any log-prob column (masked tokens too), or R̃/advantages that overflow, raise UnsoundTrainData naming the
    field, the sample (position and index) and the value; it is permanent (the same data fails the same way)."""
    from relax_hpc.errors import is_permanent

    r = result()
    r.raw_rewards[2] = 1e39  # finite in float64, inf in the float32 column
    with np.errstate(over="ignore"):
        ref = write_step(tmp_path, 1, r)
    cols = P.read_train_columns([ref])
    with pytest.raises(P.UnsoundTrainData, match=r"raw_reward of sample 2 \(index 2\) is inf: not finite") as e:
        P.train_plan(cols, AlgorithmConfig(), 2)
    assert e.value.field == "raw_reward" and e.value.sample == 2 and is_permanent(e.value)

    good = P.read_train_columns([write_step(tmp_path, 2, result())])
    P.check_train_columns(good)  # the sound columns pass
    P.check_train_columns(_with(good, "rollout_log_probs", 1, 0, 5e-4))  # rounding of a log-prob near 0: accepted
    cases = [("rollout_log_probs", 1, 1, float("nan"), "not finite, at response token 1"),
             ("rollout_log_probs", 3, 2, 0.5, "a log-prob above 0"),  # under loss_mask 0: still refused
             ("ref_log_probs", 0, 0, float("-inf"), "not finite, at response token 0"),
             ("log_probs", 2, 0, float("inf"), "not finite")]
    for name, sample, token, value, what in cases:
        bad = _with(good, name, sample, token, value)
        with pytest.raises(P.UnsoundTrainData, match=f"{name} of sample {sample} \\(index {sample}\\) is .*{what}"):
            P.train_plan(bad, AlgorithmConfig(), 2)

    # raw rewards finite in float32 whose group statistics overflow: R̃ is not finite
    big = result()
    big.raw_rewards[:2] = [3e38, 3e38]  # their sum is inf in float32
    cols = P.read_train_columns([write_step(tmp_path, 3, big)])
    P.check_train_columns(cols)
    with np.errstate(over="ignore"), pytest.raises(P.UnsoundTrainData, match=r"^(rewards|advantages) of sample 0 "):
        P.train_plan(cols, AlgorithmConfig(), 2)


def test_the_plan_builds_slotted_samples_the_only_input_of_a_micro_batch(tmp_path):
    """The trainer's seam is typed: the plan builds TrainingSample (slotted: a misspelt field fails); a micro-batch
    takes nothing else (a mapping's keys would go unchecked: refused, naming the fix), and the same samples built
    from plain values (TrainingSample.of, what tests and tools use) batch to the same tensors."""
    from relax_hpc.train.batch import make_micro_batch

    batch, _ = P.read_train_batch([write_step(tmp_path, 1, result())], AlgorithmConfig(), group_size=2)
    assert batch and all(type(b) is TrainingSample for b in batch)
    with pytest.raises(AttributeError):
        batch[0].advantage = 1.0  # not a field: no silent extra attribute
    plain = [{f: getattr(b, f) for f in TrainingSample.__slots__ if getattr(b, f) is not None} for b in batch]
    with pytest.raises(TypeError, match=r"a sample is a TrainingSample, not dict\. Fix: .*TrainingSample\.of\("):
        make_micro_batch(plain, pad_id=0, train=True)
    rebuilt = [TrainingSample.of(**p) for p in plain]
    typed, again = (make_micro_batch(x, pad_id=0, train=True) for x in (batch, rebuilt))
    for name in ("tokens", "targets", "valid", "loss_mask", "advantages", "rollout_log_probs"):
        assert torch.equal(getattr(typed, name), getattr(again, name)), name
    assert typed.old_log_probs is None and again.old_log_probs is None  # no π_old yet: the actor sets it


def _taught(r: RolloutResult) -> RolloutResult:
    """``r`` with OPD's teacher log-probs on every sample (-0.25 × (position + 1) − index / 10)."""
    for s in r.samples:
        s.teacher_log_probs = [-0.25 * (t + 1) - s.index / 10 for t in range(s.response_length)]
    return r


def test_teacher_log_probs_travel_from_the_samples_to_the_micro_batch(tmp_path):
    """OPD: the rollout's samples carry teacher_log_probs; the chunk has the field only then, the trainer reads it
    where every chunk of the step has it, each TrainingSample carries its [R] and the micro-batch an [n, T] tensor."""
    from relax_hpc.train.batch import make_micro_batch

    plain = write_step(tmp_path, 1, result(), seq=0)
    assert "teacher_log_probs" not in plain.fields
    ref = write_step(tmp_path, 1, _taught(result()), seq=1)
    assert "teacher_log_probs" in ref.fields
    cols = P.read_train_columns([ref])
    assert cols["teacher_log_probs"].lengths().tolist() == [1, 2, 1, 3]
    batch = P.train_plan(cols, AlgorithmConfig(), 2).samples
    want = [[-0.25], [-0.35, -0.6], [-0.45], [-0.55, -0.8, -1.05]]
    for s, w in zip(batch, want):
        assert s.teacher_log_probs.dtype == torch.float32 and s.teacher_log_probs.tolist() == pytest.approx(w)
    mb = make_micro_batch(batch, pad_id=0, train=True)
    assert mb.teacher_log_probs.shape == (4, 3) and mb.teacher_log_probs[1].tolist() == pytest.approx([-0.35, -0.6, 0])
    # a step one of whose chunks has no teacher numbers reads none (the controller never hands such a step to train
    # in an OPD run: its train task asks for the field); a run without OPD has none at all
    assert "teacher_log_probs" not in P.read_train_columns([plain, ref])
    none = P.read_train_batch([plain], AlgorithmConfig(), 2)[0]
    assert all(s.teacher_log_probs is None for s in none)
    assert make_micro_batch(none, pad_id=0, train=True).teacher_log_probs is None


def test_teacher_log_probs_come_for_every_response_token_of_every_sample_or_not_at_all(tmp_path):
    part = _taught(result())
    part.samples[2].teacher_log_probs = None
    with pytest.raises(ValueError, match=r"teacher_log_probs: 3 of 4 samples carry it, sample 2 \(index 2\) does not"):
        write_step(tmp_path, 1, part)
    short = _taught(result())
    short.samples[1].teacher_log_probs = [-0.1]
    with pytest.raises(ValueError, match="teacher_log_probs of sample index 1 has 1 values for a response of 2 tokens"):
        write_step(tmp_path, 2, short)
    # at the trainer's door: finite, never above 0 (masked tokens too), one per response token
    good = P.read_train_columns([write_step(tmp_path, 3, _taught(result()))])
    P.check_train_columns(good)
    for sample, token, value, what in ((1, 1, float("nan"), "not finite, at response token 1"),
                                       (3, 2, 0.5, "a log-prob above 0")):
        with pytest.raises(P.UnsoundTrainData, match=f"teacher_log_probs of sample {sample} \\(index {sample}\\) is "
                                                     f".*{what}"):
            P.train_plan(_with(good, "teacher_log_probs", sample, token, value), AlgorithmConfig(), 2)
    from relax_hpc.exchange.chunk import Ragged

    t = good["teacher_log_probs"]
    cut = Ragged(np.array(t.data[:-1]), np.array([*t.offsets[:-1], t.offsets[-1] - 1]))  # sample 3: 2 of 3 values
    with pytest.raises(P.UnsoundTrainData, match=r"teacher_log_probs of sample 3 \(index 3\) is 2.0: that many values "
                                                 r"for a response of 3 tokens"):
        P.train_plan({**good, "teacher_log_probs": cut}, AlgorithmConfig(), 2)


def test_balanced_shares_even_the_tokens_with_the_contiguous_share_sizes():
    from relax_hpc.train.batch import balanced_shares, dp_shard, token_imbalance

    lens = [40, 38, 35, 30, 6, 5, 5, 4, 4, 3]  # long-tailed and sorted: contiguous halves are as uneven as it gets
    plain = [dp_shard(range(len(lens)), 2, r) for r in range(2)]
    deal = balanced_shares(lens, 2)
    assert [len(x) for x in deal] == [len(x) for x in plain]  # the share sizes the ranks expect
    assert sorted(i for x in deal for i in x) == list(range(len(lens)))  # each sample once
    assert token_imbalance(lens, plain) > 1.6 and token_imbalance(lens, deal) < 1.02
    assert balanced_shares(lens, 2) == deal  # every rank computes the same deal
    three = balanced_shares([5, 1, 1, 1, 1, 1, 1], 3)  # room runs out: sizes 3, 2, 2 as dp_shard's
    assert [len(x) for x in three] == [3, 2, 2] and sorted(sum(three, [])) == list(range(7))
    assert balanced_shares([7], 2) == [[0], []] and token_imbalance([], [[], []]) == 1.0


def test_train_plan_balances_each_mini_batch_and_reports_the_imbalance(tmp_path):
    """train.balance_data through the actor's plan: same samples and statistics per mini-batch, a lower
    perf/dp_token_imbalance than the contiguous deal it also reports; off, the shares are the contiguous ones."""
    ref = write_step(tmp_path, 1, _bigger(8, 2))
    cols = P.read_train_columns([ref])
    cfg = AlgorithmConfig()
    on = [P.train_plan(cols, cfg, 2, k=2, seed=9, step=4, dp=2, dp_rank=r, balance=True) for r in (0, 1)]
    off = [P.train_plan(cols, cfg, 2, k=2, seed=9, step=4, dp=2, dp_rank=r) for r in (0, 1)]
    for j in range(2):
        got = sorted(tuple(s.tokens.tolist()) for p in on for s in p.shares[j].samples)
        want = sorted(tuple(s.tokens.tolist()) for p in off for s in p.shares[j].samples)
        assert got == want and on[0].shares[j].stats == off[0].shares[j].stats
        assert [len(p.shares[j].samples) for p in on] == [len(p.shares[j].samples) for p in off]
    m_on, m_off = on[0].metrics, off[0].metrics
    assert m_on["perf/dp_token_imbalance_contiguous"] == m_off["perf/dp_token_imbalance_contiguous"] > 1.0
    assert m_off["perf/dp_token_imbalance"] == m_off["perf/dp_token_imbalance_contiguous"]
    assert m_on["perf/dp_token_imbalance"] < m_on["perf/dp_token_imbalance_contiguous"]
    assert on[0].metrics == on[1].metrics
