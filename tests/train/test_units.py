"""Pure-python/torch pieces of relax_hpc.train, in-process (no megatron import): config checks, batching,
DP sharding, the learning-rate schedule, and that importing the package stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from relax_hpc.train import TrainConfig, check
from relax_hpc.train import batch as B
from relax_hpc.train.step import lr_at


def test_config_defaults_are_valid_and_bad_values_named():
    assert check(TrainConfig()) == []
    bad = TrainConfig(tp=0, micro_batch_size=4, global_batch_size=6, lr=-1.0, adam_beta2=1.0, clip_grad=-1)
    keys = {k for k, _, _ in check(bad)}
    assert keys == {"tp", "global_batch_size", "lr", "min_lr", "adam_beta2", "clip_grad"}
    for key, value, msg in check(bad):
        assert "Fix" in msg and value == getattr(bad, key)


def test_config_field_types_are_recipe_types():
    import dataclasses
    import typing

    allowed = {int, float, bool, str}

    def ok(t) -> bool:  # a scalar, a Literal, a list of scalars, a nested section (train.lora), or one of them | None
        if t in allowed or typing.get_origin(t) is typing.Literal:
            return True
        if dataclasses.is_dataclass(t):
            hints = typing.get_type_hints(t)
            return all(ok(hints[g.name]) for g in dataclasses.fields(t))
        if typing.get_origin(t) is list:
            return all(ok(a) for a in typing.get_args(t))
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return bool(args) and all(ok(a) for a in args)

    for f in dataclasses.fields(TrainConfig):
        t = typing.get_type_hints(TrainConfig)[f.name]
        assert ok(t), (f.name, t)


def test_import_is_cheap():
    code = "import sys, relax_hpc.train; assert 'megatron' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _sample(n_prompt, n_resp, adv=1.0, **kw):
    return B.TrainingSample.of(torch.arange(10, 10 + n_prompt + n_resp), n_prompt, advantage=adv, **kw)


def test_micro_batch_padding_and_indices():
    s1, s2 = _sample(2, 3), _sample(4, 1, adv=-0.5, loss_mask=[0])
    mb = B.make_micro_batch([s1, s2], pad_id=0, train=True)
    assert mb.tokens.shape == (2, 5) and mb.tokens[1].tolist() == [10, 11, 12, 13, 14]
    assert mb.tokens[0].tolist() == [10, 11, 12, 13, 14]
    # logits at p score token p+1: response of s1 = tokens 2..4, scored at positions 1..3
    assert mb.logit_index[0].tolist() == [1, 2, 3] and mb.targets[0].tolist() == [12, 13, 14]
    assert mb.valid.tolist() == [[True, True, True], [True, False, False]]
    assert mb.loss_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert mb.advantages[1, 0].item() == -0.5 and mb.old_log_probs is None
    fixed = B.make_micro_batch([s1], pad_id=0, train=False, seq_len=8, rows=2)
    assert fixed.tokens.shape == (2, 8) and fixed.n_real == 1 and fixed.tokens[1].eq(0).all()


def test_micro_batch_rejects_bad_samples():
    with pytest.raises(ValueError, match="response_start"):
        B.make_micro_batch([_sample(0, 3)], pad_id=0, train=False)
    with pytest.raises(ValueError, match="old_log_probs has 2 values"):
        B.make_micro_batch([_sample(2, 3, old_log_probs=[0.0, 0.0])], pad_id=0, train=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        B.make_micro_batch([_sample(2, 3)], pad_id=0, train=False, max_seq_len=4)


def test_dp_shard_covers_batch_in_order():
    items = list(range(7))
    parts = [B.dp_shard(items, 3, r) for r in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, lr_warmup_steps=4)
    assert [lr_at(cfg, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = TrainConfig(lr=1.0, min_lr=0.1, lr_decay="cosine", lr_decay_steps=2)
    assert [round(lr_at(cos, s), 6) for s in range(4)] == [1.0, 0.55, 0.1, 0.1]


def test_nonfinite_keys_are_checked_and_the_guard_counts_consecutive_skips():
    from relax_hpc.errors import is_permanent
    from relax_hpc.train.step import NonFiniteError, NonFiniteGuard, nonfinite_what

    assert {k for k, _, _ in check(TrainConfig(nonfinite="warn", max_nonfinite_skips=-1))} == \
        {"nonfinite", "max_nonfinite_skips"}
    g = NonFiniteGuard(TrainConfig(max_nonfinite_skips=2))
    g.skipped("optimizer step 1", "loss = nan")
    g.skipped("optimizer step 2", "loss = nan")
    g.applied()  # an applied step ends the streak
    g.skipped("optimizer step 4", "grad_norm = inf")
    g.skipped("rollout step 3, optimizer step 5", "raw_reward of sample 0 is inf")  # a door skip counts once
    with pytest.raises(NonFiniteError, match=r"^rollout step 4, optimizer step 7: raw_reward of sample 0 .*"
                       r"3 consecutive .*train.max_nonfinite_skips = 2\)") as e:
        g.skipped("rollout step 4, optimizer step 7", "raw_reward of sample 0 is inf")
    assert is_permanent(e.value)
    with pytest.raises(NonFiniteError, match="train.nonfinite = skip, train.max_nonfinite_skips = 0"):
        NonFiniteGuard(TrainConfig(max_nonfinite_skips=0)).skipped("optimizer step 1", "loss = nan")
    with pytest.raises(NonFiniteError, match=r"optimizer step 1: loss = inf; not applied.*train.nonfinite = fail"):
        NonFiniteGuard(TrainConfig(nonfinite="fail")).skipped("optimizer step 1", "loss = inf")
    assert nonfinite_what({"loss": float("nan"), "grad_norm": 1.0, "nonfinite_skipped": 0.0}) is None
    assert nonfinite_what({"loss": 0.5, "grad_norm": float("inf"), "nonfinite_skipped": 1.0}) == "grad_norm = inf"


def test_checkpoint_resolve_trusts_only_latest(tmp_path):
    from relax_hpc.train import checkpoint as ckpt

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.resolve(tmp_path)
    done, half = tmp_path / ckpt.step_dir_name(4), tmp_path / ckpt.step_dir_name(8)
    done.mkdir()
    (done / "meta.json").write_text('{"step": 4}')
    half.mkdir()  # a save killed before meta.json and `latest`
    (tmp_path / "latest").write_text(done.name + "\n")
    assert ckpt.resolve(tmp_path) == done and ckpt.resolve(done) == done
    (tmp_path / "latest").write_text(half.name + "\n")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.resolve(tmp_path)


def test_memory_keys_are_checked():
    """sequence_parallel needs TP (refused at tp 1, naming the key); recompute values are the recipe's choices."""
    from relax_hpc.recipe.schema import Recipe
    from relax_hpc.recipe.validate import build

    [(key, value, msg)] = check(TrainConfig(sequence_parallel=True))
    assert key == "sequence_parallel" and value is True and "train.tp = 1" in msg and "Fix: set train.tp >= 2" in msg
    assert check(TrainConfig(tp=2, sequence_parallel=True, recompute="full", recompute_method="block",
                              recompute_num_layers=2)) == []
    assert [k for k, _, _ in check(TrainConfig(recompute="full", recompute_num_layers=0))] == ["recompute_num_layers"]
    problems: list = []
    build(Recipe, {"train": {"recompute": "partial", "recompute_method": "chunk"}}, "", problems)
    assert {(k, v) for k, v, _ in problems} == {("train.recompute", "partial"), ("train.recompute_method", "chunk")}
    assert all("must be one of" in m for _, _, m in problems)


def test_recompute_settings_are_megatrons_fields():
    from relax_hpc.train.model import recompute_settings

    assert recompute_settings(TrainConfig()) == {"recompute_granularity": None, "recompute_method": None,
                                                 "recompute_num_layers": None}
    assert recompute_settings(TrainConfig(recompute="selective", recompute_method="block"))["recompute_modules"] == \
        ["core_attn"]
    assert recompute_settings(TrainConfig(recompute="full", recompute_method="block", recompute_num_layers=2)) == \
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}


def test_uniform_recompute_chunks_must_divide_a_stages_layers():
    """Megatron's uniform recompute indexes past the stage's last layer otherwise (IndexError at the first step)."""
    from relax_hpc.errors import is_permanent
    from relax_hpc.train.model import check_recompute

    fine = [dict(recompute="full", recompute_num_layers=2), dict(recompute="full", recompute_method="block",
            recompute_num_layers=3), dict(recompute="selective", recompute_num_layers=5),
            dict(pp=2, recompute="full", recompute_num_layers=2)]
    for kw in fine:
        check_recompute(TrainConfig(**kw), num_layers=4)
    with pytest.raises(Exception, match=r"train.recompute_num_layers = 3 does not divide the 4 layers .*"
                       r"train.pp = 1.*Fix: a divisor of 4") as e:
        check_recompute(TrainConfig(recompute="full", recompute_num_layers=3), num_layers=4)
    assert is_permanent(e.value)
    with pytest.raises(Exception, match="does not divide the 2 layers"):
        check_recompute(TrainConfig(pp=2, recompute="full", recompute_num_layers=4), num_layers=4)


def test_fusion_flags_are_on_only_where_their_kernels_import():
    """Each fusion stays on only on CUDA with the module it needs (issue #26: masked softmax left on without apex
    crashed an H200's first real-shape forward)."""
    from relax_hpc.train.model import FUSIONS, _importable, fusion_flags

    asked = dict.fromkeys(FUSIONS, True)
    everything, nothing = (lambda name: True), (lambda name: False)
    te_only = lambda name: name == "transformer_engine"  # noqa: E731  a TE install without apex
    assert fusion_flags(asked, cuda=False, importable=everything) == dict.fromkeys(FUSIONS, False)  # CPU: none
    assert fusion_flags(asked, cuda=True, importable=nothing) == dict.fromkeys(FUSIONS, False)  # no TE, no apex
    assert fusion_flags(asked, cuda=True, importable=te_only) == {
        "masked_softmax_fusion": False, "persist_layer_norm": False, "apply_rope_fusion": True,
        "gradient_accumulation_fusion": False}  # megatron's own linears need apex's kernel even with TE
    assert fusion_flags(asked, cuda=True, importable=everything) == asked
    off = dict.fromkeys(FUSIONS, False)
    assert fusion_flags(off, cuda=True, importable=everything) == off  # never turned on where the provider had off
    # this machine: no Transformer Engine and no apex, so even on CUDA nothing would be on
    assert not any(_importable(m) for m in FUSIONS.values())
    assert fusion_flags(asked, cuda=True, importable=_importable) == dict.fromkeys(FUSIONS, False)


def test_the_rollout_logprob_gap_counts_only_loss_tokens():
    """``train/train_rollout_logprob_abs_diff_max`` over the response tokens with loss mask 1: a failed sample (loss
    mask 0, placeholder engine log-probs 0: |Δ| 3) and a masked token of a live one (|Δ| 8) are left out. The mean is
    the loss's (Relax's sum_of_sample_mean, tests/algo/test_mismatch.py), not reported here."""
    from relax_hpc.train.logprobs import rollout_logprob_gap

    samples = [_sample(1, 3, rollout_log_probs=torch.tensor([-1.0, -2.0, -9.0]), loss_mask=torch.tensor([1, 1, 0])),
               _sample(1, 2, rollout_log_probs=torch.zeros(2), loss_mask=torch.zeros(2)),  # failed: no engine log-probs
               _sample(1, 1, rollout_log_probs=torch.tensor([-0.5]))]  # no mask: every response token counts
    got = rollout_logprob_gap(samples, [torch.tensor([-1.5, -2.0, -1.0]), torch.full((2,), -3.0),
                                        torch.tensor([-0.25])])
    assert got == {"train/train_rollout_logprob_abs_diff_max": pytest.approx(0.5)}
    assert rollout_logprob_gap(samples[1:2], [torch.zeros(2)]) == {}  # no loss token: no gap to report
    with pytest.raises(ValueError, match="sample 1 has 1 log-probs from the actor but 2 from the engine"):
        rollout_logprob_gap(samples, [torch.zeros(3), torch.zeros(1), torch.zeros(1)])


def test_sample_means_are_the_mean_of_each_sample_s_loss_token_mean():
    """Relax's ``rollout/*`` means, computed for all samples at once: each sample's mean over its loss tokens (every
    token without a mask; 0 for a sample whose mask is all 0), then the mean over the samples that have the field."""
    from relax_hpc.train.logprobs import sample_means

    samples = [_sample(1, 3, old_log_probs=torch.tensor([-1.0, -2.0, -9.0]), loss_mask=torch.tensor([1, 1, 0]),
                       ref_log_probs=torch.tensor([-4.0, -4.0, -4.0])),
               _sample(1, 2, old_log_probs=torch.tensor([-3.0, -5.0])),  # no mask: both tokens
               _sample(1, 2, old_log_probs=torch.tensor([-7.0, -7.0]), loss_mask=torch.zeros(2))]  # nothing counts
    got = sample_means(samples, ["old_log_probs", "ref_log_probs", "rollout_log_probs"])
    assert got == {"old_log_probs": pytest.approx((-1.5 + -4.0 + 0.0) / 3), "ref_log_probs": pytest.approx(-4.0)}
