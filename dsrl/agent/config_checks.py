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
    endpoint = bool(getattr(r, "agent_endpoint", False))
    if not name and not endpoint:
        if getattr(r, "agent", ""):
            return [f"rollout.agent={r.agent!r} is set but rollout.agent_endpoint=false: set "
                    f"rollout.agent_endpoint=true to train the agent through the endpoint"]
        return []
    errors: List[str] = []
    mode = "rollout.agent_endpoint=true" if endpoint else f"rollout.env={name!r}"
    if endpoint:
        errors += _endpoint_errors(cfg, name)
    else:
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
        errors.append(f"algo.advantage_estimator=gae does not apply to multi-turn episodes yet ({mode}): "
                      f"its per-token recursion would run through environment tokens; use a group estimator "
                      f"(grpo, dr_grpo, rloo, ...), which takes one reward per episode")
    gamma = getattr(getattr(cfg, "algo", None), "gamma", 1.0)
    if estimator == "reinforce_pp" and gamma is not None and gamma < 1.0:
        errors.append(f"algo.gamma={gamma} < 1 with algo.advantage_estimator=reinforce_pp does not apply to "
                      f"multi-turn episodes ({mode}): the discount would count environment tokens "
                      f"as steps; use algo.gamma=1")
    data = getattr(cfg, "data", None)
    if data is not None and getattr(data, "chat_template", True) is False:
        errors.append(f"data.chat_template=false: multi-turn episodes ({mode}) render turns through "
                      f"the chat template")
    if data is not None and getattr(data, "system_prompt", ""):
        errors.append(f"data.system_prompt is not used with {mode}: the environment writes the first "
                      f"observation (e.g. rollout.env_kwargs.system_prompt for calculator)")
    for key, allowed in _UNSUPPORTED.items():
        value = _get(cfg, key)
        if value is not None and value not in allowed:
            errors.append(f"{key}={value!r} does not apply to multi-turn episodes ({mode}); "
                          f"use {' | '.join(allowed)}")
    for key, why in _MUST_BE_OFF.items():
        if _get(cfg, key):
            errors.append(f"{key}=true does not apply to multi-turn episodes ({mode}): {why}; "
                          f"set {key}=false (agent/reward is the per-step episode reward)")
    for key, why in _MUST_BE_UNSET.items():
        if _get(cfg, key):
            errors.append(f"{key}={_get(cfg, key)!r} is not used with {mode}: {why}")
    return errors


def _endpoint_errors(cfg: Any, env: str) -> List[str]:
    """rollout.agent_endpoint=true: the agent function loads, calls per episode fit the seed
    spacing, and one optimizer step per rollout (an episode may train as several sequences, so a
    rollout's sample count is not known in advance)."""
    r, errors = cfg.rollout, []
    if env:
        errors.append(f"rollout.env={env!r} and rollout.agent_endpoint=true: choose one (the environment runs "
                      f"in dsrl, the endpoint's agent runs its own loop)")
    from dsrl.agent.endpoint.server import load_agent

    try:
        load_agent(getattr(r, "agent", ""))
    except (PluginError, ImportError) as e:
        errors.append(str(e))
    from dsrl.agent.endpoint.book import CALL_SEED_STRIDE

    if getattr(r, "max_turns", 0) > CALL_SEED_STRIDE:
        errors.append(f"rollout.max_turns={r.max_turns} (calls per episode) must be <= {CALL_SEED_STRIDE}")
    if getattr(r, "agent_timeout_s", 1.0) <= 0:
        errors.append(f"rollout.agent_timeout_s={r.agent_timeout_s} must be > 0 (seconds an agent may run)")
    if getattr(r, "agent_max_request_bytes", 1) < 1024:
        errors.append(f"rollout.agent_max_request_bytes={r.agent_max_request_bytes} must be >= 1024")
    from dsrl.agent.endpoint.book import FAILED_EPISODES

    failed = getattr(r, "failed_episodes", "zero")
    if failed not in FAILED_EPISODES:
        errors.append(f"rollout.failed_episodes={failed!r}: one of {' | '.join(FAILED_EPISODES)} (an episode whose "
                      f"agent crashed or timed out: reward 0, or left out of its group)")
    errors += _host_errors(getattr(r, "agent_host", "127.0.0.1"))
    errors += _tool_errors(getattr(r, "tool_parser", "hermes"), getattr(r, "tool_template", "auto"))
    estimator = getattr(getattr(cfg, "algo", None), "advantage_estimator", None)
    if estimator and estimator != "gae":  # gae: refused above for every multi-turn mode
        import dsrl.loss.advantages  # noqa: F401  (registers the built-in estimators)
        from dsrl.loss.registry import get_advantage_estimator

        try:
            fn = get_advantage_estimator(estimator)
        except Exception:  # unknown names: the loss validation reports them
            fn = None
        if fn is not None and not getattr(fn, "per_episode", False):
            errors.append(f"algo.advantage_estimator={estimator!r} does not declare per_episode = True: with "
                          f"rollout.agent_endpoint=true an episode may train as several sequences, and the group "
                          f"statistics must count it once (take episode_ids=, as dsrl.loss.advantages' estimators do)")
    if getattr(r, "temperature", 1.0) <= 0:
        errors.append(f"rollout.temperature={r.temperature} must be > 0 with rollout.agent_endpoint=true "
                      f"(training needs the sampled tokens' log-probs)")
    a = getattr(cfg, "algo", None)
    if a is not None:
        samples = a.rollout_batch_size * a.n_samples_per_prompt
        steps = a.num_steps_per_rollout if a.num_steps_per_rollout is not None else samples // max(a.global_batch_size, 1)
        if steps > 1 or a.global_batch_size != samples:
            errors.append(f"algo.global_batch_size={a.global_batch_size} must equal algo.rollout_batch_size * "
                          f"algo.n_samples_per_prompt={a.rollout_batch_size * a.n_samples_per_prompt} with "
                          f"rollout.agent_endpoint=true: one optimizer step per rollout (an episode whose agent "
                          f"rewrote its history trains as several sequences, so the sample count varies)")
    return errors


def _host_errors(host: Any) -> List[str]:
    """rollout.agent_host: an address (or a name) this host can bind."""
    import ipaddress
    import socket

    if not isinstance(host, str) or not host:
        return [f"rollout.agent_host={host!r} must be an address to bind (127.0.0.1, this host's address, 0.0.0.0)"]
    try:
        ipaddress.ip_address(host)
        return []
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        return [f"rollout.agent_host={host!r} does not resolve ({e}): give an address to bind"]
    return []


def _get(cfg: Any, dotted: str) -> Any:
    """cfg's value at `a.b`, None where a section or field is missing (partial configs in tests)."""
    section, field = dotted.split(".")
    return getattr(getattr(cfg, section, None), field, None)


def _tool_errors(parser: str, template: str) -> List[str]:
    """rollout.tool_parser names a registered parser; rollout.tool_template is a known choice or a
    .jinja file that exists (whether the model's own template takes tools is checked when the
    tokenizer loads)."""
    import os

    from dsrl.agent.endpoint.chat import TOOL_TEMPLATES
    from dsrl.agent.tool_parsers import TOOL_PARSERS

    errors = []
    if parser not in TOOL_PARSERS:
        errors.append(f"rollout.tool_parser={parser!r}: not one of {sorted(TOOL_PARSERS)}")
    if template not in ("auto", "model", *TOOL_TEMPLATES):
        if not template.endswith(".jinja"):
            errors.append(f"rollout.tool_template={template!r}: not auto, model, {', '.join(TOOL_TEMPLATES)} or a "
                          f".jinja file")
        elif not os.path.isfile(template):
            errors.append(f"rollout.tool_template={template!r}: no file {os.path.abspath(template)}")
    return errors
