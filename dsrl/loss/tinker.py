"""Tinker's five built-in losses, registered in the shared objective registry.

Names live under a ``tinker:`` namespace (``tinker:cross_entropy``, ``tinker:importance_sampling``,
``tinker:ppo``, ``tinker:cispo``, ``tinker:dro``) so they never clash with the native RL
objectives (``ppo``, ``cispo``, ...); `tinker_objective_name` maps a Tinker ``loss_fn`` string
to the registry name.

Semantics (Tinker protocol §1): every loss is a *raw sum* over tokens and datums -- no division
by token count, datum count, microbatch count or DP world size; normalization is the client's
business (weights / advantages). With ``lp`` the target log-probs, ``q`` the sampler log-probs
(``batch["sampling_logprobs"]``), ``A`` the advantages, ``w`` the cross-entropy weights
(``batch["loss_weights"]``), ``r = exp(lp - q)`` and ``m`` the loss mask, the per-datum loss is

    cross_entropy        -sum m * w * lp
    importance_sampling  -sum m * r * A
    ppo                  -sum m * min(r * A, clip(r, lo, hi) * A)      lo/hi absolute (0.8, 1.2)
    cispo                -sum m * sg[clip(r, lo, hi)] * lp * A         (0.0, 4.0)
    dro                  -sum m * (lp * A - beta/2 * (lp - q)^2)       beta 0.05

A masked-out position contributes exactly zero value and gradient (the log-ratio is masked
*before* the exponential, so no inf * 0 can appear).

Each objective returns ``LossOutput(loss, metrics={"loss:sum": ...}, per_datum=[...])`` where
``per_datum`` holds, for every row, ``{"sample_index", "logprobs", "loss", "elementwise_loss"}``
detached on the CPU
(``logprobs`` covers the datum's first ``batch["datum_lengths"][b]`` columns, default the whole
row). Outputs travel with the return value -- nothing is collected in module state.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from dsrl.errors import DatumError
from dsrl.loss.registry import register_objective
from dsrl.loss.types import Aggregator, LossInputs, LossOutput

NAMESPACE = "tinker:"

# Tinker loss_fn -> accepted loss_fn_config keys with their defaults.
CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}

# Tinker loss_fn -> required per-token loss_fn_inputs (client names).
REQUIRED_INPUTS: dict[str, tuple] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}

# Client loss_fn_inputs key -> key of LossInputs.batch (target_tokens become the gather labels).
BATCH_KEYS = {"weights": "loss_weights", "logprobs": "sampling_logprobs", "advantages": "advantages"}

TINKER_LOSS_FNS = tuple(CONFIG_DEFAULTS)

# SDK loss names whose objective Tinker does not publish completely: refused by name, with why,
# never answered with a guessed loss.
UNDEFINED_LOSS_FNS = {
    "stable_reinforce": (
        "Tinker's documentation (losses/stable-reinforce, alpha) describes how to use it (sampling with "
        "record_stability_info=True, provenance spans naming the sampled sequence_ids) but not its "
        "objective, which reads information Tinker records at sampling time and does not publish; this "
        "server does not guess a loss under that name"),
}


def unsupported_message(loss_fn: str, offered) -> str:
    why = UNDEFINED_LOSS_FNS.get(loss_fn)
    if why is not None:
        return f"loss_fn {loss_fn!r} is not offered: {why}. Use one of {list(offered)} instead " \
               f"(the cookbook's RL loop trains with loss_fn='importance_sampling' or 'ppo')"
    return f"unsupported loss_fn {loss_fn!r}; this server runs: {list(offered)}"


def tinker_objective_name(loss_fn: str) -> str:
    """Registry name of a Tinker ``loss_fn``; ValueError for anything Tinker-unknown."""
    if loss_fn not in CONFIG_DEFAULTS:
        raise ValueError(unsupported_message(loss_fn, TINKER_LOSS_FNS))
    return NAMESPACE + loss_fn


def resolve_config(loss_fn: str, loss_fn_config: Optional[Mapping[str, Any]]) -> dict:
    """Defaults merged with the request's ``loss_fn_config``.

    Unknown keys raise ValueError naming the key and the loss; ints are accepted as floats;
    non-numeric or non-finite values and inverted clip bounds are rejected."""
    loss_fn = loss_fn[len(NAMESPACE):] if loss_fn.startswith(NAMESPACE) else loss_fn
    if loss_fn not in CONFIG_DEFAULTS:
        raise ValueError(f"unsupported loss_fn {loss_fn!r}; supported: {list(TINKER_LOSS_FNS)}")
    defaults = CONFIG_DEFAULTS[loss_fn]
    out = dict(defaults)
    for key, value in dict(loss_fn_config or {}).items():
        if key not in defaults:
            allowed = sorted(defaults) if defaults else "none"
            raise ValueError(f"unknown loss_fn_config key {key!r} for loss_fn {loss_fn!r} (accepted keys: {allowed})")
        if isinstance(value, bool):
            raise ValueError(f"loss_fn_config[{key!r}] for loss_fn {loss_fn!r} must be a number, got {value!r}")
        if not isinstance(value, (int, float)):
            try:
                value = float(value)  # numeric strings (the SDK types allow str values)
            except (TypeError, ValueError):
                raise ValueError(f"loss_fn_config[{key!r}] for loss_fn {loss_fn!r} must be a number, "
                                 f"got {value!r}") from None
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"loss_fn_config[{key!r}] for loss_fn {loss_fn!r} must be finite, got {value}")
        out[key] = value
    if "clip_low_threshold" in out and out["clip_low_threshold"] > out["clip_high_threshold"]:
        raise ValueError(f"loss_fn {loss_fn!r}: clip_low_threshold {out['clip_low_threshold']} > "
                         f"clip_high_threshold {out['clip_high_threshold']}")
    return out


# ---------------------------------------------------------------------------------------------
def _field(inputs: LossInputs, key: str, loss_fn: str) -> torch.Tensor:
    if key not in inputs.batch or inputs.batch[key] is None:
        raise ValueError(f"loss_fn {loss_fn!r} needs batch[{key!r}]")
    v = inputs.batch[key]
    v = torch.as_tensor(v).to(device=inputs.log_probs.device, dtype=inputs.log_probs.dtype)
    if v.shape != inputs.log_probs.shape:
        raise ValueError(f"loss_fn {loss_fn!r}: batch[{key!r}] has shape {tuple(v.shape)}, "
                         f"expected {tuple(inputs.log_probs.shape)}")
    return v


def _finish(inputs: LossInputs, token_loss: torch.Tensor, mask: torch.Tensor) -> LossOutput:
    """Raw-sum reduction, per-datum outputs and the loss:sum metric."""
    lp = inputs.log_probs
    loss = Aggregator.build("sum", mask)(token_loss, mask.to(token_loss.dtype))
    if not bool((mask != 0).any()):
        # No supervised token: keep the graph connected (every rank must run backward) with an
        # exactly-zero gradient.
        loss = loss + 0.0 * lp.sum()
    with torch.no_grad():
        tok = token_loss.detach() * mask.to(token_loss.dtype)
        per_row = tok.sum(-1)
        total = per_row.sum()
        per_datum = datum_records(inputs, logprobs=lp, loss=per_row, elementwise_loss=tok)
    return LossOutput(loss=loss, metrics={"loss:sum": total.detach()}, per_datum=per_datum)


def datum_records(inputs: LossInputs, **fields: torch.Tensor) -> list:
    """The per-datum records (`LossOutput.per_datum`) of a padded microbatch: for every row b its
    ``sample_index`` and each of ``fields``, detached copies on the CPU: a [B, L] field cut to the
    datum's first ``batch["datum_lengths"][b]`` columns (default the whole row), a [B] field's
    b-th value."""
    B, L = inputs.log_probs.shape
    lengths = inputs.batch.get("datum_lengths")
    indices = inputs.sample_indices if inputs.sample_indices is not None else inputs.batch.get("sample_indices")
    host = {k: v.detach().to("cpu") for k, v in fields.items()}
    out = []
    for b in range(B):
        n = L if lengths is None else int(lengths[b])
        rec = {"sample_index": int(indices[b]) if indices is not None else b}
        rec.update({k: (v[b, :n] if v.dim() == 2 else v[b]).clone() for k, v in host.items()})
        out.append(rec)
    return out


def datum_output(record: Mapping[str, Any]) -> dict:
    """A datum's Tinker ``loss_fn_outputs`` entry from its per-datum record: ``logprobs`` and (when
    the objective gives it: a custom one may not) ``elementwise_loss``, float32 on the host."""
    out = {"logprobs": record["logprobs"].to("cpu", torch.float32).clone()}
    if record.get("elementwise_loss") is not None:
        out["elementwise_loss"] = record["elementwise_loss"].to("cpu", torch.float32).clone()
    return out


def _mask(inputs: LossInputs) -> torch.Tensor:
    m = torch.as_tensor(inputs.mask).to(device=inputs.log_probs.device, dtype=inputs.log_probs.dtype)
    if m.shape != inputs.log_probs.shape:
        raise ValueError(f"loss mask has shape {tuple(m.shape)}, expected {tuple(inputs.log_probs.shape)}")
    return m


def _log_ratio(inputs: LossInputs, mask: torch.Tensor, loss_fn: str) -> torch.Tensor:
    """lp - q, zero wherever the mask is zero (so exp() is 1 there and no inf*0 appears)."""
    q = _field(inputs, "sampling_logprobs", loss_fn)
    on = mask != 0
    return torch.where(on, inputs.log_probs - q, torch.zeros_like(q))


@register_objective(NAMESPACE + "cross_entropy", config_defaults=CONFIG_DEFAULTS["cross_entropy"],
                    required_inputs=("loss_weights",), aggregation="sum",
                    rl_loop_error="it needs per-token loss weights (SFT data), which RL rollouts do not "
                                  "produce; use policy_loss=sft to imitate samples")
def tinker_cross_entropy(inputs: LossInputs) -> LossOutput:
    cfg = resolve_config("cross_entropy", inputs.config)  # noqa: F841 (validates: no keys allowed)
    m = _mask(inputs)
    w = _field(inputs, "loss_weights", "cross_entropy")
    w = torch.where(m != 0, w, torch.zeros_like(w))
    return _finish(inputs, -w * inputs.log_probs, m)


@register_objective(NAMESPACE + "importance_sampling", config_defaults=CONFIG_DEFAULTS["importance_sampling"],
                    required_inputs=("sampling_logprobs", "advantages"), aggregation="sum",
                    skip_zero_advantage_exact=True)
def tinker_importance_sampling(inputs: LossInputs) -> LossOutput:
    resolve_config("importance_sampling", inputs.config)
    m = _mask(inputs)
    ratio = torch.exp(_log_ratio(inputs, m, "importance_sampling"))
    adv = _field(inputs, "advantages", "importance_sampling")
    return _finish(inputs, -ratio * adv, m)


@register_objective(NAMESPACE + "ppo", config_defaults=CONFIG_DEFAULTS["ppo"],
                    required_inputs=("sampling_logprobs", "advantages"), aggregation="sum",
                    skip_zero_advantage_exact=True)
def tinker_ppo(inputs: LossInputs) -> LossOutput:
    cfg = resolve_config("ppo", inputs.config)
    m = _mask(inputs)
    ratio = torch.exp(_log_ratio(inputs, m, "ppo"))
    adv = _field(inputs, "advantages", "ppo")
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * adv
    out = _finish(inputs, -torch.minimum(unclipped, clipped), m)
    return out


@register_objective(NAMESPACE + "cispo", config_defaults=CONFIG_DEFAULTS["cispo"],
                    required_inputs=("sampling_logprobs", "advantages"), aggregation="sum",
                    skip_zero_advantage_exact=True)
def tinker_cispo(inputs: LossInputs) -> LossOutput:
    cfg = resolve_config("cispo", inputs.config)
    m = _mask(inputs)
    ratio = torch.exp(_log_ratio(inputs, m, "cispo")).detach()
    coef = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    adv = _field(inputs, "advantages", "cispo")
    return _finish(inputs, -coef * inputs.log_probs * adv, m)


@register_objective(NAMESPACE + "dro", config_defaults=CONFIG_DEFAULTS["dro"],
                    required_inputs=("sampling_logprobs", "advantages"), aggregation="sum",
                    skip_zero_advantage_exact=False)
def tinker_dro(inputs: LossInputs) -> LossOutput:
    cfg = resolve_config("dro", inputs.config)
    m = _mask(inputs)
    diff = _log_ratio(inputs, m, "dro")
    adv = _field(inputs, "advantages", "dro")
    return _finish(inputs, -(inputs.log_probs * adv - 0.5 * cfg["beta"] * diff * diff), m)


@register_objective(NAMESPACE + "gspo", config_defaults=CONFIG_DEFAULTS["gspo"],
                    required_inputs=("sampling_logprobs", "advantages", "sequence_ratio_mask"), aggregation="sum",
                    skip_zero_advantage_exact=True)
def tinker_gspo(inputs: LossInputs) -> LossOutput:
    """GSPO-token as the Tinker loss docs define it: per datum, the sequence log-ratio is the mean
    of (sg(lp) - q) over the tokens `sequence_ratio_mask` marks; every token's ratio is
    exp(that + lp - sg(lp)) (the sequence ratio's value, its own token's gradient), clipped like
    ppo; raw sum of -min(ratio * A, clip(ratio) * A). A datum with loss tokens but no marked one
    has no sequence ratio: refused, naming it."""
    cfg = resolve_config("gspo", inputs.config)
    m = _mask(inputs)
    lp = inputs.log_probs
    q = _field(inputs, "sampling_logprobs", "gspo")
    in_ratio = (_field(inputs, "sequence_ratio_mask", "gspo") != 0) & (m != 0)
    count = in_ratio.to(lp.dtype).sum(-1, keepdim=True)
    empty = (count[:, 0] == 0) & (m != 0).any(-1)
    if bool(empty.any()):
        row = int(empty.nonzero()[0, 0])
        indices = inputs.sample_indices if inputs.sample_indices is not None else inputs.batch.get("sample_indices")
        datum = int(indices[row]) if indices is not None else row
        raise DatumError(f"loss_fn 'gspo': datum {datum}: loss_fn_inputs['sequence_ratio_mask'] marks none of its "
                         "tokens, so its sequence ratio is undefined")
    token_log_ratio = torch.where(in_ratio, lp.detach() - q, torch.zeros_like(q))
    seq_log_ratio = token_log_ratio.sum(-1, keepdim=True) / count.clamp(min=1.0)
    ratio = torch.exp(seq_log_ratio + lp - lp.detach())
    adv = _field(inputs, "advantages", "gspo")
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * adv
    token_loss = torch.where(m != 0, -torch.minimum(ratio * adv, clipped), torch.zeros_like(lp))
    return _finish(inputs, token_loss, m)
