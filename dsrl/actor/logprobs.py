"""Log-probs of given target tokens (and entropy) from logits.

Works on row chunks so the fp32 log-softmax over the vocabulary is never materialized for the
whole batch at once; values equal the naive log_softmax+gather."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [B, T, V] (any float dtype), targets [B, T] -> (log_probs [B, T] fp32, entropy [B, T] | None)."""
    x = logits.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        p = torch.softmax(x, dim=-1)
        ent = lse - (p * x).sum(-1)
    return lp, ent
