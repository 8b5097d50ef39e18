"""The Tinker objectives on hand-computed inputs (tinker-protocol §1.2/§1.4, semantics §5.3; gspo: the Tinker loss docs)."""
from __future__ import annotations

import math

import pytest
import torch

from dsrl.loss import tinker as T
from dsrl.loss.registry import OBJECTIVES
from dsrl.loss.types import Aggregator, LossInputs

LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


def run(loss_fn, lp, mask, config=None, *, weights=None, q=None, adv=None, indices=None, lengths=None):
    lp = lp.detach().clone().requires_grad_(True)
    batch = {}
    if weights is not None:
        batch["loss_weights"] = weights
    if q is not None:
        batch["sampling_logprobs"] = q
    if adv is not None:
        batch["advantages"] = adv
    if lengths is not None:
        batch["datum_lengths"] = lengths
    inp = LossInputs(log_probs=lp, mask=mask, batch=batch, config=dict(config or {}),
                     reduce=Aggregator.build("sum", mask), sample_indices=indices)
    out = OBJECTIVES["tinker:" + loss_fn].fn(inp)
    out.loss.backward()
    return out, lp.grad


def test_registered_under_namespace():
    for fn in LOSS_FNS:
        assert T.tinker_objective_name(fn) == "tinker:" + fn
        assert "tinker:" + fn in OBJECTIVES
    assert T.tinker_objective_name("gspo") == "tinker:gspo"
    with pytest.raises(ValueError, match="'stable_reinforce' is not offered.*does not guess a loss"):
        T.tinker_objective_name("stable_reinforce")
    with pytest.raises(ValueError, match="unsupported loss_fn 'grpo'"):
        T.tinker_objective_name("grpo")


# ---- semantics §5.3 item 3: the 14 non-zero cases (float64) --------------------------------
RATIOS = [0.5, 0.5, 1, 1, 5, 5, 0.5, 5]
ADV = [2, -3, 2, -3, 2, -3, 11, -13]  # datum 7: 3 tokens; datum 11: 5 tokens, last 2 masked


def _fourteen_inputs():
    lp = torch.full((2, 5), -1.0, dtype=torch.float64)
    q = torch.zeros(2, 5, dtype=torch.float64)
    adv = torch.zeros(2, 5, dtype=torch.float64)
    mask = torch.zeros(2, 5, dtype=torch.float64)
    slots = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    for (b, t), r, a in zip(slots, RATIOS, ADV):
        q[b, t] = -1.0 - math.log(r)
        adv[b, t] = a
    mask[0, :3] = 1
    mask[1, :3] = 1
    return lp, q, adv, mask, slots


def _dro(beta):
    unmasked = list(zip(RATIOS[:6], ADV[:6]))
    return ([a + beta / 2 * math.log(r) ** 2 for r, a in unmasked],
            [-a + beta * math.log(r) for r, a in unmasked])


CASES = {
    "is": ("importance_sampling", {}, [-1, 1.5, -2, 3, -10, 15], [-1, 1.5, -2, 3, -10, 15]),
    "ppo-default": ("ppo", {}, [-1, 2.4, -2, 3, -2.4, 15], [-1, 0, -2, 3, 0, 15]),
    "ppo-override": ("ppo", {"clip_low_threshold": 0.4, "clip_high_threshold": 6},
                     [-1, 1.5, -2, 3, -10, 15], [-1, 1.5, -2, 3, -10, 15]),
    "cispo-default": ("cispo", {}, [1, -1.5, 2, -3, 8, -12], [-1, 1.5, -2, 3, -8, 12]),
    "cispo-override": ("cispo", {"clip_low_threshold": 0.75, "clip_high_threshold": 2},
                       [1.5, -2.25, 2, -3, 4, -6], [-1.5, 2.25, -2, 3, -4, 6]),
    "dro-default": ("dro", {}, *_dro(0.05)),
    "dro-override": ("dro", {"beta": 0.5}, *_dro(0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nonzero_objectives_and_gradients(case):
    loss_fn, config, tok_losses, tok_grads = CASES[case]
    lp, q, adv, mask, slots = _fourteen_inputs()
    out, grad = run(loss_fn, lp, mask, config, q=q, adv=adv, indices=[7, 11], lengths=[3, 5])
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, torch.tensor(sum(tok_losses), dtype=torch.float64))
    expected_grad = torch.zeros(2, 5, dtype=torch.float64)
    for (b, t), g in zip(slots[:6], tok_grads):
        expected_grad[b, t] = g
    torch.testing.assert_close(grad, expected_grad)  # masked tail: exactly zero
    assert [d["sample_index"] for d in out.per_datum] == [7, 11]
    torch.testing.assert_close(torch.stack([d["loss"] for d in out.per_datum]),
                               torch.tensor([sum(tok_losses[:3]), sum(tok_losses[3:])], dtype=torch.float64))
    torch.testing.assert_close(torch.cat([d["logprobs"] for d in out.per_datum]), torch.full((8,), -1.0, dtype=torch.float64))
    torch.testing.assert_close(out.metrics["loss:sum"], out.loss.detach())
    for d in out.per_datum:
        for v in (d["loss"], d["logprobs"], d["elementwise_loss"]):
            assert not v.requires_grad and v.device.type == "cpu"


# ---- §1.4: the single-datum ln .25 / ln .5 case --------------------------------------------
L2 = math.log(2.0)
SINGLE = {
    "cross_entropy": ({}, -2 * math.log(0.25) + 0.5 * math.log(0.5), [-2.0, 0.5]),
    "importance_sampling": ({}, -3.5, [0.5, -4.0]),
    "ppo": ({"clip_low_threshold": 0.75, "clip_high_threshold": 1.5}, -2.25, [0.0, 0.0]),
    "cispo": ({"clip_low_threshold": 0.75, "clip_high_threshold": 1.5}, 0.75 * math.log(0.25) - 3 * math.log(0.5),
              [0.75, -3.0]),
    "dro": ({"beta": 0.3}, 0.3 * L2 ** 2, [1 - 0.3 * L2, -2 + 0.3 * L2]),
}


@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_single_datum_case(loss_fn):
    config, value, grad_expected = SINGLE[loss_fn]
    lp = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)
    q = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    out, grad = run(loss_fn, lp, torch.ones(1, 2), config, weights=torch.tensor([[2.0, -0.5]]), q=q,
                    adv=torch.tensor([[-1.0, 2.0]]))
    assert abs(out.loss.item() - value) < 1e-6
    torch.testing.assert_close(grad, torch.tensor([grad_expected], dtype=torch.float64), atol=1e-6, rtol=0)
    assert abs(out.metrics["loss:sum"].item() - value) < 1e-6


def test_cross_entropy_outputs_per_call_no_duplicates():
    """semantics §5.3 item 1: two calls, one record each, detached, CPU."""
    seen = []
    for idx in (7, 11):
        out, grad = run("cross_entropy", torch.tensor([[-0.5, -0.25]]), torch.ones(1, 2),
                        weights=torch.tensor([[2.0, 3.0]]), indices=[idx])
        assert grad.tolist() == [[-2.0, -3.0]]
        assert out.loss.item() == 1.75
        assert len(out.per_datum) == 1
        rec = out.per_datum[0]
        assert rec["loss"].item() == 1.75 and rec["logprobs"].tolist() == [-0.5, -0.25]
        assert not rec["loss"].requires_grad and not rec["logprobs"].requires_grad
        assert rec["elementwise_loss"].tolist() == [1.0, 0.75]
        seen.append([r["sample_index"] for r in out.per_datum])
    assert seen == [[7], [11]]


# ---- masking --------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_zero_mask_removes_the_datum(loss_fn):
    out, grad = run(loss_fn, torch.tensor([[-0.5, -0.25]]), torch.zeros(1, 2),
                    weights=torch.tensor([[2.0, 3.0]]), q=torch.tensor([[-1.5, -1.25]]),
                    adv=torch.tensor([[1.0, 1.0]]))
    assert out.loss.item() == 0.0
    assert torch.equal(grad, torch.zeros(1, 2))
    assert out.per_datum[0]["loss"].item() == 0.0


@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_zero_mask_row_next_to_live_row_and_extreme_sampler_logprobs(loss_fn):
    """A padding row (mask 0) with a sampler log-prob that would overflow exp(): no NaN, its
    gradient is exactly zero and the live row is unaffected."""
    lp = torch.tensor([[-0.5, -0.25], [-1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    q = torch.tensor([[-0.7, -0.2], [-1000.0, -1000.0]])
    adv = torch.tensor([[1.0, -2.0], [5.0, 5.0]])
    w = torch.tensor([[2.0, 3.0], [7.0, 7.0]])
    out, grad = run(loss_fn, lp, mask, weights=w, q=q, adv=adv)
    solo, solo_grad = run(loss_fn, lp[:1], mask[:1], weights=w[:1], q=q[:1], adv=adv[:1])
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[1], torch.zeros(2))
    torch.testing.assert_close(out.loss, solo.loss)
    torch.testing.assert_close(grad[:1], solo_grad)


def test_cross_entropy_zero_weights_is_exactly_zero():
    out, grad = run("cross_entropy", torch.tensor([[-0.5, -0.25]]), torch.ones(1, 2), weights=torch.zeros(1, 2))
    assert out.loss.item() == 0.0 and torch.equal(grad, torch.zeros(1, 2))


@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_no_supervised_token_keeps_graph_connected(loss_fn):
    lp = torch.randn(3, 4).requires_grad_(True)
    inp = LossInputs(log_probs=lp, mask=torch.zeros(3, 4),
                     batch={"loss_weights": torch.ones(3, 4), "sampling_logprobs": torch.full((3, 4), -50.0),
                            "advantages": torch.ones(3, 4)},
                     config={}, reduce=Aggregator.build("sum", torch.zeros(3, 4)))
    out = OBJECTIVES["tinker:" + loss_fn].fn(inp)
    assert out.loss.requires_grad and out.loss.item() == 0.0
    out.loss.backward()
    assert torch.equal(lp.grad, torch.zeros(3, 4))


# ---- chunk additivity -----------------------------------------------------------------------
@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_chunk_additivity(loss_fn):
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    q = lp + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    whole, whole_grad = run(loss_fn, lp, mask, weights=w, q=q, adv=adv)
    total = 0.0
    for b in range(4):
        part, part_grad = run(loss_fn, lp[b:b + 1], mask[b:b + 1], weights=w[b:b + 1], q=q[b:b + 1],
                              adv=adv[b:b + 1])
        total += part.loss.item()
        torch.testing.assert_close(part_grad, whole_grad[b:b + 1])
    assert abs(total - whole.loss.item()) < 1e-12


# ---- config --------------------------------------------------------------------------------
def test_config_defaults_and_int_values():
    assert T.resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert T.resolve_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert T.resolve_config("dro", None) == {"beta": 0.05}
    cfg = T.resolve_config("ppo", {"clip_low_threshold": 0, "clip_high_threshold": 2})
    assert cfg == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}
    assert all(isinstance(v, float) for v in cfg.values())
    # ints behave as floats in the loss itself
    lp, q, adv, mask, _ = _fourteen_inputs()
    a, _ = run("ppo", lp, mask, {"clip_low_threshold": 0, "clip_high_threshold": 6}, q=q, adv=adv)
    b, _ = run("ppo", lp, mask, {"clip_low_threshold": 0.0, "clip_high_threshold": 6.0}, q=q, adv=adv)
    assert a.loss.item() == b.loss.item()


@pytest.mark.parametrize("loss_fn,key", [("ppo", "beta"), ("cross_entropy", "clip_low_threshold"),
                                         ("dro", "clip_high_threshold"), ("importance_sampling", "eps")])
def test_unknown_config_key_rejected(loss_fn, key):
    with pytest.raises(ValueError) as e:
        T.resolve_config(loss_fn, {key: 1.0})
    assert key in str(e.value) and loss_fn in str(e.value)
    # the objective itself refuses it too
    with pytest.raises(ValueError, match=key):
        run(loss_fn, torch.zeros(1, 1), torch.ones(1, 1), {key: 1.0}, weights=torch.ones(1, 1),
            q=torch.zeros(1, 1), adv=torch.ones(1, 1))


def test_bad_config_values_rejected():
    with pytest.raises(ValueError, match="beta"):
        T.resolve_config("dro", {"beta": "abc"})
    with pytest.raises(ValueError, match="beta"):
        T.resolve_config("dro", {"beta": float("nan")})
    with pytest.raises(ValueError, match="clip_low_threshold"):
        T.resolve_config("ppo", {"clip_low_threshold": 2.0})
    with pytest.raises(ValueError, match="beta"):
        T.resolve_config("dro", {"beta": True})


# ---- gspo (GSPO-token, the Tinker loss docs) by hand -----------------------------------------
def _gspo(config=None, srm=None):
    """Two datums in float64 (the values are worked out in the test below)."""
    lp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    q = torch.tensor([[-1.0 - math.log(2.0), -2.0, -0.5 - math.log(0.25), 7.0],
                      [-1.0 - math.log(3.0), -1.0 + math.log(3.0), -1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 3.0, 9.0], [2.0, 2.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    srm = srm if srm is not None else torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    lp = lp.clone().requires_grad_(True)
    inp = LossInputs(log_probs=lp, mask=mask, config=dict(config or {}), reduce=Aggregator.build("sum", mask),
                     batch={"sampling_logprobs": q, "advantages": adv, "sequence_ratio_mask": srm},
                     sample_indices=[4, 9])
    out = OBJECTIVES["tinker:gspo"].fn(inp)
    out.loss.backward()
    return out, lp.grad


def test_gspo_matches_the_documented_gspo_token_by_hand():
    """Datum 0: log-ratios (ln 2, 0, ln 0.25) on its 3 tokens (the 4th is padding, outside the loss
    mask though the ratio mask marks it): s = exp(mean) = exp(ln(0.5) / 3) = 0.5**(1/3) = 0.7937,
    below 0.8: clipped to 0.8. Datum 1: the ratio mask marks tokens 0-1, log-ratios (ln 3, -ln 3):
    s = 1, not clipped; tokens 2-3 carry s = 1 too. Per token: loss = -min(s A, clip(s) A);
    d loss / d lp_t = -s A where min picks the unclipped term, else 0 (a clipped constant)."""
    out, grad = _gspo()
    s0 = 0.5 ** (1 / 3)
    # datum 0: A = (1, -2, 3): min(s A, 0.8 A) is s A for A > 0 (s < 0.8), 0.8 A for A < 0.
    want_loss0 = [-s0 * 1, -0.8 * -2, -s0 * 3]
    want_grad0 = [-s0 * 1, 0.0, -s0 * 3, 0.0]
    want_loss1 = [-2.0, -2.0, 1.0, 0.0]
    want_grad1 = [-2.0, -2.0, 1.0, -0.0]
    assert float(out.loss) == pytest.approx(sum(want_loss0) + sum(want_loss1), rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([want_grad0, want_grad1], dtype=torch.float64), rtol=1e-12,
                               atol=1e-15)
    assert [d["sample_index"] for d in out.per_datum] == [4, 9]
    torch.testing.assert_close(out.per_datum[0]["elementwise_loss"][:3],
                               torch.tensor(want_loss0, dtype=torch.float64), rtol=1e-12, atol=0)
    # A lower clip bound below s0 leaves datum 0 unclipped: token 1 then has gradient -s0 * -2.
    _, grad = _gspo({"clip_low_threshold": 0.5})
    assert float(grad[0, 1]) == pytest.approx(2 * s0, rel=1e-12)


def test_gspo_refuses_a_datum_whose_ratio_mask_marks_none_of_its_tokens():
    srm = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"loss_fn 'gspo': datum 9: .*sequence_ratio_mask'\] marks none"):
        _gspo(srm=srm)
    with pytest.raises(ValueError, match="unknown loss_fn_config key 'beta' for loss_fn 'gspo'"):
        _gspo({"beta": 1.0})
