"""Semantic validation of a composed config, run once in main before anything heavy loads.
Every error names the offending key; all problems are reported together."""
from __future__ import annotations

from typing import List

from dsrl.config.reuse import ConfigError, validate_reuse
from dsrl.config.schema import Config

_CHOICES = {
    "algo.reuse_logprobs": ("off", "on", "auto"),
    "algo.kl_loss_type": ("k1", "k2", "k3", "low_var_kl"),
    "algo.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "model.dtype": ("float32", "bfloat16"),
    "rollout.dtype": ("float32", "bfloat16"),
    "rollout.backend": ("vllm",),
    "data.name": ("arith", "gsm8k"),
}


def _get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    errors: List[str] = []
    for key, choices in _CHOICES.items():
        v = _get(cfg, key)
        if v not in choices:
            errors.append(f"{key}={v!r} is not one of {list(choices)}")
    a = cfg.algo
    positive = ("algo.n_samples_per_prompt", "algo.rollout_batch_size", "algo.global_batch_size",
                "actor.micro_batch_size", "actor.forward_micro_batch_size", "rollout.max_new_tokens",
                "trainer.total_steps", "data.digits", "data.num_operands")
    for key in positive:
        if _get(cfg, key) < 1:
            errors.append(f"{key}={_get(cfg, key)} must be >= 1")
    if cfg.actor.zero_stage not in (0, 1, 2, 3):
        errors.append(f"actor.zero_stage={cfg.actor.zero_stage} must be 0, 1, 2 or 3")
    if cfg.actor.lr <= 0:
        errors.append(f"actor.lr={cfg.actor.lr} must be > 0")
    if cfg.rollout.temperature <= 0:
        errors.append(f"rollout.temperature={cfg.rollout.temperature} must be > 0 (training log-probs divide by it)")
    if not 0 < cfg.rollout.top_p <= 1:
        errors.append(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    for key in ("model.attention_dropout", "model.hidden_dropout"):
        if not 0 <= _get(cfg, key) < 1:
            errors.append(f"{key}={_get(cfg, key)} must be in [0, 1)")
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    if samples % a.global_batch_size:
        errors.append(f"algo.global_batch_size={a.global_batch_size} must divide rollout_batch_size * "
                      f"n_samples_per_prompt = {samples}")
    if a.num_steps_per_rollout is not None and a.num_steps_per_rollout < 1:
        errors.append(f"algo.num_steps_per_rollout={a.num_steps_per_rollout} must be >= 1 or null")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1.0:
        errors.append(f"algo.eps_clip_c={a.eps_clip_c} must be > 1 (dual-clip)")
    if a.use_tis and a.use_rollout_logprobs:
        errors.append("algo.use_tis and algo.use_rollout_logprobs are mutually exclusive "
                      "(TIS reweights trainer-vs-rollout mismatch; with rollout log-probs as the old policy there is none)")
    if a.kl_coef != 0 and a.use_kl_loss and a.kl_loss_coef != 0:
        errors.append("algo.kl_coef and algo.kl_loss_coef cannot both be non-zero (KL in reward and in loss)")
    if a.use_kl_loss and a.kl_loss_coef == 0:
        errors.append("algo.use_kl_loss=true needs algo.kl_loss_coef != 0")
    if a.use_opd and not cfg.model.teacher_path:
        errors.append("algo.use_opd=true needs model.teacher_path (the teacher scored forward-only)")
    if a.keep_old_actor:
        errors.append("algo.keep_old_actor: a frozen old-actor copy is not implemented by the trainer")
    _check_registry(cfg, errors)
    try:
        validate_reuse(cfg)
    except ConfigError as e:
        errors.append(str(e))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _check_registry(cfg: Config, errors: List[str]) -> None:
    from dsrl.loss.registry import get_advantage_estimator, get_objective

    try:
        get_advantage_estimator(cfg.algo.advantage_estimator)
    except KeyError as e:
        errors.append(f"algo.advantage_estimator: {e.args[0]}")
    try:
        get_objective(cfg.algo.policy_loss)
    except KeyError as e:
        errors.append(f"algo.policy_loss: {e.args[0]}")
