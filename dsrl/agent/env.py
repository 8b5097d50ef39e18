"""The environment interface of multi-turn episodes, and its registry (config key `rollout.env`).

An environment is a small stateful object, one per episode:

    reset(prompt, seed) -> observation          the first observation (the episode's prompt)
    step(action_text)   -> StepResult           the model's turn -> next observation, reward, done

An observation is a list of chat messages ({"role", "content"}) or a plain string (one user
message). The episode runner (dsrl.agent.episodes) turns observations into token ids through the
chat template and never shows the environment anything but the decoded text of the model's turn.

`rollout.env` names a registered environment (`register_env`) or a dotted path
`pkg.module.attr` to a class or factory called as `factory(**rollout.env_kwargs)`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

from dsrl.registry import PluginError, Registry

Observation = Union[str, list]


@dataclass
class StepResult:
    observation: Observation  # what the environment answers (ignored when done)
    reward: float = 0.0  # reward of this turn; an episode's reward is the sum over its turns
    done: bool = False  # the episode is over (won, lost, answered ...)
    info: dict = field(default_factory=dict)  # free-form, kept in the trajectory (e.g. tool calls)


@runtime_checkable
class Env(Protocol):
    def reset(self, prompt: Any = None, seed: Optional[int] = None) -> Observation:
        """Start an episode: `prompt` is the data source's Prompt (None for self-contained
        games), `seed` makes the episode reproducible. Returns the first observation."""

    def step(self, action: str) -> StepResult:
        """The model's turn (decoded text, special tokens stripped) -> the environment's answer."""


def as_messages(observation: Observation, key: str = "observation") -> list:
    """An observation as a list of chat messages; a string becomes one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    msgs = [dict(m) for m in observation or []]
    for i, m in enumerate(msgs):
        if "role" not in m or "content" not in m:
            raise ValueError(f"{key}: message {i} needs 'role' and 'content': {m!r}")
    if not msgs:
        raise ValueError(f"{key}: empty observation")
    return msgs


def _as_factory(obj: Any, path: str) -> Callable[..., Env]:
    if not callable(obj):
        raise TypeError("an environment is a class or factory called as factory(**rollout.env_kwargs)")
    return obj


ENVS = Registry("environment", wrap=_as_factory)


def register_env(name: str) -> Callable[[Any], Any]:
    """Decorator: `@register_env("name")` on an Env class (or a factory returning one)."""
    return ENVS.register(name)


def env_names() -> list:
    _load_builtins()
    return sorted(ENVS)


def resolve_env(name: str, key: str = "rollout.env") -> Callable[..., Env]:
    """The factory registered as `name`, else the class/factory at dotted path `name`; errors
    name `key`."""
    if not name:
        raise PluginError(f"{key} is empty: name an environment {env_names()} or a dotted path 'pkg.module.Class'")
    _load_builtins()
    return ENVS.resolve(name, key)


def make_env(name: str, kwargs: Optional[dict] = None, key: str = "rollout.env") -> Env:
    """One fresh environment (one per episode). A factory that rejects `kwargs`, or returns an
    object without reset/step, is an error naming `key`."""
    factory = resolve_env(name, key)
    try:
        env = factory(**dict(kwargs or {}))
    except TypeError as e:
        raise PluginError(f"{key}={name!r}: cannot build it with rollout.env_kwargs={dict(kwargs or {})}: {e}") from e
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise PluginError(f"{key}={name!r}: {type(env).__name__} has no reset()/step(): not an environment")
    return env


_builtins_loaded = False


def _load_builtins() -> None:
    """Register the shipped environments (dsrl.agent.envs) on first use; this module imports none
    of them at import time (no import circle, no optional dependency loaded early)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        import dsrl.agent.envs  # noqa: F401  (registers on import)
