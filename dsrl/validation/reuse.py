"""Training log-prob reuse: when may the standalone old-policy forward be skipped?

With exactly one optimizer step per rollout and a deterministic forward, the old-policy pass
computes the same log-probs as the training forward, so the detached training log-probs can
serve as the old policy. Every option that breaks that equality is listed here once; `on`
rejects all of them by name (fail-closed) and `auto` reuses exactly when none is enabled.

The decision is taken at three points, each before anything it protects runs:
1. `decide_reuse(cfg)`: the dsrl config alone, before any model loads (validate_reuse raises);
2. `reuse_for_model_config(...)`: the model's HF config after dsrl's dropout knobs (cheap,
   still before any model loads): any dropout / jitter / noise field left non-zero blocks;
3. `reuse_for_model(...)`: the built actor's modules (a dropout layer with p > 0, a noisy
   attribute), before training starts.
The resulting `ReuseDecision` is the one object the trainer consults; `check_reuse_invariants`
re-checks it at run time before any old, reference or teacher pass.

`adaptive` takes the exact reuse above where it applies; otherwise (several optimizer steps per
rollout, dropout, ...) the rollout engine's sampling log-probs serve as the old policy, and each
step a sampled fraction of the sequences is re-scored on the trainer (dsrl.actor.reuse_probe):
a mismatch above algo.reuse_max_mismatch, or an `adaptive_blockers` option, runs the full pass."""
from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, List

from dsrl.config.schema import Config
from dsrl.errors import ConfigError, ReuseInvariantError


def steps_per_rollout(cfg: Config) -> int:
    """Optimizer steps one rollout makes (num_steps_per_rollout, else samples / global batch)."""
    a = cfg.algo
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    if a.num_steps_per_rollout is not None:
        return int(a.num_steps_per_rollout)
    return max(1, samples // max(a.global_batch_size, 1))


def objective_reads_old_log_probs(cfg: Config) -> bool:
    """Whether the configured objective reads old-policy log-probs (registry flag). An unknown
    name counts as reading them; the registry check in validate() reports it by name."""
    from dsrl.loss.registry import get_objective

    try:
        return bool(get_objective(cfg.algo.policy_loss).needs_old_log_probs)
    except KeyError:
        return True


def reuse_blockers(cfg: Config) -> List[str]:
    """Every enabled option that makes the standalone pass differ from the training forward
    (or, for algo.policy_loss, leaves nothing to reuse)."""
    a, m, t = cfg.algo, cfg.model, cfg.trainer
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    checks = (
        ("model.attention_dropout", m.attention_dropout != 0),
        ("model.hidden_dropout", m.hidden_dropout != 0),
        ("actor.lora.dropout", cfg.actor.lora.rank > 0 and cfg.actor.lora.dropout != 0),  # LoRA input dropout
        ("algo.kl_coef", a.kl_coef != 0),
        ("algo.keep_old_actor", a.keep_old_actor),
        ("algo.use_opd", a.use_opd),
        ("algo.num_steps_per_rollout", a.num_steps_per_rollout not in (None, 1)),
        ("algo.global_batch_size", a.global_batch_size != samples),
        # Overlap: the samples come from weights one step older than the training forward's;
        # only the rollout log-probs are that policy (the detached training log-probs are not).
        ("algo.off_policy_steps", a.off_policy_steps != 0 and not a.use_rollout_logprobs),
        ("algo.policy_loss", not objective_reads_old_log_probs(cfg)),
        ("trainer.before_train_step_hooks", bool(t.before_train_step_hooks)),
    )
    return [name for name, enabled in checks if enabled]


@dataclass(frozen=True)
class ReuseDecision:
    reuse: bool  # skip the standalone old-policy pass
    reason: str  # one line for the log
    # Run the standalone old-policy pass at all (False under reuse, when the rollout log-probs
    # are the old policy and nothing else needs trainer-scored old log-probs, and when the
    # objective reads no old log-probs).
    run_old_pass: bool
    # algo.reuse_logprobs=adaptive beyond one step: the rollout log-probs are the old policy,
    # guarded each step by a probe (dsrl.actor.reuse_probe); a failed probe runs the full pass.
    probe: bool = False


def _on_error(cfg: Config, blockers: List[str]) -> ConfigError:
    samples = cfg.algo.rollout_batch_size * cfg.algo.n_samples_per_prompt
    notes = ""
    if "algo.policy_loss" in blockers:
        notes = (f"; algo.policy_loss={cfg.algo.policy_loss!r} reads no old-policy log-probs, so there is "
                 f"nothing to reuse (use reuse_logprobs=auto or off: no old-policy pass runs for it)")
    return ConfigError(
        "algo.reuse_logprobs=on is incompatible with: " + ", ".join(blockers)
        + f" (reuse needs exactly one deterministic optimizer step per rollout: no dropout, "
        f"kl_coef=0, no old-actor copy, no OPD, num_steps_per_rollout in (null, 1), "
        f"off_policy_steps=0 unless use_rollout_logprobs=true, "
        f"global_batch_size == rollout_batch_size * n_samples_per_prompt = {samples}, no hooks{notes})")


def validate_reuse(cfg: Config) -> None:
    """`on`: raise one error naming every incompatible option."""
    if cfg.algo.reuse_logprobs != "on":
        return
    blockers = reuse_blockers(cfg)
    if blockers:
        raise _on_error(cfg, blockers)


def adaptive_blockers(cfg: Config) -> List[str]:
    """Options under which the rollout log-probs are not the old policy (or the trainer needs its
    own old-policy log-probs), so `adaptive` runs the full old-policy pass every step."""
    a, r = cfg.algo, cfg.rollout
    checks = (
        ("rollout.top_p", r.top_p < 1),  # log-probs over the renormalized nucleus
        ("rollout.temperature", r.temperature == 0),  # greedy rollouts carry no log-probs
        ("algo.use_tis", a.use_tis),  # TIS compares trainer-scored old log-probs with the rollout's
        ("algo.off_policy_steps", a.off_policy_steps != 0),  # rollout weights are stale
        ("algo.keep_old_actor", a.keep_old_actor),
        ("algo.use_opd", a.use_opd),
        ("trainer.before_train_step_hooks", bool(cfg.trainer.before_train_step_hooks)),  # may rewrite inputs
    )
    return [name for name, enabled in checks if enabled]


def _adaptive_decision(cfg: Config) -> ReuseDecision:
    """`adaptive` where exact training-log-prob reuse does not apply (several optimizer steps per
    rollout, dropout, ...): rollout log-probs as the old policy under a per-step probe, unless an
    adaptive blocker applies (then the full pass runs every step, named in the reason)."""
    a = cfg.algo
    if not objective_reads_old_log_probs(cfg):
        return ReuseDecision(False, f"reuse_logprobs=adaptive: algo.policy_loss={a.policy_loss!r} reads no "
                             "old-policy log-probs; no old-policy pass runs", run_old_pass=False)
    blockers = adaptive_blockers(cfg)
    if blockers:
        return ReuseDecision(False, "reuse_logprobs=adaptive: full old-policy pass every step because of "
                             + ", ".join(blockers), run_old_pass=_run_old_pass_without_reuse(cfg))
    if a.use_rollout_logprobs:
        return ReuseDecision(False, "reuse_logprobs=adaptive: algo.use_rollout_logprobs=true makes the rollout "
                             "log-probs the old policy by config; no old-policy pass, no probe", run_old_pass=False)
    from dsrl.actor.reuse_probe import max_mismatch

    return ReuseDecision(False, f"reuse_logprobs=adaptive: rollout log-probs are the old policy, probed on "
                         f"{a.reuse_probe_fraction:g} of the sequences each step (full old-policy pass when the mean "
                         f"|dlogp| > algo.reuse_max_mismatch={max_mismatch(cfg):g})", run_old_pass=False, probe=True)


def _adaptive_fallback(cfg: Config, exact_blockers: List[str]) -> ReuseDecision:
    """The adaptive decision, its reason naming what rules out exact training-log-prob reuse."""
    d = _adaptive_decision(cfg)
    return dataclasses.replace(d, reason=d.reason + " (exact reuse ruled out by " + ", ".join(exact_blockers) + ")")


def _run_old_pass_without_reuse(cfg: Config) -> bool:
    """Without reuse the old pass runs unless nothing reads trainer-scored old log-probs: the
    objective reads none, or the rollout log-probs are the old policy and TIS (which compares
    trainer-scored old log-probs with the rollout ones) is off."""
    if not objective_reads_old_log_probs(cfg):
        return False
    return not cfg.algo.use_rollout_logprobs or cfg.algo.use_tis


def critic_note(cfg: Config) -> str:
    """What a critic (an estimator that reads values, e.g. gae) changes for reuse, "" without one.
    Nothing for the actor: the critic is a separate model on its own engine, so the policy's
    training forward and old-policy pass stay equal and the usual blockers decide (gae's KL in
    the reward, algo.kl_coef, is one of them). Its own values pass is never skipped: GAE needs
    the values before either model trains. With one critic step per rollout the training
    forward's V equals V_old (bit-identical on the same microbatches), so the value clip acts
    only from a rollout's second optimizer step on (critic/value_clipfrac = 0 before)."""
    from dsrl.loss.registry import get_advantage_estimator

    try:
        reads_values = getattr(get_advantage_estimator(cfg.algo.advantage_estimator), "needs_values", False)
    except KeyError:  # unknown estimator: validate() names it
        return ""
    if not reads_values:
        return ""
    return (f"; the critic of algo.advantage_estimator={cfg.algo.advantage_estimator} does not change this (own "
            f"engine); its values pass runs every step (GAE reads values before training)")


def decide_reuse(cfg: Config) -> ReuseDecision:
    """The decision from the dsrl config alone (no model needed), its reason saying what a
    critic changes (critic_note)."""
    return _with_critic_note(_config_decision(cfg), cfg)


def _with_critic_note(d: ReuseDecision, cfg: Config) -> ReuseDecision:
    """`d` with its reason saying what a critic changes (the run log prints the reason)."""
    note = critic_note(cfg)
    return dataclasses.replace(d, reason=d.reason + note) if note else d


def _config_decision(cfg: Config) -> ReuseDecision:
    """The decision from the dsrl config alone (no model needed)."""
    mode = cfg.algo.reuse_logprobs
    blockers = reuse_blockers(cfg)
    if mode == "adaptive" and blockers:  # exact reuse does not apply: the probe-guarded rollout reuse
        return _adaptive_fallback(cfg, blockers)
    if mode == "off":
        return ReuseDecision(False, "reuse_logprobs=off: standalone old-policy pass runs"
                             if _run_old_pass_without_reuse(cfg) else
                             "reuse_logprobs=off: no standalone old-policy pass is needed",
                             run_old_pass=_run_old_pass_without_reuse(cfg))
    if blockers:
        if mode == "on":  # validate_reuse already raised; defensive
            raise _on_error(cfg, blockers)
        if not objective_reads_old_log_probs(cfg):
            return ReuseDecision(False, f"reuse_logprobs=auto: algo.policy_loss={cfg.algo.policy_loss!r} reads "
                                 "no old-policy log-probs; no old-policy pass runs", run_old_pass=False)
        return ReuseDecision(False, "reuse_logprobs=auto: standalone old-policy pass runs because of "
                             + ", ".join(blockers), run_old_pass=_run_old_pass_without_reuse(cfg))
    why = "reuse_logprobs=%s: reusing detached training log-probs (one optimizer step, deterministic forward)" % mode
    if cfg.algo.use_rollout_logprobs:
        why += "; rollout log-probs stay the old policy"
    return ReuseDecision(True, why, run_old_pass=False)


def _with_model_blockers(decision: ReuseDecision, cfg: Config, blockers: List[str], where: str) -> ReuseDecision:
    """Fold stochastic parts of the model into a decision: `on` raises naming each, `auto`
    falls back naming each, a decision that does not reuse stays as it is."""
    if not blockers or not decision.reuse:
        return decision
    why = (f"the training forward (train mode) would differ from the old-policy pass (eval mode); "
           f"set them to 0 in {where}")
    if cfg.algo.reuse_logprobs == "on":
        raise ConfigError("algo.reuse_logprobs=on is incompatible with the model: "
                          + ", ".join(blockers) + f" ({why}, or use algo.reuse_logprobs=auto)")
    if cfg.algo.reuse_logprobs == "adaptive":  # no exact reuse: fall back to the probe-guarded one
        return _with_critic_note(_adaptive_fallback(cfg, blockers), cfg)
    return _with_critic_note(ReuseDecision(False, "reuse_logprobs=auto: standalone old-policy pass runs because of "
                                           + ", ".join(blockers), run_old_pass=_run_old_pass_without_reuse(cfg)), cfg)


def reuse_for_model_config(decision: ReuseDecision, cfg: Config, model_path: str) -> ReuseDecision:
    """Point 2: read the model's HF config (no weights), apply dsrl's dropout knobs as the actor
    will, and fold every non-zero dropout / jitter / noise field into the decision."""
    from transformers import AutoConfig

    from dsrl.actor.stochastic import apply_dropout_knobs, stochastic_config_fields

    hf_config = AutoConfig.from_pretrained(model_path)
    apply_dropout_knobs(hf_config, attention_dropout=cfg.model.attention_dropout,
                        hidden_dropout=cfg.model.hidden_dropout)
    blockers = [f"model config {field}" for field in stochastic_config_fields(hf_config)]
    return _with_model_blockers(decision, cfg, blockers, os.path.join(str(model_path), "config.json"))


def reuse_for_model(decision: ReuseDecision, cfg: Config, module: Any) -> ReuseDecision:
    """Point 3: fold every stochastic submodule of the built actor (torch.nn.Module) into the
    decision, before training starts."""
    from dsrl.actor.stochastic import stochastic_modules

    blockers = [f"model module {m}" for m in stochastic_modules(module)]
    return _with_model_blockers(decision, cfg, blockers, "the model's config.json (or the code that adds them)")


def check_reuse_invariants(decision: ReuseDecision, *, steps_per_rollout: int, batch_keys: Iterable[str]) -> None:
    """Runtime guard, run before any old, reference or teacher pass: under reuse, one rollout
    must make exactly one optimizer step and carry no actor log-probs of its own."""
    if not decision.reuse:
        return
    if steps_per_rollout != 1:
        raise ReuseInvariantError(f"reuse_logprobs requires exactly 1 optimizer step per rollout, "
                                  f"got steps_per_rollout={steps_per_rollout}")
    if "old_log_probs" in set(batch_keys):
        raise ReuseInvariantError("reuse_logprobs requires rollout data without actor log-probs, "
                                  "but the batch already holds 'old_log_probs'")
    if decision.run_old_pass:
        raise ReuseInvariantError("reuse_logprobs requires rollout data without actor log-probs, "
                                  "but the decision also runs the old-policy pass (run_old_pass=True), "
                                  "which would put actor 'old_log_probs' into the batch")
