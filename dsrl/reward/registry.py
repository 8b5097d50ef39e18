"""Verifier registry. Every verifier has one signature:

    fn(completion_text: str, prompt: Prompt) -> float

and each prompt source names its default verifier (`source.default_verifier`); config key
`reward.fn` overrides it. A name is a registered verifier or a dotted path to a function.

The built-in verifiers register themselves when the package `dsrl.reward` is imported (its
__init__ imports them); this module imports none of them."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dsrl.registry import PluginError, Registry

Verifier = Callable[[str, Any], float]

def _as_verifier(obj: Any, path: str) -> Verifier:
    if not callable(obj):
        raise TypeError("a verifier must be a function fn(completion_text, prompt) -> float")
    return obj


VERIFIERS = Registry("verifier", wrap=_as_verifier)
register_verifier = VERIFIERS.register


def verifier_names() -> list[str]:
    return sorted(VERIFIERS)


def get_verifier(name: str, key: str = "reward.fn") -> Verifier:
    """A registered verifier, or a function loaded from a dotted path; errors name `key`."""
    return VERIFIERS.resolve(name, key)


def verifier_for_source(source: Any, override: Optional[str] = None) -> Verifier:
    """The verifier named by `override` (config key reward.fn), else the source's
    `default_verifier`."""
    if override:
        return get_verifier(override, "reward.fn")
    name = getattr(source, "default_verifier", None)
    if not name:
        raise PluginError(f"reward.fn: prompt source {source!r} names no default verifier; set reward.fn to one "
                          f"of {verifier_names()} or a dotted path 'pkg.module.fn'")
    return get_verifier(name, f"{type(source).__name__}.default_verifier")


def build_verifier(reward_cfg: Any, source: Any) -> Verifier:
    """The run's verifier: the reward server at `reward.url`, else `reward.fn`, else the
    source's default."""
    if getattr(reward_cfg, "url", None):
        from dsrl.reward.http import RemoteReward

        return RemoteReward(reward_cfg.url, timeout_s=reward_cfg.timeout_s, retries=reward_cfg.retries)
    return verifier_for_source(source, reward_cfg.fn)


def score(fn: Verifier, completions: Sequence[str], prompts: Sequence[Any]) -> list[float]:
    """Score completions against their prompts (same length, aligned)."""
    if len(completions) != len(prompts):
        raise ValueError(f"{len(completions)} completions vs {len(prompts)} prompts")
    return [float(fn(c, p)) for c, p in zip(completions, prompts)]
