"""The one safe log-ratio / exp used by every objective, correction and KL estimator.

A log-ratio between two scores can be NaN (a garbage masked token) or ±inf (a -inf log-prob), and
exp of a large value overflows. As in miles: NaN -> 0, ±inf -> ±LOG_CLAMP, then clamp to
[-LOG_CLAMP, LOG_CLAMP] before exponentiating."""
from __future__ import annotations

import torch

LOG_CLAMP = 20.0


def safe_log_ratio(x: torch.Tensor) -> torch.Tensor:
    """x with NaN -> 0 and everything clamped to [-LOG_CLAMP, LOG_CLAMP] (gradient flows inside)."""
    x = x.nan_to_num(nan=0.0, posinf=LOG_CLAMP, neginf=-LOG_CLAMP)
    return x.clamp(min=-LOG_CLAMP, max=LOG_CLAMP)


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(safe_log_ratio(x)): finite, in [e^-20, e^20]."""
    return safe_log_ratio(x).exp()
