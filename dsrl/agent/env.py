"""The environment interface of multi-turn episodes, and its registry (config key `rollout.env`).

An environment is a small stateful object, one per episode:

    reset(prompt, seed) -> observation          the first observation (the episode's prompt)
    step(action_text)   -> StepResult           the model's turn -> next observation, reward, done

An observation is a list of chat messages ({"role", "content"}) or a plain string (one user
message). The episode runner (dsrl.agent.episodes) turns observations into token ids through the
chat template and never shows the environment anything but the decoded text of the model's turn.

`rollout.env` names a registered environment (`register_env`) or a dotted path
`pkg.module.attr` to a class or factory called as `factory(**rollout.env_kwargs)`; resolving a
name, with the shipped environments registered: dsrl.agent.environments."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

from dsrl.registry import Registry

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
