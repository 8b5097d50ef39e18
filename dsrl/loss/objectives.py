"""Native RL objectives: ppo (token ratio, clip-higher, dual-clip), gspo (sequence ratio), cispo
(clipped-IS-weighted REINFORCE) and sft. One signature: `fn(inputs: LossInputs) -> LossOutput`.

All policy objectives share one pipeline (`_policy_loss`): pick the old policy, form the
per-token log-ratio `ppo_kl = old − lp`, build the per-token loss, apply an optional TIS/MIS
correction, reduce with the DP-invariant aggregator, then add the KL loss and entropy bonus.
Only `inputs.log_probs` (and `inputs.entropy` when weighted) carry gradient; every score from the
batch goes through `fixed()`. Inactive tokens (mask 0) are replaced by exact zeros *before* any
arithmetic, so a NaN/inf on a padded or masked token can poison neither the loss nor its gradient.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dsrl.loss.corrections import get_tis_function, mismatch_metrics
from dsrl.loss.detach import fixed
from dsrl.loss.kl import approx_kl
from dsrl.loss.numerics import safe_exp
from dsrl.loss.options import clip_bounds, opt
from dsrl.loss.registry import register_objective
from dsrl.loss.types import LossInputs, LossOutput


def _active_only(x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """x on active tokens with nan/±inf -> 0, exact 0 elsewhere (gradient-safe: `where`)."""
    return torch.where(active, x.nan_to_num(0.0, 0.0, 0.0), torch.zeros_like(x))


def select_old_policy(inputs: LossInputs) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(old, trainer_scored, rollout) log-probs for the policy ratio, all detached.

    old = rollout log-probs under use_rollout_logprobs; else the detached training log-probs under
    training log-prob reuse (one optimizer step per rollout: the old-policy pass would compute the
    very same numbers); else the batch's old_log_probs. `trainer_scored` is what TIS compares
    against the rollout engine: detached training log-probs under reuse, else batch old_log_probs
    (None if absent).
    """
    cfg, batch = inputs.config, inputs.batch
    roll = fixed(batch.get("rollout_log_probs"))
    batch_old = fixed(batch.get("old_log_probs"))
    if inputs.reuse_training_logprobs:
        if batch_old is not None:
            raise ValueError("reuse_training_logprobs is set but the batch carries old_log_probs: "
                             "reuse requires rollout data without an old-policy pass")
        trainer_scored = inputs.log_probs.detach()
    else:
        trainer_scored = batch_old
    if opt(cfg, "use_rollout_logprobs"):
        if roll is None:
            raise ValueError("rollout_log_probs must be provided when use_rollout_logprobs is set")
        return roll, trainer_scored, roll
    if trainer_scored is None:
        raise ValueError("policy loss requires old-policy log-probs: batch['old_log_probs'] is missing "
                         "and reuse_training_logprobs is off")
    return trainer_scored, trainer_scored, roll


def _token_kl(lp, old, active):
    return _active_only(old - lp, active)


def _sequence_kl(lp, old, active):
    """GSPO: every token of sequence i gets s_i = mean_t(old − lp) over its active tokens, so the
    ratio exp(−s_i) is the geometric-mean sequence ratio (gradient flows to every token of i)."""
    d = _active_only(old - lp, active)
    n = active.to(d.dtype).sum(-1, keepdim=True).clamp(min=1.0)
    s = d.sum(-1, keepdim=True) / n
    return torch.where(active, s.expand_as(d), torch.zeros_like(d))


def clipped_pg(ratio, adv, lo, hi, eps_clip_c=None):
    """PPO clipped surrogate per token -> (loss, clipfrac). Dual-clip bounds the loss of a
    negative-advantage token by −c·A; its activations are not counted in clipfrac."""
    l1 = -ratio * adv
    l2 = -ratio.clamp(min=lo, max=hi) * adv
    loss = torch.maximum(l1, l2)
    clipfrac = (l2 > l1).to(ratio.dtype)
    if eps_clip_c is not None:
        c = float(eps_clip_c)
        if not c > 1.0:
            raise ValueError(f"eps_clip_c must be > 1.0 for dual-clip PPO, got {c}")
        loss = torch.where(adv < 0, torch.minimum(-c * adv, loss), loss)
    return loss, clipfrac


def cispo_pg(ratio, adv, lp, lo, hi):
    """CISPO: −sg(clip(ρ, lo, hi))·A·lp; clipfrac = 1[clip(ρ) ≠ ρ]."""
    clipped = ratio.clamp(min=lo, max=hi)
    return -clipped.detach() * adv * lp, (clipped != ratio).to(ratio.dtype)


def _policy_loss(inputs: LossInputs, ratio_kind: str, surrogate: Callable) -> LossOutput:
    cfg, reduce = inputs.config, inputs.reduce
    mask = inputs.mask
    active = mask > 0
    # Sanitize first: every later tensor is an exact 0 on inactive tokens.
    lp = torch.where(active, inputs.log_probs, torch.zeros_like(inputs.log_probs))
    old, trainer_scored, roll = select_old_policy(inputs)
    adv = fixed(inputs.batch.get("advantages"))
    if adv is None:
        raise ValueError("policy loss requires batch['advantages']")
    adv = _active_only(adv.to(lp.dtype), active)
    old = _active_only(old.to(lp.dtype), active)

    ppo_kl = (_sequence_kl if ratio_kind == "sequence" else _token_kl)(lp, old, active)
    ratio = safe_exp(-ppo_kl)
    lo, hi = clip_bounds(cfg)
    pg, clipfrac = surrogate(ratio, adv, lp, lo, hi, cfg)

    metrics: dict[str, torch.Tensor] = {}
    pg_mask = mask
    if opt(cfg, "use_tis"):
        fn, _ = get_tis_function(cfg)
        pg, pg_mask, tis_metrics = fn(pg, trainer_scored, roll, mask, cfg)
        for name, value in tis_metrics.items():
            metrics[name] = reduce(value.detach())
        metrics["ois"] = reduce(ratio.detach())
    pg = torch.where(pg_mask > 0, pg, torch.zeros_like(pg))
    pg_loss = reduce(pg, mask=pg_mask)
    loss = pg_loss

    if opt(cfg, "use_kl_loss"):
        ref = fixed(inputs.batch.get("ref_log_probs"))
        if ref is None:
            raise ValueError("use_kl_loss requires batch['ref_log_probs']")
        coef = float(opt(cfg, "kl_loss_coef"))
        src = lp if coef != 0 else lp.detach()
        is_ratio = safe_exp(src - old) if opt(cfg, "use_unbiased_kl") else None
        kl = approx_kl(src, _active_only(ref, active), opt(cfg, "kl_loss_type"), is_ratio)
        kl_loss = reduce(_active_only(kl, active))
        if coef != 0:
            loss = loss + coef * kl_loss.to(loss.dtype)
        metrics["kl_loss"] = kl_loss.detach()

    entropy_coef = float(opt(cfg, "entropy_coef"))
    if inputs.entropy is not None:
        ent = torch.where(active, inputs.entropy, torch.zeros_like(inputs.entropy))
        ent_loss = reduce(ent if entropy_coef != 0 else ent.detach())
        if entropy_coef != 0:
            loss = loss - entropy_coef * ent_loss
        metrics["entropy"] = ent_loss.detach()
    elif entropy_coef != 0:
        raise ValueError("entropy_coef != 0 requires inputs.entropy")

    if roll is not None:
        for name, value in mismatch_metrics(old, _active_only(roll.to(lp.dtype), active), mask).items():
            metrics[name] = reduce(value)
    rkl = fixed(inputs.batch.get("opd_reverse_kl"))
    if isinstance(rkl, torch.Tensor):
        metrics["opd_reverse_kl"] = reduce(_active_only(rkl.to(lp.dtype), active))

    # Keep an empty microbatch (mask all zero) in the backward graph: every rank must join the
    # gradient all-reduce. Adding an exact zero leaves non-empty losses bit-identical.
    loss = loss + 0.0 * lp.sum()
    metrics.update(loss=loss.detach(), pg_loss=pg_loss.detach(), pg_clipfrac=reduce(clipfrac.detach()),
                   ppo_kl=reduce(ppo_kl.detach()), logprob=reduce(lp.detach()))
    return LossOutput(loss=loss, metrics=metrics)


def _ppo_surrogate(ratio, adv, lp, lo, hi, cfg):
    return clipped_pg(ratio, adv, lo, hi, opt(cfg, "eps_clip_c"))


def _cispo_surrogate(ratio, adv, lp, lo, hi, cfg):
    return cispo_pg(ratio, adv, lp, lo, hi)


@register_objective("ppo", required_inputs=("advantages",), needs_old_log_probs=True,
                    skip_zero_advantage_exact=True)
def ppo(inputs: LossInputs) -> LossOutput:
    """Token-level clipped PPO (GRPO/DAPO/Dr.GRPO differ only in advantages and config)."""
    return _policy_loss(inputs, "token", _ppo_surrogate)


@register_objective("gspo", required_inputs=("advantages",), needs_old_log_probs=True,
                    skip_zero_advantage_exact=True)
def gspo(inputs: LossInputs) -> LossOutput:
    """GSPO: PPO clip on the per-sequence geometric-mean ratio."""
    return _policy_loss(inputs, "sequence", _ppo_surrogate)


@register_objective("cispo", required_inputs=("advantages",), needs_old_log_probs=True,
                    skip_zero_advantage_exact=True)
def cispo(inputs: LossInputs) -> LossOutput:
    """CISPO: REINFORCE weighted by the stop-gradient clipped token ratio (no token is dropped)."""
    return _policy_loss(inputs, "token", _cispo_surrogate)


@register_objective("sft")
def sft(inputs: LossInputs) -> LossOutput:
    """Masked cross-entropy on the target tokens: aggregate of −lp."""
    active = inputs.mask > 0
    lp = torch.where(active, inputs.log_probs, torch.zeros_like(inputs.log_probs))
    loss = inputs.reduce(-lp) + 0.0 * lp.sum()
    metrics = {"loss": loss.detach(), "logprob": inputs.reduce(lp.detach())}
    if inputs.entropy is not None:
        ent = torch.where(active, inputs.entropy, torch.zeros_like(inputs.entropy))
        metrics["entropy"] = inputs.reduce(ent.detach())
    return LossOutput(loss=loss, metrics=metrics)
