"""KL estimators between the current policy and a base policy, per token.

`δ = lp − base`. k1 = δ (unbiased, high variance); k2 = δ²/2; k3 / low_var_kl = exp(−δ) − 1 + δ
(Schulman's low-variance, non-negative estimator). As in miles, −δ goes through the one safe
log-ratio (NaN -> 0, clamp to [−20, 20]) before the exp so a masked garbage token cannot
overflow, and low_var_kl's output is clamped to [−10, 10]; k3 is the same formula without the
output clamp.
"""
from __future__ import annotations

from typing import Optional

import torch

from dsrl.loss.numerics import safe_exp, safe_log_ratio

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def approx_kl(lp: torch.Tensor, base: torch.Tensor, kind: str = "k1",
              importance_ratio: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token KL estimate of KL(π‖base) from sampled-token log-probs (at least fp32)."""
    dtype = torch.promote_types(torch.promote_types(lp.dtype, base.dtype), torch.float32)
    delta = lp.to(dtype) - base.to(dtype)
    if kind == "k1":
        kl = delta
    elif kind == "k2":
        kl = delta.square() / 2.0
    elif kind in ("k3", "low_var_kl"):
        neg = safe_log_ratio(-delta)
        kl = safe_exp(neg) - 1.0 - neg
    else:
        raise ValueError(f"unknown kl_loss_type {kind!r}; expected one of {KL_KINDS}")
    if importance_ratio is not None:
        kl = kl * importance_ratio
    if kind == "low_var_kl":
        kl = kl.clamp(min=-10.0, max=10.0)
    return kl
