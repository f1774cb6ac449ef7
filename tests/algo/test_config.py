"""AlgorithmConfig and OPDConfig: defaults (Relax's), meaning checks, and the relax_hpc/configs/algorithm fragments."""

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from relax_hpc.algo.config import AlgorithmConfig, OPDConfig, check, check_opd, clip_high

CONFIGS = Path(__file__).resolve().parents[2] / "relax_hpc" / "configs" / "algorithm"


def test_relax_defaults():
    c = AlgorithmConfig()
    assert (c.advantage_estimator, c.eps_clip, c.eps_clip_high, c.eps_clip_c) == ("grpo", 0.2, None, None)
    assert (c.kl_coef, c.use_kl_loss, c.kl_loss_coef, c.kl_loss_type) == (0.0, False, 0.0, "k1")
    assert (c.sapo_tau_pos, c.sapo_tau_neg, c.entropy_coef) == (1.0, 1.05, 0.0)
    assert (c.use_tis, c.tis_clip, c.tis_clip_low) == (False, 2.0, 0.0)
    assert (c.use_opsm, c.opsm_delta) == (False, 1e-4)
    assert not (c.disable_rewards_normalization or c.disable_grpo_std_normalization or c.normalize_advantages)
    assert check(c) == []
    assert clip_high(c) == 0.2 and clip_high(AlgorithmConfig(eps_clip_high=0.28)) == 0.28


def test_field_types_are_ones_the_recipe_validator_supports():
    allowed = {int, float, bool, str, type(None)}
    for name, tp in typing.get_type_hints(AlgorithmConfig).items():
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Literal:
            continue
        assert tp in allowed or set(args) <= allowed, f"{name}: {tp}"


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"eps_clip": 0.0}, "eps_clip"),
        ({"eps_clip": 1.0}, "eps_clip"),
        ({"eps_clip_high": -0.1}, "eps_clip_high"),
        ({"eps_clip_c": 1.0}, "eps_clip_c"),
        ({"eps_clip_c": 3.0, "advantage_estimator": "sapo"}, "eps_clip_c"),
        ({"advantage_estimator": "ppo"}, "advantage_estimator"),
        ({"kl_loss_type": "kl"}, "kl_loss_type"),
        ({"kl_coef": 0.1, "kl_loss_coef": 0.1}, "kl_coef"),
        ({"kl_loss_coef": -1.0}, "kl_loss_coef"),
        ({"sapo_tau_neg": 0.0}, "sapo_tau_neg"),
        ({"tis_clip": 0.5, "tis_clip_low": 1.0}, "tis_clip"),
        ({"use_tis": True, "use_rollout_logprobs": True}, "use_tis"),
        ({"custom_tis_function_path": "icepop"}, "custom_tis_function_path"),
        ({"custom_tis_function_path": "tis.py"}, "custom_tis_function_path"),
        ({"custom_loss_path": "my_loss"}, "custom_loss_path"),
        ({"custom_loss_path": "losses/my:fn"}, "custom_loss_path"),
        ({"get_mismatch_metrics": True}, "get_mismatch_metrics"),
        ({"ref_update_interval": 0}, "ref_update_interval"),
        ({"opsm_delta": -1.0}, "opsm_delta"),
    ],
)
def test_check_names_the_key_the_value_and_a_fix(changes, key):
    cfg = dataclasses.replace(AlgorithmConfig(), **changes)
    problems = check(cfg)
    assert key in [k for k, _, _ in problems], problems
    for k, value, message in problems:
        assert value == getattr(cfg, k)
        assert "Fix:" in message


@pytest.mark.parametrize("name, estimator", [("grpo", "grpo"), ("gspo", "gspo"), ("sapo", "sapo")])
def test_fragments_select_their_estimator_and_are_valid(name, estimator):
    data = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert set(data) == {"algorithm"}
    section = data["algorithm"]
    assert set(section) <= {f.name for f in dataclasses.fields(AlgorithmConfig)}
    cfg = AlgorithmConfig(**section)
    assert cfg.advantage_estimator == estimator
    assert check(cfg) == []


@pytest.mark.parametrize("path", ["pkg.mod.fn", "pkg.mod:fn", "losses/my_loss.py:fn", "/abs/x.py:fn", "x.py:fn"])
def test_every_plugin_form_passes_the_form_check_without_importing(path):
    cfg = dataclasses.replace(AlgorithmConfig(), custom_loss_path=path, custom_tis_function_path=path)
    assert check(cfg) == []


# --- opd: (OPDConfig, check_opd) ---------------------------------------------------------------------------

OPD_OK = OPDConfig(teacher_url="http://teacher:30000/generate")


def test_opd_relax_defaults_and_a_teacher_url_are_valid():
    c = OPDConfig()
    assert (c.enabled, c.kl_coef, c.loss_coef, c.only_reward, c.kl_type, c.jsd_alpha) == (True, 1.0, 0.0, False,
                                                                                           "reverse_kl", 0.5)
    assert (c.teacher_timeout_s, c.log_prob_top_k, c.norm_mode, c.token_selection) == (30.0, 0, "tail",
                                                                                       "student_sampled")
    assert (c.per_token_clip, c.is_clip, c.log_prob_min_clamp) == (None, None, None)
    assert [k for k, _, _ in check_opd(c)] == ["teacher_url"]
    assert check_opd(OPD_OK) == []
    assert check_opd(dataclasses.replace(OPD_OK, kl_coef=0.0, loss_coef=0.5, is_clip=2.0, kl_type="low_var_kl")) == []
    assert check_opd(dataclasses.replace(OPD_OK, kl_type="jsd", jsd_alpha=0.3, token_selection="teacher_topk",
                                         log_prob_top_k=8, norm_mode="norm")) == []
    assert check_opd(OPDConfig(enabled=False, kl_coef=0.0)) == []  # off: not checked


def test_opd_field_types_are_ones_the_recipe_validator_supports():
    allowed = {int, float, bool, str, type(None)}
    for name, tp in typing.get_type_hints(OPDConfig).items():
        if typing.get_origin(tp) is typing.Literal:
            continue
        assert tp in allowed or set(typing.get_args(tp)) <= allowed, f"{name}: {tp}"


@pytest.mark.parametrize(
    "changes, key, text",
    [
        ({"teacher_url": "teacher:30000"}, "teacher_url", "http(s) URL"),
        ({"teacher_timeout_s": 0.0}, "teacher_timeout_s", "more than 0"),
        ({"loss_coef": 0.5}, "loss_coef", "exactly one of opd.kl_coef and opd.loss_coef"),
        ({"kl_coef": 0.0}, "kl_coef", "exactly one of opd.kl_coef and opd.loss_coef"),
        ({"kl_coef": -1.0}, "kl_coef", "0 or more"),
        ({"kl_type": "jsd"}, "kl_type", "top-k log-probs of both models"),
        ({"kl_type": "forward_kl"}, "kl_type", "top-k log-probs of both models"),
        ({"token_selection": "student_topk"}, "log_prob_top_k", "more than 0"),
        ({"log_prob_top_k": 16}, "log_prob_top_k", "does nothing"),
        ({"log_prob_top_k": -1}, "log_prob_top_k", "0 or more"),
        ({"kl_type": "jsd", "token_selection": "student_topk", "log_prob_top_k": 4, "jsd_alpha": 1.5},
         "jsd_alpha", "between 0 and 1"),
        ({"jsd_alpha": 0.3}, "jsd_alpha", "only with kl_type jsd"),
        ({"norm_mode": "norm"}, "norm_mode", "top-k"),
        ({"per_token_clip": 0.0}, "per_token_clip", "more than 0"),
        ({"is_clip": 2.0}, "is_clip", "loss form"),
        ({"kl_coef": 0.0, "loss_coef": 1.0, "is_clip": -1.0}, "is_clip", "more than 0"),
        ({"log_prob_min_clamp": 0.0}, "log_prob_min_clamp", "below 0"),
    ],
)
def test_opd_check_names_the_key_the_value_and_a_fix(changes, key, text):
    cfg = dataclasses.replace(OPD_OK, **changes)
    problems = check_opd(cfg)
    assert key in [k for k, _, _ in problems], problems
    assert any(text in m for k, _, m in problems if k == key), problems
    for k, value, message in problems:
        assert value == getattr(cfg, k)
        assert "Fix:" in message
