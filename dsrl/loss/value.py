"""Value losses of the critic (algo.advantage_estimator=gae), in a small registry beside the
policy objectives.

Why not the policy registry: a policy objective's one gradient-carrying input is
`LossInputs.log_probs` and its batch holds only fixed scores, and every objective there is
selectable as `algo.policy_loss`, which the trainer drives through the *actor* engine. A value
loss differentiates the critic's values instead and runs on the critic's engine; putting it in
the same registry would make `algo.policy_loss=clipped` a valid config that trains the policy on
a value loss. So the hub gets a parallel registry with the same shape: `fn(ValueLossInputs) ->
LossOutput`, reduced by the same DP/microbatch-invariant `Aggregator` (its partial sums over
every microbatch and rank add up to the global loss), named by `critic.loss` or a dotted path.

Metrics: `value_loss` and `value_clipfrac` are Aggregator partial sums; the `ev/*` entries are
raw masked sums (count, Σ R, Σ R², Σ e, Σ e² with e = R - V) from which `finish_value_metrics`
forms the global explained variance 1 - Var(R - V) / Var(R) once they are summed over all
microbatches and ranks (a variance is not a sum of per-microbatch variances)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from dsrl.loss.detach import fixed
from dsrl.loss.options import opt
from dsrl.loss.types import Aggregator, LossOutput
from dsrl.registry import Registry

EV_KEYS = ("ev/count", "ev/ret_sum", "ev/ret_sq", "ev/err_sum", "ev/err_sq")
# Var(R) at or below this share of the second moments of R and R - V is rounding, not spread:
# returns are float32 (R = A + V cancels to ~1e-7 relative), so equal returns (e.g. every reward 0
# with gamma = lambda = 1) would otherwise give an explained variance of -1e14.
EV_MIN_RELATIVE_VARIANCE = 1e-10


@dataclass
class ValueLossInputs:
    """Everything a value loss may read. Only `values` carries gradient."""

    values: torch.Tensor  # [B, L] the critic's current value at each target column (with grad)
    mask: torch.Tensor  # [B, L] float loss mask
    batch: Mapping[str, Any]  # fixed inputs: returns [B, L], old_values [B, L] (the values pass)
    config: Mapping[str, Any]  # the run's algo config (value_clip, value_loss_coef)
    reduce: Aggregator  # DP/microbatch-invariant reducer


ValueLoss = Callable[[ValueLossInputs], LossOutput]


def _from_callable(obj: Any, path: str) -> ValueLoss:
    if not callable(obj):
        raise TypeError("a value loss must be a function fn(ValueLossInputs) -> LossOutput")
    return obj


VALUE_LOSSES = Registry("value loss", wrap=_from_callable)


def register_value_loss(name: str) -> Callable[[ValueLoss], ValueLoss]:
    return VALUE_LOSSES.register(name)


def get_value_loss(name: str, key: str = "critic.loss") -> ValueLoss:
    """A registered value loss, or one loaded from a dotted path; errors name `key`."""
    return VALUE_LOSSES.resolve(name, key)


def _active(x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return torch.where(active, x.nan_to_num(0.0, 0.0, 0.0), torch.zeros_like(x))


def explained_variance_sums(values: torch.Tensor, returns: torch.Tensor, active: torch.Tensor) -> dict:
    """Raw masked sums (float64) for the global explained variance; see finish_value_metrics."""
    m = active.to(torch.float64)
    r = returns.detach().to(torch.float64) * m
    e = (returns.detach().to(torch.float64) - values.detach().to(torch.float64)) * m
    return dict(zip(EV_KEYS, (m.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum())))


@register_value_loss("clipped")
def clipped_value_loss(inputs: ValueLossInputs) -> LossOutput:
    """PPO's clipped value loss per token: 0.5 * max((V - R)², (V_clip - R)²) with
    V_clip = V_old + clip(V - V_old, ±value_clip); value_clip null = 0.5 * (V - R)². Times
    algo.value_loss_coef. value_clipfrac: share of tokens the clip moves (|V - V_old| > value_clip)
    and where the clipped term is the larger."""
    cfg, active = inputs.config, inputs.mask > 0
    v = torch.where(active, inputs.values, torch.zeros_like(inputs.values))  # sanitize first
    ret = fixed(inputs.batch.get("returns"))
    if ret is None:
        raise ValueError("value loss requires batch['returns'] (advantages + values from gae)")
    ret = _active(ret.to(v.dtype), active)
    unclipped = (v - ret).square()
    clip = opt(cfg, "value_clip")
    if clip is None:
        per_token, clipfrac = 0.5 * unclipped, torch.zeros_like(v)
    else:
        old = fixed(inputs.batch.get("old_values"))
        if old is None:
            raise ValueError("algo.value_clip needs batch['old_values'] (the critic's values before this update)")
        old = _active(old.to(v.dtype), active)
        v_clip = old + (v - old).clamp(-float(clip), float(clip))
        clipped = (v_clip - ret).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        # Inside the clip V_clip = V_old + (V - V_old) is V only up to rounding, so the clipped
        # term may exceed the unclipped one by an ulp: only a token the clamp moves counts.
        clipfrac = ((clipped > unclipped) & ((v - old).abs() > float(clip))).to(v.dtype)
    value_loss = inputs.reduce(per_token)
    loss = float(opt(cfg, "value_loss_coef")) * value_loss + 0.0 * v.sum()  # empty microbatch: stay in the graph
    metrics = {"value_loss": value_loss.detach(), "value_clipfrac": inputs.reduce(clipfrac.detach()),
               "values": inputs.reduce(v.detach()), "returns": inputs.reduce(ret)}
    metrics.update(explained_variance_sums(v, ret, active))
    return LossOutput(loss=loss, metrics=metrics)


def finish_value_metrics(totals: Mapping[str, float]) -> dict:
    """Global critic metrics from partial sums already summed over microbatches and ranks:
    critic/value_loss, critic/value_clipfrac, critic/values, critic/returns (aggregates) and
    critic/explained_variance = 1 - Var(R - V) / Var(R) over every trainable token (left out when
    Var(R) = 0 up to rounding, EV_MIN_RELATIVE_VARIANCE: undefined, never a fabricated number)."""
    out = {f"critic/{k}": float(v) for k, v in totals.items() if k not in EV_KEYS}
    n = float(totals.get("ev/count", 0.0))
    if n > 0:
        var_r = totals["ev/ret_sq"] / n - (totals["ev/ret_sum"] / n) ** 2
        var_e = totals["ev/err_sq"] / n - (totals["ev/err_sum"] / n) ** 2
        scale = max(totals["ev/ret_sq"], totals["ev/err_sq"]) / n
        if var_r > EV_MIN_RELATIVE_VARIANCE * scale:
            out["critic/explained_variance"] = 1.0 - max(var_e, 0.0) / var_r
    return out
