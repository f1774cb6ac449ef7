"""Packed micro-batches (``train.max_tokens_per_micro_batch``) and the SDPA core attention.

Unit checks of the plan (which samples share a micro-batch, the packed row, the response gather), then the
numbers from the shared runs (conftest): SDPAttention against megatron's unfused attention, and training packed
against padded on the same batch at TP=1, TP=2, PP=2 and DP=2, all fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from relax_hpc.train import batch as B
from train.conftest import part

BOUND = 1e-5  # fp32: packed and padded sum the same terms in other orders


def _sample(start: int, n: int, first: int = 10) -> B.TrainingSample:
    return B.TrainingSample.of(torch.arange(first, first + n), start, advantage=1.0)


def test_pack_keeps_every_sample_once_within_the_budget_and_fills_better_than_in_order():
    lengths = [21, 20, 19, 20, 19, 21]
    groups = B.pack(lengths, 40)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 40 for g in groups)
    assert all(g == sorted(g) for g in groups)
    in_order = 1
    room = 40
    for n in lengths:  # what filling in the given order needs
        if n > room:
            in_order, room = in_order + 1, 40
        room -= n
    assert len(groups) < in_order
    assert len(groups) == -(-sum(lengths) // 40)  # here first fit, longest first, reaches the bound


def test_a_sample_over_the_budget_gets_a_micro_batch_of_its_own():
    assert B.pack([50, 10, 10], 40) == [[0], [1, 2]]


def test_a_packed_micro_batch_holds_the_samples_back_to_back_with_their_boundaries():
    s1, s2 = _sample(2, 5, first=10), _sample(1, 3, first=40)
    mb = B.make_packed_micro_batch([s1, s2], pad_id=0, train=True)
    assert mb.tokens.tolist() == [[10, 11, 12, 13, 14, 40, 41, 42]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]  # RoPE restarts at each sample
    assert mb.packed.qkv_format == "thd" and mb.packed.cu_seqlens_q.tolist() == [0, 5, 8]
    assert mb.packed.max_seqlen_q == 5 and mb.real_tokens == 8
    padded = B.make_micro_batch([s1, s2], pad_id=0, train=True)
    # the same response tokens, scored by the logits of the same positions of each sample
    assert torch.equal(mb.targets[mb.valid], padded.targets[padded.valid])
    assert mb.logit_index[0, :3].tolist() == [1, 2, 3] and mb.logit_index[1, :2].tolist() == [5, 6]
    assert torch.equal(mb.loss_mask, padded.loss_mask) and torch.equal(mb.advantages, padded.advantages)


def test_a_fixed_or_rounded_length_pads_with_a_sequence_of_its_own():
    mb = B.make_packed_micro_batch([_sample(2, 5), _sample(1, 3)], pad_id=7, train=False, seq_len=11, multiple=4)
    assert mb.tokens.shape == (1, 12) and mb.tokens[0, 8:].eq(7).all()
    assert mb.packed.cu_seqlens_q.tolist() == [0, 5, 8, 12]  # no real token attends to the padding
    assert mb.position_ids[0, 8:].tolist() == [0, 1, 2, 3] and mb.real_tokens == 8
    rounded = B.make_micro_batch([_sample(2, 5)], pad_id=0, train=False, multiple=4)
    assert rounded.tokens.shape == (1, 8)


def test_per_response_token_values_sit_at_each_response_and_a_wrong_count_is_named():
    """A micro-batch's per-token columns ([n, T], zero past each response) from values of any form (tensors, lists,
    another float dtype); a sample without a loss mask counts every token; each sample's count is checked."""
    a = B.TrainingSample.of([1, 2, 3, 4, 5], 2, advantages=[0.5, -1.0, 2.0], loss_mask=torch.tensor([1, 0, 1]),
                            rollout_log_probs=torch.tensor([-0.5, -1.5, -2.5], dtype=torch.float64),
                            teacher_log_probs=torch.tensor([[-0.25], [-0.5], [-0.75]]))
    b = B.TrainingSample.of([6, 7, 8], 2, advantages=torch.tensor([3.0]), rollout_log_probs=[-4.0],
                            teacher_log_probs=torch.tensor([[-1.0]]))  # [R, 1] rows: flattened too
    for make in (B.make_packed_micro_batch, B.make_micro_batch):
        mb = make([a, b], pad_id=0, train=True)
        assert mb.advantages.tolist() == [[0.5, -1.0, 2.0], [3.0, 0.0, 0.0]]
        assert mb.loss_mask.tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
        assert mb.rollout_log_probs.tolist() == [[-0.5, -1.5, -2.5], [-4.0, 0.0, 0.0]]
        assert mb.teacher_log_probs.tolist() == [[-0.25, -0.5, -0.75], [-1.0, 0.0, 0.0]]
        assert mb.rollout_log_probs.dtype == torch.float32 and mb.ref_log_probs is None  # no sample has them
    b.advantages = torch.tensor([3.0, 1.0])
    with pytest.raises(ValueError, match="advantages has 2 values for a response of 1 tokens"):
        B.make_packed_micro_batch([a, b], pad_id=0, train=True)
    b.advantages = None
    with pytest.raises(ValueError, match="sample has no advantages"):
        B.make_packed_micro_batch([a, b], pad_id=0, train=True)


def test_the_packed_row_refuses_a_sample_over_max_seq_len():
    with pytest.raises(ValueError, match="train.max_seq_len = 4"):
        B.make_packed_micro_batch([_sample(2, 5)], pad_id=0, train=False, max_seq_len=4)


def test_sdpa_attention_equals_megatrons_unfused_attention(single_run):
    r = part(single_run, "attention")
    assert r["shape"] == [13, 3, 64] and r["packed_shape"] == [23, 4, 16]
    assert r["out"] <= BOUND and r["grad"] <= BOUND, r
    assert r["packed"] <= BOUND, r  # packed samples see only themselves
    assert r["rope_thd"] == {"gathered": True, "as_megatron": True}, r  # bit for bit, one gather a layer
    assert r["layer_scaling"] <= BOUND, r


def _check_equal(r: dict, name: str) -> None:
    v = r[name]
    print(f"[{name}] {v}")
    assert v["old"] <= BOUND and v["after"] <= BOUND and v["weights"] <= BOUND, v
    assert v["step_diff"] <= BOUND, v  # loss, grad norm, clip fraction, entropy of each step


def test_packed_training_equals_padded_at_tp1(single_run):
    r = part(single_run, "equal_packed")
    for name in ("packed", "packed_logprob"):
        _check_equal(r, name)
    assert r["base"]["padding"] > 0.05 and r["packed"]["padding"] == 0.0
    assert r["packed"]["micro_batches"] < r["base"]["micro_batches"]
    (loss1, *_), (loss2, *_) = r["base"]["steps"]
    assert abs(loss2 - loss1) > 100 * BOUND  # the first step moved the weights: equal numbers are not trivial


@pytest.mark.parametrize("job", ["equal_tp2", "equal_pp2", "equal_dp2"])
def test_packed_training_equals_padded_with_tp_pp_and_dp(multi_run, job):
    _check_equal(part(multi_run, job), "packed")


def test_the_provider_gets_the_spec_and_fusions_its_kernels_allow(single_run):
    """The real Qwen3 provider on CUDA: with nothing beyond torch, the pure-torch spec and every extension fusion off
    (issue #26: masked softmax left on without apex crashed an H200's first real-shape forward); with a Transformer
    Engine stand-in, TE's spec and fused RoPE but still no apex kernels; with both, the provider's own choices."""
    r = part(single_run, "kernels")  # each case: a provider that asked for every fusion
    assert r["none"]["asked"]["masked_softmax_fusion"]  # the bridge's own default: the flag that crashed
    assert r["none"]["spec"] == "torch_block_spec" and not any(r["none"]["flags"].values())
    assert r["te"]["default_spec_kept"] and r["te"]["spec"] != "torch_block_spec"
    assert r["te"]["flags"] == {k: k == "apply_rope_fusion" for k in r["te"]["flags"]}
    assert r["te_apex"]["default_spec_kept"] and all(r["te_apex"]["flags"].values())
    assert not any(r["cpu"]["flags"].values())  # no CUDA: no extension kernel


def test_keys_that_packing_or_recompute_would_ignore_are_refused_by_name():
    from relax_hpc.train.config import TrainConfig, check

    def keys(**kw):
        return {k for k, _, _ in check(TrainConfig(**kw))}

    assert keys(max_tokens_per_micro_batch=8192, micro_batch_size=4) == {"micro_batch_size"}
    assert keys(max_tokens_per_micro_batch=8192, global_batch_size=6) == set()  # no sample-count divisibility then
    assert keys(max_tokens_per_micro_batch=8192, logprob_micro_batch_size=8) == {"logprob_micro_batch_size"}
    assert keys(logprob_max_tokens_per_micro_batch=8192, logprob_micro_batch_size=8) == {"logprob_micro_batch_size"}
    assert keys(max_tokens_per_micro_batch=2048) == {"max_tokens_per_micro_batch"}  # below max_seq_len 4096
    assert keys(recompute="selective", recompute_method="block") == {"recompute_method"}
    assert keys(recompute_num_layers=2) == {"recompute_num_layers"}
    assert keys(recompute="full", recompute_method="block", recompute_num_layers=2) == set()
    (_, value, msg), = check(TrainConfig(max_tokens_per_micro_batch=8192, micro_batch_size=4))
    assert value == 4 and "max_tokens_per_micro_batch = 8192" in msg and "Fix:" in msg


def test_balanced_data_trains_as_the_contiguous_shares_at_dp2(multi_run):
    """train.balance_data deals the global batch to the two DP ranks by token count: a different split (the
    8 samples' lengths spread 4–40), the same update (every sample once, weights from the global statistics)."""
    _check_equal(part(multi_run, "equal_dp2"), "balanced")
