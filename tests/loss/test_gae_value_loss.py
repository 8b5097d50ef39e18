"""The critic's clipped value loss (dsrl.loss.value) against numbers worked out by hand: loss,
gradient with respect to the values, clip fraction, explained variance, and the DP/microbatch
invariance of its partial sums (two microbatches add up to the one-batch numbers)."""
import pytest
import torch

from dsrl.loss.types import Aggregator
from dsrl.loss.value import (VALUE_LOSSES, ValueLossInputs, finish_value_metrics, get_value_loss)

F64 = torch.float64
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
V = [[1.0, 0.5, -0.3, 9.0], [2.0, 0.5, 7.0, 7.0]]  # masked entries must never be read
V_OLD = [[0.7, 0.45, 0.0, 9.0], [1.0, 0.0, 7.0, 7.0]]
R = [[0.8, 1.0, -1.0, 5.0], [1.5, 1.0, 5.0, 5.0]]
# By hand, value_clip = 0.2 (V_clip = V_old + clip(V - V_old, ±0.2)):
#   row 0: t0 (1-.8)²=.04 vs (.9-.8)²=.01 -> .04;  t1 .25 vs .25 (V-V_old=.05 unclipped) -> .25;
#          t2 (-.3+1)²=.49 vs (-.2+1)²=.64 -> .64 (clipped term wins)
#   row 1: t0 (2-1.5)²=.25 vs (1.2-1.5)²=.09 -> .25;  t1 (.5-1)²=.25 vs (.2-1)²=.64 -> .64 (clipped)
# per token 0.5*max = [.02, .125, .32, .125, .32]; token-mean over 5 tokens = .91 / 5 = .182.
# d/dV (token-mean): (V - R)/5 where the unclipped term wins; 0 where the clipped one wins (V is
# clamped there); masked tokens 0.
EXPECTED_LOSS = 0.182
EXPECTED_GRAD = [[0.2 / 5, -0.5 / 5, 0.0, 0.0], [0.5 / 5, 0.0, 0.0, 0.0]]
# Explained variance over the 5 tokens: R = [.8, 1, -1, 1.5, 1], e = R - V = [-.2, .5, -.7, -.5, .5];
# Var(R) = 5.89/5 - .66² = .7424, Var(e) = 1.28/5 - .08² = .2496.
EXPECTED_EV = 1.0 - 0.2496 / 0.7424


def _inputs(rows=slice(None), mode="token-mean", config=None, **counts):
    v = torch.tensor(V, dtype=F64)[rows].clone().requires_grad_(True)
    mask = MASK[rows]
    # The Aggregator's weights in float64 (Aggregator.build's are float32: 1/5 would be inexact).
    if mode == "token-mean":
        w = torch.full((mask.shape[0],), 1.0 / counts["global_tokens"], dtype=F64)
    else:  # seq-mean-token-mean
        w = 1.0 / (counts["global_seqs"] * mask.sum(-1))
    reduce = Aggregator(mask=mask, seq_weight=w)
    batch = {"returns": torch.tensor(R, dtype=F64)[rows], "old_values": torch.tensor(V_OLD, dtype=F64)[rows]}
    cfg = {"value_clip": 0.2, "value_loss_coef": 1.0, **(config or {})}
    return v, ValueLossInputs(values=v, mask=mask, batch=batch, config=cfg, reduce=reduce)


def test_clipped_value_loss_hand_computed():
    v, inp = _inputs(global_tokens=5.0)
    out = get_value_loss("clipped")(inp)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(EXPECTED_LOSS, abs=1e-12)
    torch.testing.assert_close(v.grad, torch.tensor(EXPECTED_GRAD, dtype=F64), rtol=0, atol=1e-12)
    assert out.metrics["value_clipfrac"].item() == pytest.approx(2 / 5, abs=1e-12)
    assert out.metrics["value_loss"].item() == pytest.approx(EXPECTED_LOSS, abs=1e-12)
    done = finish_value_metrics({k: float(x) for k, x in out.metrics.items()})
    assert done["critic/explained_variance"] == pytest.approx(EXPECTED_EV, abs=1e-12)
    assert done["critic/value_clipfrac"] == pytest.approx(0.4, abs=1e-12)
    assert done["critic/values"] == pytest.approx((1.0 + 0.5 - 0.3 + 2.0 + 0.5) / 5, abs=1e-12)
    assert done["critic/returns"] == pytest.approx(3.3 / 5, abs=1e-12)


def test_clipfrac_ignores_tokens_inside_the_clip_that_round_differently():
    """Inside the clip, V_clip = V_old + (V - V_old) equals V only up to float32 rounding, so the
    clipped term can exceed the unclipped one by an ulp: such a token is not clipped (the same
    token could otherwise count in one microbatch layout and not in another)."""
    g = torch.Generator().manual_seed(0)
    n = 4096
    v = (torch.rand(1, n, generator=g) * 2 - 1) * 0.1  # small V against larger V_old: inexact sums
    old = v + (torch.rand(1, n, generator=g) * 2 - 1) * 0.19  # every token inside value_clip = 0.2
    ret = torch.rand(1, n, generator=g) * 2 - 1
    v_clip = old + (v - old).clamp(-0.2, 0.2)
    assert int(((v_clip - ret).square() > (v - ret).square()).sum()) > 0  # rounding does bite here
    mask = torch.ones(1, n)
    inp = ValueLossInputs(values=v, mask=mask, batch={"returns": ret, "old_values": old},
                          config={"value_clip": 0.2, "value_loss_coef": 1.0},
                          reduce=Aggregator(mask=mask, seq_weight=torch.full((1,), 1.0 / n)))
    out = get_value_loss("clipped")(inp)
    assert out.metrics["value_clipfrac"].item() == 0.0
    # Half of them pushed outside the clip: those whose clipped term is larger count, exactly.
    old[:, ::2] = v[:, ::2] + 0.3
    v_clip = old + (v - old).clamp(-0.2, 0.2)
    wins = ((v_clip - ret).square() > (v - ret).square())[:, ::2]
    assert 0 < int(wins.sum()) < n // 2
    out = get_value_loss("clipped")(inp)
    assert out.metrics["value_clipfrac"].item() == pytest.approx(float(wins.sum()) / n, abs=1e-6)


def test_unclipped_value_loss_and_coefficient():
    # value_clip null: 0.5*(V-R)² = .5*[.04, .25, .49, .25, .25] -> 0.64 / 5 = .128; times coef 0.5 in the loss.
    v, inp = _inputs(config={"value_clip": None, "value_loss_coef": 0.5}, global_tokens=5.0)
    inp.batch.pop("old_values")  # not needed without clipping
    out = get_value_loss("clipped")(inp)
    out.loss.backward()
    assert out.metrics["value_loss"].item() == pytest.approx(0.128, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.064, abs=1e-12)
    diff = (torch.tensor(V, dtype=F64) - torch.tensor(R, dtype=F64)) * MASK
    torch.testing.assert_close(v.grad, 0.5 * diff / 5, rtol=0, atol=1e-12)
    assert out.metrics["value_clipfrac"].item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_two_microbatches_add_up_to_one_batch(mode):
    """The partial sums (loss, clipfrac, EV sums) of two microbatches equal the one-batch
    values: what the trainer's sum over microbatches and ranks relies on."""
    counts = {"global_tokens": 5.0, "global_seqs": 2.0}
    v, inp = _inputs(mode=mode, **counts)
    whole = get_value_loss("clipped")(inp)
    whole.loss.backward()
    sums, grads = {}, []
    for b in (0, 1):
        vb, ib = _inputs(rows=slice(b, b + 1), mode=mode, **counts)
        out = get_value_loss("clipped")(ib)
        out.loss.backward()
        grads.append(vb.grad)
        for k, x in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(x)
    torch.testing.assert_close(torch.cat(grads), v.grad, rtol=0, atol=1e-15)
    a = finish_value_metrics(sums)
    b = finish_value_metrics({k: float(x) for k, x in whole.metrics.items()})
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-12), k


def test_masked_nan_cannot_poison_and_empty_microbatch_stays_in_graph():
    v, inp = _inputs(global_tokens=5.0)
    inp.batch["returns"][0, 3] = float("nan")
    inp.batch["old_values"][1, 3] = float("inf")
    out = get_value_loss("clipped")(inp)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(EXPECTED_LOSS, abs=1e-12) and torch.isfinite(v.grad).all()
    empty = torch.zeros(1, 1, dtype=F64, requires_grad=True)
    z = torch.zeros(1, 1, dtype=F64)
    out = get_value_loss("clipped")(ValueLossInputs(values=empty, mask=z, batch={"returns": z, "old_values": z},
                                                    config={}, reduce=Aggregator(mask=z, seq_weight=torch.ones(1, dtype=F64))))
    out.loss.backward()
    assert out.loss.item() == 0.0 and empty.grad is not None and "critic/explained_variance" not in \
        finish_value_metrics({k: float(x) for k, x in out.metrics.items()})


def test_inputs_are_fixed_and_missing_ones_are_named():
    leaf = torch.tensor(R, dtype=F64, requires_grad=True)
    v, inp = _inputs(global_tokens=5.0)
    inp.batch["returns"] = leaf * 1.0  # a graph-carrying return must not receive gradient
    get_value_loss("clipped")(inp).loss.backward()
    assert leaf.grad is None and v.grad is not None
    _, inp = _inputs(global_tokens=5.0)
    inp.batch.pop("old_values")
    with pytest.raises(ValueError, match="old_values"):
        get_value_loss("clipped")(inp)
    with pytest.raises(Exception, match="critic.loss='nope'"):
        get_value_loss("nope")
    assert "clipped" in VALUE_LOSSES


def test_explained_variance_is_left_out_when_returns_are_equal_up_to_rounding():
    """Every reward 0 with gamma = lambda = 1: R = A + V is 0 up to float32 rounding (~1e-10 here)
    while V is not. Var(R) is rounding, so EV is undefined (left out), not -1e14; a real spread of
    the returns keeps it, worked out by hand."""
    mask = torch.ones(1, 4, dtype=F64)
    values = torch.tensor([[4e-3, -2e-3, 5e-3, 1e-3]], dtype=F64)
    returns = torch.tensor([[1e-10, -2e-10, 0.0, 3e-10]], dtype=F64)
    from dsrl.loss.value import explained_variance_sums

    sums = {k: float(x) for k, x in explained_variance_sums(values, returns, mask > 0).items()}
    assert "critic/explained_variance" not in finish_value_metrics(sums)
    # R = [1, 0, 1, 0] (Var .25), V = [.5, .5, .5, .5]: e = R - V = [.5, -.5, .5, -.5] (Var .25) -> EV 0.
    sums = {k: float(x) for k, x in explained_variance_sums(torch.full((1, 4), 0.5, dtype=F64),
                                                             torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=F64),
                                                             mask > 0).items()}
    assert finish_value_metrics(sums)["critic/explained_variance"] == pytest.approx(0.0, abs=1e-12)
