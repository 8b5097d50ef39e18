"""Verifier registry. Every verifier has one signature:

    fn(completion_text: str, prompt: Prompt) -> float

and each prompt source names its default verifier (`source.default_verifier`)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dsrl.registry import Registry

Verifier = Callable[[str, Any], float]

VERIFIERS = Registry("verifier")
register_verifier = VERIFIERS.register


def _load_builtins() -> None:
    import dsrl.reward.verifiers  # noqa: F401


def verifier_names() -> list[str]:
    _load_builtins()
    return sorted(VERIFIERS)


def get_verifier(name: str) -> Verifier:
    _load_builtins()
    return VERIFIERS.get_or_raise(name)


def verifier_for_source(source: Any, override: Optional[str] = None) -> Verifier:
    """The verifier named by `override`, else the source's `default_verifier`."""
    name = override or getattr(source, "default_verifier", None)
    if not name:
        raise ValueError(f"prompt source {source!r} names no default verifier")
    return get_verifier(name)


def score(fn: Verifier, completions: Sequence[str], prompts: Sequence[Any]) -> list[float]:
    """Score completions against their prompts (same length, aligned)."""
    if len(completions) != len(prompts):
        raise ValueError(f"{len(completions)} completions vs {len(prompts)} prompts")
    return [float(fn(c, p)) for c, p in zip(completions, prompts)]
