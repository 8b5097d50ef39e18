"""Aggregator against numbers worked out by hand (values and gradients), not against another
Aggregator call. The running example is a microbatch of two responses, lengths 1 and 3:

    mask = [[1, 0, 0],        x = [[2,  7, 9],      masked row sums: s0 = 2
            [1, 1, 1]]             [1, -3, 5]]                        s1 = 1 - 3 + 5 = 3

(7 and 9 sit on masked positions and must not count). The Aggregator's per-sequence weights are
computed in float32, so values with a 1/3 or 1/6 weight are compared to 1e-6 relative."""
import pytest
import torch

from dsrl.loss.types import Aggregator

F64 = torch.float64
MASK = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
X = [[2.0, 7.0, 9.0], [1.0, -3.0, 5.0]]


def _x():
    return torch.tensor(X, dtype=F64, requires_grad=True)


def _value_and_grad(agg, mask=None):
    x = _x()
    y = agg(x) if mask is None else agg(x, mask=mask)
    y.backward()
    return y.item(), x.grad


# The microbatch is the whole step: 4 tokens, 2 sequences; norm_len 4.
#   token-mean               (2 + 3) / 4          = 1.25   d/dx = mask / 4
#   seq-mean-token-sum       (2 + 3) / 2          = 2.5    d/dx = mask / 2
#   seq-mean-token-mean      (2/1 + 3/3) / 2      = 1.5    d/dx = [[1/2, 0, 0], [1/6, 1/6, 1/6]]
#   seq-mean-token-sum-norm  (2 + 3) / (2 * 4)    = 0.625  d/dx = mask / 8
#   sum                      2 + 3                = 5      d/dx = mask
WHOLE_STEP = [
    ("token-mean", 1.25, [[1 / 4, 0, 0], [1 / 4, 1 / 4, 1 / 4]]),
    ("seq-mean-token-sum", 2.5, [[1 / 2, 0, 0], [1 / 2, 1 / 2, 1 / 2]]),
    ("seq-mean-token-mean", 1.5, [[1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6]]),
    ("seq-mean-token-sum-norm", 0.625, [[1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]]),
    ("sum", 5.0, [[1, 0, 0], [1, 1, 1]]),
]


@pytest.mark.parametrize("mode,value,grad", WHOLE_STEP, ids=[m for m, _, _ in WHOLE_STEP])
def test_whole_step_by_hand(mode, value, grad):
    agg = Aggregator.build(mode, MASK, global_tokens=4, global_seqs=2, norm_len=4)
    got, g = _value_and_grad(agg)
    assert got == pytest.approx(value, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=F64), rtol=1e-6, atol=0)


# The same microbatch inside a larger step (all ranks, all microbatches): 10 tokens, 5 sequences.
# Each result is a partial sum over the global denominators; "sum" has none.
#   token-mean               (2 + 3) / 10         = 0.5
#   seq-mean-token-sum       (2 + 3) / 5          = 1.0
#   seq-mean-token-mean      (2/1 + 3/3) / 5      = 0.6
#   seq-mean-token-sum-norm  (2 + 3) / (5 * 4)    = 0.25
#   sum                      2 + 3                = 5
PARTIAL = [("token-mean", 0.5), ("seq-mean-token-sum", 1.0), ("seq-mean-token-mean", 0.6),
           ("seq-mean-token-sum-norm", 0.25), ("sum", 5.0)]


@pytest.mark.parametrize("mode,value", PARTIAL, ids=[m for m, _ in PARTIAL])
def test_partial_sum_uses_global_denominators(mode, value):
    agg = Aggregator.build(mode, MASK, global_tokens=10, global_seqs=5, norm_len=4)
    assert _value_and_grad(agg)[0] == pytest.approx(value, rel=1e-6)


def test_two_microbatches_add_up_to_the_hand_total():
    """Step = microbatch A (one response [3, -1]) + the running example: 6 tokens, 3 sequences.
    token-mean:          A = (3 - 1)/6 = 1/3,    B = 5/6,           total = (2 + 2 + 3)/6 = 7/6
    seq-mean-token-mean: A = (2/2)/3 = 1/3,      B = (2 + 1)/3 = 1, total = (1 + 2 + 1)/3 = 4/3"""
    mask_a, x_a = torch.tensor([[1.0, 1.0]]), torch.tensor([[3.0, -1.0]], dtype=F64)
    for mode, a_val, b_val, total in (("token-mean", 1 / 3, 5 / 6, 7 / 6),
                                      ("seq-mean-token-mean", 1 / 3, 1.0, 4 / 3)):
        a = Aggregator.build(mode, mask_a, global_tokens=6, global_seqs=3)(x_a).item()
        b = Aggregator.build(mode, MASK, global_tokens=6, global_seqs=3)(_x()).item()
        assert a == pytest.approx(a_val, rel=1e-6) and b == pytest.approx(b_val, rel=1e-6), mode
        assert a + b == pytest.approx(total, rel=1e-6), mode


def test_numerator_mask_keeps_the_denominators():
    """A correction rejects tokens (numerator mask [[0,0,0],[1,0,1]]); the weights still come from
    the loss mask, so the other tokens are not renormalised:
    token-mean          (1 + 5) / 4           = 1.5    d/dx = [[0, 0, 0], [1/4, 0, 1/4]]
    seq-mean-token-mean (0/1 + (1 + 5)/3) / 2 = 1.0    d/dx = [[0, 0, 0], [1/6, 0, 1/6]]"""
    keep = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    for mode, value, grad in (("token-mean", 1.5, [[0, 0, 0], [1 / 4, 0, 1 / 4]]),
                              ("seq-mean-token-mean", 1.0, [[0, 0, 0], [1 / 6, 0, 1 / 6]])):
        agg = Aggregator.build(mode, MASK, global_tokens=4, global_seqs=2)
        got, g = _value_and_grad(agg, mask=keep)
        assert got == pytest.approx(value, rel=1e-6), mode
        torch.testing.assert_close(g, torch.tensor(grad, dtype=F64), rtol=1e-6, atol=0)


def test_empty_rows_contribute_exact_zeros():
    """A row with no loss tokens (an empty padding microbatch, or a fully masked response) adds 0,
    also in seq-mean-token-mean whose 1/length would be 1/0 (the length is clamped to 1):
    mask [[0,0,0],[1,1,1]], seq-mean-token-mean over 2 sequences: (0 + 3/3) / 2 = 0.5."""
    mask = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    got, g = _value_and_grad(Aggregator.build("seq-mean-token-mean", mask, global_seqs=2))
    assert got == pytest.approx(0.5, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[0, 0, 0], [1 / 6, 1 / 6, 1 / 6]], dtype=F64), rtol=1e-6, atol=0)
    empty = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "sum"):
        got, g = _value_and_grad(Aggregator.build(mode, empty, global_tokens=4, global_seqs=2))
        assert got == 0.0 and torch.equal(g, torch.zeros(2, 3, dtype=F64)), mode


def test_bad_mode_and_norm_len_are_named():
    with pytest.raises(ValueError, match="token-average"):
        Aggregator.build("token-average", MASK, global_tokens=4, global_seqs=2)
    with pytest.raises(ValueError, match="norm_len"):
        Aggregator.build("seq-mean-token-sum-norm", MASK, global_tokens=4, global_seqs=2, norm_len=0)
