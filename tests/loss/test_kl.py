import math

import pytest
import torch

from dsrl.loss.kl import approx_kl

F64 = torch.float64


@pytest.mark.parametrize("kind,value,grad", [
    ("k1", 0.5, 1.0),
    ("k2", 0.125, 0.5),                                   # δ²/2, d/dlp = δ
    ("k3", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),     # e^{−δ} − 1 + δ, d/dlp = 1 − e^{−δ}
    ("low_var_kl", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),
])
def test_estimators_value_and_gradient(kind, value, grad):
    lp = torch.tensor([-1.0], dtype=F64, requires_grad=True)
    base = torch.tensor([-1.5], dtype=F64, requires_grad=True)
    kl = approx_kl(lp, base.detach(), kind)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, abs=1e-15)
    assert lp.grad.item() == pytest.approx(grad, abs=1e-15)


def test_low_var_kl_clamps_like_miles():
    lp = torch.tensor([-31.0, 0.0], dtype=F64)
    base = torch.tensor([-1.0, -30.0], dtype=F64)   # δ = −30 and +30
    low = approx_kl(lp, base, "low_var_kl")
    k3 = approx_kl(lp, base, "k3")
    assert low.tolist() == [10.0, 10.0]  # output clamp [−10, 10]
    # −δ clamped to ±20 before the exp; k3 has no output clamp
    assert k3[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-14)
    assert k3[1].item() == pytest.approx(math.exp(-20) - 1 + 20, rel=1e-14)


def test_importance_ratio_and_fp32_floor():
    lp = torch.tensor([-1.0], dtype=torch.bfloat16)
    base = torch.tensor([-1.5], dtype=torch.bfloat16)
    kl = approx_kl(lp, base, "k1", importance_ratio=torch.tensor([2.0]))
    assert kl.dtype == torch.float32 and kl.item() == 1.0
    with pytest.raises(ValueError, match="kl_loss_type"):
        approx_kl(lp, base, "k4")
