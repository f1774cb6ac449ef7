"""The loss table (LOSSES / register_loss), algorithm.custom_loss_path, and the example user loss.

Expected numbers are worked out by hand from chosen log-probs and advantages, as in test_losses.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from relax_hpc.algo import ESTIMATORS, AlgorithmConfig, policy_loss
from relax_hpc.algo.losses import LOSSES, LossInputs, loss_function, register_loss
from relax_hpc.plugins import PluginError

F64 = torch.float64
EXAMPLE = Path(__file__).resolve().parents[2] / "recipes" / "examples" / "custom_loss.py"


def t(rows):
    return torch.tensor(rows, dtype=F64)


def close(actual, expected, tol=1e-7):
    torch.testing.assert_close(actual.to(F64), torch.as_tensor(expected, dtype=F64), rtol=0, atol=tol)


def write(tmp_path: Path, body: str, name: str = "user_loss.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# --- the table ----------------------------------------------------------------------------------------------

def test_every_estimator_has_a_loss_and_nothing_else():
    assert set(LOSSES) == set(ESTIMATORS)


def test_register_loss_adds_once(monkeypatch):
    monkeypatch.setattr("relax_hpc.algo.losses.LOSSES", dict(LOSSES))
    from relax_hpc.algo import losses

    @register_loss("zero")
    def zero(batch, cfg):
        return torch.zeros_like(batch.log_probs), {}

    assert losses.LOSSES["zero"] is zero
    with pytest.raises(ValueError, match="already registered"):
        register_loss("zero")(zero)


def test_policy_loss_dispatches_through_the_table(monkeypatch):
    seen = []

    def spy(batch: LossInputs, cfg):
        seen.append(batch)
        return 2.0 * batch.advantages, {"pg_clipfrac": torch.ones_like(batch.advantages)}

    monkeypatch.setitem(LOSSES, "sapo", spy)
    lp = torch.full((1, 3), -1.0, dtype=F64, requires_grad=True)
    loss, m = policy_loss(AlgorithmConfig(advantage_estimator="sapo"), lp, lp.detach(), t([[1.0, 2.0, 9.0]]),
                          torch.tensor([[1.0, 1.0, 0.0]]))
    close(loss, (2.0 + 4.0) / 2)  # the masked token's advantage (9) was zeroed before the loss saw it
    close(m["pg_clipfrac"], 1.0)
    (batch,) = seen
    close(batch.advantages, [[1.0, 2.0, 0.0]])
    close(batch.loss_mask, [[1.0, 1.0, 0.0]])
    assert batch.log_probs.requires_grad and not batch.old_log_probs.requires_grad


def test_unknown_estimator_is_a_value_error():
    with pytest.raises(ValueError, match="unknown advantage_estimator 'ppo'"):
        loss_function(AlgorithmConfig(advantage_estimator="ppo"))


# --- custom_loss_path ---------------------------------------------------------------------------------------

REINFORCE = """
    import torch

    def reinforce(batch, cfg):
        # L = −A·log π_θ, and the mean advantage as a per-token metric, and a scalar one
        return -batch.advantages * batch.log_probs, {"adv": batch.advantages, "const": torch.tensor(5.0)}
"""


def test_custom_loss_from_a_file_replaces_the_estimators(tmp_path):
    path = write(tmp_path, REINFORCE)
    cfg = AlgorithmConfig(custom_loss_path=f"{path}:reinforce")
    # two samples: log π_θ = (−1, −2 | −0.5, pad), A = (1, 1 | −2, pad); old far away (ratio irrelevant here)
    lp = t([[-1.0, -2.0], [-0.5, -3.0]]).requires_grad_()
    old = lp.detach() - 0.7
    adv = t([[1.0, 1.0], [-2.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = policy_loss(cfg, lp, old, adv, mask)
    # per token −A·lp: (1, 2 | −1); per-sample means 1.5 and −1; mean over samples 0.25
    close(loss, 0.25)
    close(m["pg_loss"], 0.25)
    close(m["adv"], (1.0 + (-2.0)) / 2)
    close(m["const"], 5.0)
    close(m["ppo_kl"], -0.7)  # no ppo_kl from the loss: the per-token δ = log π_old − log π_θ
    assert set(m) == {"loss", "pg_loss", "adv", "const", "ppo_kl"}
    loss.backward()
    close(lp.grad, [[-1.0 / 4, -1.0 / 4], [2.0 / 2, 0.0]])  # −A / (tokens of the sample · samples)


def test_custom_loss_by_relative_path_and_dotted_module(tmp_path, monkeypatch):
    write(tmp_path, REINFORCE, "my_rl_losses.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    lp = t([[-1.0]]).requires_grad_()
    for spec in ("my_rl_losses.py:reinforce", "my_rl_losses.reinforce", "my_rl_losses:reinforce"):
        loss, _ = policy_loss(AlgorithmConfig(custom_loss_path=spec), lp, lp.detach(), t([[3.0]]), torch.ones(1, 1))
        close(loss, 3.0 * -1.0 * -1.0)


def test_custom_loss_still_gets_tis_and_the_entropy_bonus(tmp_path):
    path = write(tmp_path, REINFORCE)
    cfg = AlgorithmConfig(custom_loss_path=f"{path}:reinforce", use_tis=True, entropy_coef=0.1)
    lp = torch.full((1, 2), -1.0, dtype=F64, requires_grad=True)
    rollout = lp.detach() - torch.log(t([[0.5, 4.0]]))  # π_old/π_roll = 0.5, 4 → weights 0.5, 2 (clamped)
    entropy = t([[1.0, 3.0]])
    loss, m = policy_loss(cfg, lp, lp.detach(), t([[1.0, 1.0]]), torch.ones(1, 2), rollout_log_probs=rollout,
                          entropy=entropy)
    # per token −A·lp = 1, 1; weighted 0.5, 2 → pg 1.25; entropy mean 2 → loss 1.25 − 0.2
    close(m["pg_loss"], 1.25)
    close(m["entropy_loss"], 2.0)
    close(loss, 1.05)


@pytest.mark.parametrize("body, text", [
    ("def bad(batch, cfg):\n    return batch.log_probs\n", "not (loss, metrics)"),
    ("def bad(batch, cfg):\n    return batch.log_probs.sum(), {}\n", "expected (1, 2) (one value per token)"),
    ("def bad(batch, cfg):\n    return batch.log_probs, {'pg_loss': batch.log_probs}\n", "reports itself"),
    ("def bad(batch, cfg):\n    return batch.log_probs, {'x': batch.log_probs[0]}\n", "metric 'x' of shape (2,)"),
    ("def bad(batch, cfg):\n    return batch.log_probs, {'ppo_kl': batch.log_probs.sum()}\n", "metric 'ppo_kl'"),
])
def test_what_a_custom_loss_returns_is_checked_and_names_the_key(tmp_path, body, text):
    path = write(tmp_path, body)
    lp = t([[-1.0, -1.0]]).requires_grad_()
    with pytest.raises((TypeError, ValueError)) as e:
        policy_loss(AlgorithmConfig(custom_loss_path=f"{path}:bad"), lp, lp.detach(), t([[1.0, 1.0]]), torch.ones(1, 2))
    assert text in str(e.value) and f"algorithm.custom_loss_path = '{path}:bad'" in str(e.value)
    assert "Fix:" in str(e.value)


def test_a_bad_custom_loss_path_names_the_key(tmp_path):
    path = write(tmp_path, "def one(batch):\n    return batch\n")
    lp = t([[-1.0]]).requires_grad_()
    with pytest.raises(PluginError) as e:
        policy_loss(AlgorithmConfig(custom_loss_path=f"{path}:one"), lp, lp.detach(), t([[1.0]]), torch.ones(1, 1))
    assert e.value.key == "algorithm.custom_loss_path" and e.value.kind == "signature"


# --- the example user loss ----------------------------------------------------------------------------------

def test_example_loss_matches_the_built_in_grpo():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 6, generator=g, dtype=F64) * 3).requires_grad_()
    old = lp.detach() + 0.4 * torch.randn(4, 6, generator=g, dtype=F64)
    adv = torch.randn(4, 6, generator=g, dtype=F64)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    for extra in ({}, {"eps_clip_high": 0.28}, {"calculate_per_token_loss": True}):
        want, wm = policy_loss(AlgorithmConfig(**extra), lp, old, adv, mask)
        (g_want,) = torch.autograd.grad(want, lp)
        got, gm = policy_loss(AlgorithmConfig(custom_loss_path=f"{EXAMPLE}:my_loss", **extra), lp, old, adv, mask)
        (g_got,) = torch.autograd.grad(got, lp)
        close(got, want.detach(), tol=1e-12)
        close(g_got, g_want, tol=1e-12)
        assert set(gm) == set(wm)
        for k in wm:
            close(gm[k], wm[k], tol=1e-12)


@pytest.mark.parametrize("name", ["my_loss", "reinforce_loss"])
def test_example_loss_trains_a_bandit_on_cpu(name):
    """A 6-armed bandit, arm 3 pays 1: GRPO-style steps (group-normalized rewards, 2 epochs over each batch)
    with the user's loss drive π(arm 3) from 1/6 to nearly 1."""
    torch.manual_seed(0)
    logits = torch.zeros(6, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.1)
    cfg = AlgorithmConfig(custom_loss_path=f"{EXAMPLE}:{name}")
    for _ in range(40):
        with torch.no_grad():
            arms = torch.multinomial(torch.softmax(logits, -1), 64, replacement=True)
            reward = (arms == 3).float()
            adv = ((reward - reward.mean()) / (reward.std() + 1e-6)).unsqueeze(-1)
            old = torch.log_softmax(logits, -1)[arms].unsqueeze(-1)
        for _ in range(2):
            lp = torch.log_softmax(logits, -1)[arms].unsqueeze(-1)
            loss, _ = policy_loss(cfg, lp, old, adv, torch.ones(64, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert torch.softmax(logits, -1)[3] > 0.9
