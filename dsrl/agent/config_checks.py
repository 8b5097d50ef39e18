"""Validation of the multi-turn rollout keys (`rollout.env`, `rollout.env_kwargs`,
`rollout.max_turns`, `rollout.max_episode_tokens`) against the rest of the config, before
anything heavy loads. dsrl/validation/validate.py calls `check_agent_config(cfg)` and adds the
returned errors (each names its key); an empty `rollout.env` (single-turn GRPO) returns none.

What applies per episode: group advantage estimators (grpo, dr_grpo, rloo, reinforce_pp ...)
take the episode's reward (the sum of its turn rewards); training log-prob reuse (on/auto), TIS,
KL and OPD work unchanged, because they act per token under the loss mask, which is the model
mask; both rollout backends (vllm, hf) take token-id prompts and return sampling log-probs.
What does not apply is rejected here by name: GAE, reinforce_pp with gamma < 1, adaptive reuse,
the single-turn greedy evaluation, reward.fn/url, data.chat_template=false, data.system_prompt."""
from __future__ import annotations

from typing import Any, List

from dsrl.registry import PluginError

# Options with values that do not apply to episodes: key -> the values that do.
_UNSUPPORTED = {
    # adaptive's probe averages the trainer-vs-rollout mismatch over response tokens, environment
    # tokens (0 vs 0) included: its threshold would be diluted by them.
    "algo.reuse_logprobs": ("off", "on", "auto"),
}
# Booleans that must be off: key -> why.
_MUST_BE_OFF = {
    "trainer.eval_before": "the greedy evaluation is single-turn (data prompts + reward verifier, no environment)",
    "trainer.eval_after": "the greedy evaluation is single-turn (data prompts + reward verifier, no environment)",
}
# Keys that must stay unset: key -> why.
_MUST_BE_UNSET = {
    "reward.fn": "episode rewards come from the environment (e.g. rollout.env_kwargs.verifier for calculator)",
    "reward.url": "episode rewards come from the environment, not a reward server",
}


def check_agent_config(cfg: Any) -> List[str]:
    r = cfg.rollout
    name = getattr(r, "env", "") or ""
    if not name:
        return []
    errors: List[str] = []
    from dsrl.agent.environments import make_env

    kwargs = dict(getattr(r, "env_kwargs", None) or {})
    try:
        make_env(name, kwargs)
    except (PluginError, ImportError, ValueError) as e:
        errors.append(str(e))
    max_turns = getattr(r, "max_turns", 0)
    budget = getattr(r, "max_episode_tokens", 0)
    if max_turns < 1:
        errors.append(f"rollout.max_turns={max_turns} must be >= 1 (model turns per episode)")
    if budget < 1:
        errors.append(f"rollout.max_episode_tokens={budget} must be >= 1 (response tokens per episode)")
    elif budget >= r.max_model_len:
        errors.append(f"rollout.max_episode_tokens={budget} must be < rollout.max_model_len={r.max_model_len} "
                      f"(the first observation needs room too)")
    if r.max_new_tokens > budget >= 1:
        errors.append(f"rollout.max_new_tokens={r.max_new_tokens} (per turn) exceeds rollout.max_episode_tokens={budget}")
    estimator = getattr(getattr(cfg, "algo", None), "advantage_estimator", None)
    if estimator == "gae":
        errors.append(f"algo.advantage_estimator=gae does not apply to multi-turn episodes yet (rollout.env={name!r}): "
                      f"its per-token recursion would run through environment tokens; use a group estimator "
                      f"(grpo, dr_grpo, rloo, ...), which takes one reward per episode")
    gamma = getattr(getattr(cfg, "algo", None), "gamma", 1.0)
    if estimator == "reinforce_pp" and gamma is not None and gamma < 1.0:
        errors.append(f"algo.gamma={gamma} < 1 with algo.advantage_estimator=reinforce_pp does not apply to "
                      f"multi-turn episodes (rollout.env={name!r}): the discount would count environment tokens "
                      f"as steps; use algo.gamma=1")
    data = getattr(cfg, "data", None)
    if data is not None and getattr(data, "chat_template", True) is False:
        errors.append(f"data.chat_template=false: multi-turn episodes (rollout.env={name!r}) render turns through "
                      f"the chat template")
    if data is not None and getattr(data, "system_prompt", ""):
        errors.append(f"data.system_prompt is not used with rollout.env={name!r}: the environment writes the first "
                      f"observation (e.g. rollout.env_kwargs.system_prompt for calculator)")
    for key, allowed in _UNSUPPORTED.items():
        value = _get(cfg, key)
        if value is not None and value not in allowed:
            errors.append(f"{key}={value!r} does not apply to multi-turn episodes (rollout.env={name!r}); "
                          f"use {' | '.join(allowed)}")
    for key, why in _MUST_BE_OFF.items():
        if _get(cfg, key):
            errors.append(f"{key}=true does not apply to multi-turn episodes (rollout.env={name!r}): {why}; "
                          f"set {key}=false (agent/reward is the per-step episode reward)")
    for key, why in _MUST_BE_UNSET.items():
        if _get(cfg, key):
            errors.append(f"{key}={_get(cfg, key)!r} is not used with rollout.env={name!r}: {why}")
    return errors


def _get(cfg: Any, dotted: str) -> Any:
    """cfg's value at `a.b`, None where a section or field is missing (partial configs in tests)."""
    section, field = dotted.split(".")
    return getattr(getattr(cfg, section, None), field, None)
