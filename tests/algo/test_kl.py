"""KL estimators against values worked out by hand (d = log π − log π_base)."""

import math

import pytest
import torch

from relax_hpc.algo.kl import approx_kl

# d = [0.5, 0.0, -2.0]
LP = torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64)
BASE = torch.tensor([[-0.5, -1.0, 0.0]], dtype=torch.float64)


def close(actual, expected, tol=1e-9):
    torch.testing.assert_close(actual, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=tol)


def test_k1_is_the_log_ratio():
    close(approx_kl(LP, BASE, "k1"), [0.5, 0.0, -2.0])


def test_k2_is_half_the_squared_log_ratio():
    close(approx_kl(LP, BASE, "k2"), [0.125, 0.0, 2.0])


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_k3_is_exp_minus_d_minus_one_plus_d(kind):
    # e^-0.5 - 1 + 0.5 = 0.10653065971263342 ; e^2 - 1 - 2 = 4.38905609893065
    close(approx_kl(LP, BASE, kind), [0.10653065971263342, 0.0, 4.38905609893065])


def test_only_low_var_kl_is_clamped_to_ten():
    lp = torch.tensor([[0.0]], dtype=torch.float64)
    base = torch.tensor([[3.0]], dtype=torch.float64)  # d = -3: e^3 - 1 - 3 = 16.085536923187668
    assert approx_kl(lp, base, "k3").item() == pytest.approx(16.085536923187668, abs=1e-9)
    assert approx_kl(lp, base, "low_var_kl").item() == 10.0
    # the clamp applies after the importance ratio: 0.5 * 16.0855 = 8.0428 is inside [-10, 10]
    half = torch.tensor([[0.5]], dtype=torch.float64)
    assert approx_kl(lp, base, "low_var_kl", importance_ratio=half).item() == pytest.approx(8.042768461593834)
    # k1 is never clamped
    assert approx_kl(torch.tensor([[-20.0]]), torch.tensor([[0.0]]), "k1").item() == -20.0


def test_importance_ratio_multiplies_each_token():
    ratio = torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64)
    close(approx_kl(LP, BASE, "k1", importance_ratio=ratio), [1.0, 0.0, -2.0])


def test_unknown_type_is_an_error():
    with pytest.raises(ValueError, match="unknown kl_loss_type"):
        approx_kl(LP, BASE, "kl")


def test_low_precision_inputs_are_computed_in_float32():
    out = approx_kl(LP.to(torch.bfloat16), BASE.to(torch.bfloat16), "k3")
    assert out.dtype == torch.float32


def test_hand_gradients():
    # dk1/dlp = 1, dk2/dlp = d, dk3/dlp = 1 - e^-d
    for kind, expected in [
        ("k1", [1.0, 1.0, 1.0]),
        ("k2", [0.5, 0.0, -2.0]),
        ("k3", [1 - math.exp(-0.5), 0.0, 1 - math.exp(2.0)]),
    ]:
        lp = LP.clone().requires_grad_()
        approx_kl(lp, BASE, kind).sum().backward()
        close(lp.grad, expected)
    # low_var_kl: a clamped token has zero gradient
    lp = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    approx_kl(lp, torch.tensor([[3.0, 0.5]], dtype=torch.float64), "low_var_kl").sum().backward()
    close(lp.grad, [0.0, 1 - math.exp(0.5)])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_gradcheck(kind):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(2, 4, generator=g, dtype=torch.float64) * 2).requires_grad_()
    base = (-torch.rand(2, 4, generator=g, dtype=torch.float64) * 2).requires_grad_()
    ratio = (torch.rand(2, 4, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, r: approx_kl(a, b, kind, importance_ratio=r), (lp, base, ratio))
