"""Train-vs-rollout importance-sampling corrections (TIS / icepop / MIS).

The rollout engine and the trainer score the same tokens slightly differently (kernels, dtypes,
stale weights). A correction reweights the per-token policy loss by the detached ratio
`w = exp(train − rollout)` of trainer-scored *old-policy* log-probs to rollout log-probs, after the
PPO clip and before reduction.

Contract of a correction (built-in or user-supplied by dotted path in config key `tis_function`):

    fn(pg_loss, train_log_probs, rollout_log_probs, mask, config) -> (pg_loss, modified_mask, metrics)

`metrics` maps names to per-token tensors; the objective reduces them with the *original* mask.
The policy loss is then reduced with `modified_mask` as the numerator mask while the aggregator
keeps its denominators: rejecting a token removes its contribution, it does not renormalise the
others. A user function may be called with `train_log_probs=None` (e.g. under
use_rollout_logprobs without an old-policy pass) and may ignore it; built-ins need both inputs
and raise a ValueError naming the missing one.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from dsrl.loss.kl import approx_kl
from dsrl.loss.numerics import safe_exp, safe_log_ratio
from dsrl.loss.options import opt
from dsrl.registry import Registry

Correction = Callable[..., tuple]


def _as_correction(obj: Any, path: str) -> Correction:
    """A correction named by dotted path (config key algo.tis_function) must be a function."""
    if not callable(obj):
        raise TypeError("a correction must be a function fn(pg_loss, train_log_probs, rollout_log_probs, mask, config)")
    return obj


CORRECTIONS = Registry("correction", wrap=_as_correction)
register_correction = CORRECTIONS.register


def get_tis_function(config: Optional[Mapping[str, Any]]) -> tuple[Correction, bool]:
    """(function, is_builtin) for config key `tis_function` (None = built-in 'vanilla')."""
    spec = opt(config, "tis_function")
    if spec is None:
        return CORRECTIONS["vanilla"], True
    if callable(spec):
        return spec, False
    if spec in CORRECTIONS:
        return CORRECTIONS[spec], True
    return CORRECTIONS.resolve(str(spec), "algo.tis_function"), False


def _require(train_log_probs, rollout_log_probs, who: str) -> None:
    if train_log_probs is None:
        raise ValueError(f"built-in TIS '{who}' needs train_log_probs (the trainer-scored old-policy "
                         "log-probs: batch old_log_probs, or the reused training log-probs) but it is missing")
    if rollout_log_probs is None:
        raise ValueError(f"built-in TIS '{who}' needs rollout_log_probs (the rollout engine's sampling "
                         "log-probs) but it is missing")


def _log_ratio(train: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached `train − roll`, finite, 0 on inactive tokens, clamped to ±20 (safe exp)."""
    d = safe_log_ratio(train.detach() - roll.detach())
    return torch.where(mask > 0, d, torch.zeros_like(d))


def _metrics(w: torch.Tensor, w_used: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"tis": w, "tis_clipfrac": (w_used != w).to(w.dtype), "tis_abs": (w - 1.0).abs()}


@register_correction("vanilla")
def vanilla_tis(pg_loss, train_log_probs, rollout_log_probs, mask, config):
    """Truncated IS: pg_loss *= clamp(w, tis_clip_low, tis_clip)."""
    _require(train_log_probs, rollout_log_probs, "vanilla")
    w = _log_ratio(train_log_probs, rollout_log_probs, mask).exp()
    w_used = w.clamp(min=float(opt(config, "tis_clip_low")), max=float(opt(config, "tis_clip")))
    return pg_loss * w_used.to(pg_loss.dtype), mask, _metrics(w, w_used)


@register_correction("icepop")
def icepop(pg_loss, train_log_probs, rollout_log_probs, mask, config):
    """Keep w where tis_clip_low <= w <= tis_clip, reject (mask out) the token otherwise."""
    _require(train_log_probs, rollout_log_probs, "icepop")
    w = _log_ratio(train_log_probs, rollout_log_probs, mask).exp()
    keep = (w >= float(opt(config, "tis_clip_low"))) & (w <= float(opt(config, "tis_clip")))
    w_used = torch.where(keep, w, torch.zeros_like(w))
    return pg_loss * w.to(pg_loss.dtype), mask * keep.to(mask.dtype), _metrics(w, w_used)


@register_correction("mis")
def mis(pg_loss, train_log_probs, rollout_log_probs, mask, config):
    """Masked importance sampling (miles' mis.py example, built in).

    level: token (w_t = exp d_t) | sequence (exp Σ_t d_t) | geometric (exp mean_t d_t), d = train − roll;
    mode:  truncate (min(w, U)) | clip (clamp(w, L, U)) | mask (keep w, reject tokens outside [L, U]);
    optional rejection bounds mis_rs_lower/upper; veto: any active token with exp(d_t) below
    mis_veto_threshold rejects its whole sequence; batch-normalize divides the weights by their
    mean over kept tokens of this microbatch (a local statistic: not microbatch/DP invariant).
    """
    _require(train_log_probs, rollout_log_probs, "mis")
    active = mask > 0
    d = _log_ratio(train_log_probs, rollout_log_probs, mask)
    level = opt(config, "mis_level")
    if level == "token":
        log_w = d
    elif level == "sequence":
        log_w = d.sum(-1, keepdim=True).expand_as(d)
    elif level == "geometric":
        n = active.to(d.dtype).sum(-1, keepdim=True).clamp(min=1.0)
        log_w = (d.sum(-1, keepdim=True) / n).expand_as(d)
    else:
        raise ValueError(f"mis_level must be token|sequence|geometric, got {level!r}")
    w = safe_exp(log_w)
    w = torch.where(active, w, torch.ones_like(w))
    lo, hi = float(opt(config, "mis_lower")), float(opt(config, "mis_upper"))
    keep = active.clone()
    mode = opt(config, "mis_mode")
    if mode == "truncate":
        w_used = w.clamp(max=hi)
    elif mode == "clip":
        w_used = w.clamp(min=lo, max=hi)
    elif mode == "mask":
        w_used = w
        keep &= (w >= lo) & (w <= hi)
    else:
        raise ValueError(f"mis_mode must be truncate|clip|mask, got {mode!r}")
    rs_lo, rs_hi = opt(config, "mis_rs_lower"), opt(config, "mis_rs_upper")
    if rs_lo is not None:
        keep &= w >= float(rs_lo)
    if rs_hi is not None:
        keep &= w <= float(rs_hi)
    veto = torch.zeros_like(active)
    thr = opt(config, "mis_veto_threshold")
    if thr is not None:
        veto = ((d.exp() < float(thr)) & active).any(-1, keepdim=True).expand_as(active)
        keep &= ~veto
    if opt(config, "mis_batch_normalize"):
        kept = keep.to(w.dtype)
        if kept.sum() > 0:
            w_used = w_used / ((w_used * kept).sum() / kept.sum())
    metrics = _metrics(w, torch.where(keep, w_used, torch.zeros_like(w_used)))
    metrics["mis_reject_frac"] = (active & ~keep).to(w.dtype)
    metrics["mis_veto_frac"] = (active & veto).to(w.dtype)
    return pg_loss * w_used.to(pg_loss.dtype), mask * keep.to(mask.dtype), metrics


def mismatch_metrics(old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token train-vs-rollout drift: |old − roll| and the k3 estimate of KL(rollout‖train),
    where `old` is whatever the policy ratio used (so both are 0 under use_rollout_logprobs)."""
    active = mask > 0
    zero = torch.zeros_like(old)
    diff = torch.where(active, (old - roll).abs().nan_to_num(0.0, 0.0, 0.0), zero)
    kl = approx_kl(roll, old, "low_var_kl").nan_to_num(0.0, 0.0, 0.0)
    kl = torch.where(active, kl, torch.zeros_like(kl))
    return {"train_rollout_logprob_abs_diff": diff, "train_rollout_kl": kl}
