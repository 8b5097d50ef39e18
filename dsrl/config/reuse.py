"""Training log-prob reuse: when may the standalone old-policy forward be skipped?

With exactly one optimizer step per rollout and a deterministic forward, the old-policy pass
computes the same log-probs as the training forward, so the detached training log-probs can
serve as the old policy. Every option that breaks that equality is listed here once; `on`
rejects all of them by name (fail-closed, before any model loads) and `auto` reuses exactly
when none is enabled."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from dsrl.config.schema import Config


class ConfigError(ValueError):
    """A bad config value; the message names the key(s)."""


def steps_per_rollout(cfg: Config) -> int:
    """Optimizer steps one rollout makes (num_steps_per_rollout, else samples / global batch)."""
    a = cfg.algo
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    if a.num_steps_per_rollout is not None:
        return int(a.num_steps_per_rollout)
    return max(1, samples // max(a.global_batch_size, 1))


def reuse_blockers(cfg: Config) -> List[str]:
    """Every enabled option that makes the standalone pass differ from the training forward."""
    a, m, t = cfg.algo, cfg.model, cfg.trainer
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    checks = (
        ("model.attention_dropout", m.attention_dropout != 0),
        ("model.hidden_dropout", m.hidden_dropout != 0),
        ("algo.kl_coef", a.kl_coef != 0),
        ("algo.keep_old_actor", a.keep_old_actor),
        ("algo.use_opd", a.use_opd),
        ("algo.num_steps_per_rollout", a.num_steps_per_rollout not in (None, 1)),
        ("algo.global_batch_size", a.global_batch_size != samples),
        ("algo.policy_loss", a.policy_loss == "sft"),
        ("trainer.before_train_step_hooks", bool(t.before_train_step_hooks)),
    )
    return [name for name, enabled in checks if enabled]


@dataclass(frozen=True)
class ReuseDecision:
    reuse: bool  # skip the standalone old-policy pass
    reason: str  # one line for the log
    # Run the standalone old-policy pass at all (False under reuse, and when the rollout
    # log-probs are the old policy and nothing else needs trainer-scored old log-probs).
    run_old_pass: bool


def validate_reuse(cfg: Config) -> None:
    """`on`: raise one error naming every incompatible option."""
    if cfg.algo.reuse_logprobs != "on":
        return
    blockers = reuse_blockers(cfg)
    if blockers:
        samples = cfg.algo.rollout_batch_size * cfg.algo.n_samples_per_prompt
        raise ConfigError(
            "algo.reuse_logprobs=on is incompatible with: " + ", ".join(blockers)
            + f" (reuse needs exactly one deterministic optimizer step per rollout: no dropout, "
            f"kl_coef=0, no old-actor copy, no OPD, num_steps_per_rollout in (null, 1), "
            f"global_batch_size == rollout_batch_size * n_samples_per_prompt = {samples}, no hooks)")


def decide_reuse(cfg: Config) -> ReuseDecision:
    mode = cfg.algo.reuse_logprobs
    blockers = reuse_blockers(cfg)
    need_trainer_old = cfg.algo.use_tis  # TIS compares trainer-scored old log-probs with rollout ones
    if mode == "off":
        return ReuseDecision(False, "reuse_logprobs=off: standalone old-policy pass runs",
                             run_old_pass=not cfg.algo.use_rollout_logprobs or need_trainer_old)
    if blockers:
        if mode == "on":  # validate_reuse already raised; defensive
            raise ConfigError("algo.reuse_logprobs=on is incompatible with: " + ", ".join(blockers))
        return ReuseDecision(False, "reuse_logprobs=auto: standalone old-policy pass runs because of "
                             + ", ".join(blockers),
                             run_old_pass=not cfg.algo.use_rollout_logprobs or need_trainer_old)
    why = "reuse_logprobs=%s: reusing detached training log-probs (one optimizer step, deterministic forward)" % mode
    if cfg.algo.use_rollout_logprobs:
        why += "; rollout log-probs stay the old policy"
    return ReuseDecision(True, why, run_old_pass=False)
