"""Objective values and gradients against hand-computed numbers (float64, raw sums)."""
import math

import pytest
import torch

from dsrl.loss.objectives import cispo, gspo, ppo, sft
from dsrl.loss.registry import OBJECTIVES
from dsrl.loss.types import Aggregator

from ._helpers import F64, inputs

LN = math.log


def _ratio_problem(ratios, adv, old=0.1):
    """lp = old + ln ρ as a leaf, so ρ = exp(lp − old) and d(−ρA)/dlp = −ρA."""
    old_t = torch.full((1, len(ratios)), old, dtype=F64)
    lp = (old_t + torch.tensor([[LN(r) for r in ratios]], dtype=F64)).requires_grad_(True)
    batch = {"advantages": torch.tensor([adv], dtype=F64), "old_log_probs": old_t}
    return lp, torch.ones(1, len(ratios), dtype=F64), batch


def test_registered_names():
    assert {"ppo", "gspo", "cispo", "sft"} <= set(OBJECTIVES)


def test_ppo_symmetric_clip():
    # ρ/A: (.5,+1) unclipped; (1.5,+1) clipped at 1.2; (1,−1) on-policy; (1.5,−1) unclipped
    # (pessimistic branch); (.5,−1) clipped at .8.
    lp, mask, batch = _ratio_problem([0.5, 1.5, 1.0, 1.5, 0.5], [1, 1, -1, -1, -1])
    out = ppo(inputs(lp, mask, batch))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.5 - 1.2 + 1.0 + 1.5 + 0.8, abs=1e-14)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, 0.0, 1.0, 1.5, 0.0]], dtype=F64), rtol=0, atol=1e-14)
    assert out.metrics["pg_clipfrac"].item() == 2.0
    assert out.metrics["ppo_kl"].item() == pytest.approx(-2 * LN(0.75), abs=1e-14)
    assert out.metrics["logprob"].item() == pytest.approx(0.5 + 2 * LN(0.75), abs=1e-14)
    assert "entropy" not in out.metrics and "kl_loss" not in out.metrics


def test_ppo_clip_higher():
    lp, mask, batch = _ratio_problem([0.5, 1.5, 1.0, 1.5, 0.5], [1, 1, -1, -1, -1])
    out = ppo(inputs(lp, mask, batch, {"eps_clip": 0.2, "eps_clip_high": 0.6}))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.5 - 1.5 + 1.0 + 1.5 + 0.8, abs=1e-14)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, -1.5, 1.0, 1.5, 0.0]], dtype=F64), rtol=0, atol=1e-14)
    assert out.metrics["pg_clipfrac"].item() == 1.0


def test_ppo_dual_clip():
    # (5,−1): Lc = 5 capped at c·|A| = 3 (grad 0); (2,−1): 2 < 3 untouched; (5,+1): clipped at 1.2.
    lp, mask, batch = _ratio_problem([5.0, 2.0, 5.0], [-1, -1, 1])
    out = ppo(inputs(lp, mask, batch, {"eps_clip_c": 3.0}))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(3.0 + 2.0 - 1.2, abs=1e-14)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=F64), rtol=0, atol=1e-14)
    assert out.metrics["pg_clipfrac"].item() == 1.0  # dual-clip activations are not counted
    no_dual = ppo(inputs(lp.detach(), mask, batch))
    assert no_dual.loss.item() == pytest.approx(5.0 + 2.0 - 1.2, abs=1e-14)
    with pytest.raises(ValueError, match="eps_clip_c"):
        ppo(inputs(lp.detach(), mask, batch, {"eps_clip_c": 1.0}))


def test_gspo_sequence_ratio():
    # row 0: log-ratios ln1.1 ± .05 -> geometric-mean ratio 1.1 (inside clip): loss −1.1 per token,
    #        grad per token = −Σ_t A_t ρ / n = −1.1;
    # row 1: ratio 1.5 on 2 active tokens (3rd masked, NaN) -> clipped at 1.2, grad 0.
    old = torch.full((2, 3), -1.0, dtype=F64)
    d = torch.tensor([[LN(1.1) + 0.05, LN(1.1) - 0.05, 0.0], [LN(1.5), LN(1.5), float("nan")]], dtype=F64)
    lp = (old + d).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=F64)
    batch = {"advantages": torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=F64), "old_log_probs": old}
    out = gspo(inputs(lp, mask, batch))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2.2 - 2.4, abs=1e-14)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.1, -1.1, 0], [0, 0, 0]], dtype=F64), rtol=0, atol=1e-14)
    assert out.metrics["pg_clipfrac"].item() == 2.0
    assert out.metrics["ppo_kl"].item() == pytest.approx(-2 * LN(1.1) - 2 * LN(1.5), abs=1e-14)


def test_cispo():
    # clipped ρ = [.8, 1.2, 1.0] (stop-grad) ; loss = −Σ c·A·lp ; grad = −c·A
    lp, mask, batch = _ratio_problem([0.5, 1.5, 1.0], [2, -1, 3])
    lp_val = lp.detach()[0].tolist()
    out = cispo(inputs(lp, mask, batch))
    out.loss.backward()
    expected = -(0.8 * 2 * lp_val[0] + 1.2 * -1 * lp_val[1] + 1.0 * 3 * lp_val[2])
    assert out.loss.item() == pytest.approx(expected, abs=1e-14)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.6, 1.2, -3.0]], dtype=F64), rtol=0, atol=1e-14)
    assert out.metrics["pg_clipfrac"].item() == 2.0


@pytest.mark.parametrize("kind,kl,grad", [
    ("k1", 0.5, 1.0), ("k2", 0.125, 0.5),
    ("k3", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)), ("low_var_kl", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),
])
def test_kl_loss_terms(kind, kl, grad):
    # on-policy token (ρ = 1, A = 0): the only gradient is coef · dKL/dlp
    lp = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    ref_leaf = torch.tensor([[-1.5]], dtype=F64, requires_grad=True)
    batch = {"advantages": torch.zeros(1, 1, dtype=F64), "old_log_probs": torch.tensor([[-1.0]], dtype=F64),
             "ref_log_probs": ref_leaf * 1.0}
    cfg = {"use_kl_loss": True, "kl_loss_coef": 0.5, "kl_loss_type": kind}
    out = ppo(inputs(lp, torch.ones(1, 1), batch, cfg))
    out.loss.backward()
    assert out.metrics["kl_loss"].item() == pytest.approx(kl, abs=1e-15)
    assert out.loss.item() == pytest.approx(0.5 * kl, abs=1e-15)
    assert lp.grad.item() == pytest.approx(0.5 * grad, abs=1e-15)
    assert ref_leaf.grad is None  # never backpropagates into the reference scores


def test_kl_loss_with_zero_coef_reports_but_does_not_train():
    lp = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    batch = {"advantages": torch.zeros(1, 1, dtype=F64), "old_log_probs": torch.tensor([[-1.0]], dtype=F64),
             "ref_log_probs": torch.tensor([[-1.5]], dtype=F64)}
    out = ppo(inputs(lp, torch.ones(1, 1), batch, {"use_kl_loss": True, "kl_loss_coef": 0.0, "kl_loss_type": "k1"}))
    out.loss.backward()
    assert out.metrics["kl_loss"].item() == 0.5 and out.loss.item() == 0.0 and lp.grad.item() == 0.0
    with pytest.raises(ValueError, match="ref_log_probs"):
        ppo(inputs(lp, torch.ones(1, 1), {"advantages": torch.zeros(1, 1), "old_log_probs": lp.detach()},
                   {"use_kl_loss": True}))


def test_entropy_bonus():
    lp, mask, batch = _ratio_problem([1.0, 1.0], [1, 1])
    ent = torch.tensor([[0.5, 1.0]], dtype=F64, requires_grad=True)
    out = ppo(inputs(lp, mask, batch, {"entropy_coef": 0.1}, entropy=ent))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2.0 - 0.1 * 1.5, abs=1e-14)
    assert out.metrics["entropy"].item() == 1.5
    torch.testing.assert_close(ent.grad, torch.full((1, 2), -0.1, dtype=F64), rtol=0, atol=0)
    # coef 0: reported, never trained
    ent0 = torch.tensor([[0.5, 1.0]], dtype=F64, requires_grad=True)
    out0 = ppo(inputs(lp.detach().requires_grad_(), mask, batch, {"entropy_coef": 0.0}, entropy=ent0))
    out0.loss.backward()
    assert out0.loss.item() == -2.0 and out0.metrics["entropy"].item() == 1.5 and ent0.grad is None
    with pytest.raises(ValueError, match="entropy"):
        ppo(inputs(lp.detach(), mask, batch, {"entropy_coef": 0.1}))


def test_sft_masked_cross_entropy():
    lp = torch.tensor([[-1.0, -2.0, float("nan")]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0]], dtype=F64)
    agg = Aggregator(mask=mask, seq_weight=torch.tensor([0.5], dtype=F64))  # token-mean over 2 tokens
    out = sft(inputs(lp, mask, {}, reduce=agg))
    out.loss.backward()
    assert out.loss.item() == 1.5 and out.metrics["logprob"].item() == -1.5
    assert lp.grad.tolist() == [[-0.5, -0.5, 0.0]]


def test_empty_microbatch_stays_in_graph():
    lp = torch.tensor([[-1.0, float("nan")]], dtype=F64, requires_grad=True)
    mask = torch.zeros(1, 2, dtype=F64)
    nan = torch.full((1, 2), float("nan"), dtype=F64)
    batch = {"advantages": torch.ones(1, 2, dtype=F64), "old_log_probs": nan, "ref_log_probs": nan}
    for objective in (ppo, gspo, cispo, sft):
        lp.grad = None
        out = objective(inputs(lp, mask, batch, {"use_kl_loss": True, "kl_loss_coef": 0.1},
                               reduce=Aggregator.build("token-mean", mask, global_tokens=5.0)) if objective is not sft
                        else inputs(lp, mask, {}, reduce=Aggregator.build("token-mean", mask, global_tokens=5.0)))
        assert out.loss.requires_grad and torch.isfinite(out.loss) and out.loss.item() == 0.0
        out.loss.backward()
        assert lp.grad is not None and torch.equal(lp.grad, torch.zeros_like(lp))
