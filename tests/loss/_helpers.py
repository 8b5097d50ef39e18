"""Small builders shared by the loss-hub tests (no model: seeded random logits)."""
from __future__ import annotations

import torch

from dsrl.loss.types import Aggregator, LossInputs

F64 = torch.float64


def sum_agg(mask: torch.Tensor) -> Aggregator:
    """Raw masked sums in float64 (hand-computed expectations stay exact)."""
    mask = mask.to(F64)
    return Aggregator(mask=mask, seq_weight=torch.ones(mask.shape[0], dtype=F64))


def inputs(lp, mask, batch, config=None, reduce=None, **kw) -> LossInputs:
    mask = mask.to(lp.dtype)
    return LossInputs(log_probs=lp, mask=mask, batch=batch, config=config or {},
                      reduce=reduce if reduce is not None else sum_agg(mask), **kw)


def policy_problem(seed: int, B: int = 3, T: int = 24, V: int = 128, starts=(2, 5, 0), lengths=(10, 19, 7)):
    """Seeded logits [B, T, V], targets [B, T], a loss mask with varied response spans and random
    advantages (zero off-mask), as a trainer would hand to an objective."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b, (s, n) in enumerate(zip(starts, lengths)):
        mask[b, s:s + n] = 1.0
    adv = torch.randn(B, T, generator=g) * mask
    noise = 0.5 * torch.randn(B, T, generator=g)
    return logits, targets, mask, adv, noise


def score(logits: torch.Tensor, targets: torch.Tensor):
    """(log-prob of each target, entropy) of a [B, T, V] logits tensor."""
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
