"""Environments by name (config key `rollout.env`): the shipped ones (dsrl.agent.envs, registered
when this module loads), any registered with `register_env`, or a dotted path to a class or
factory. The interface and the registry itself: dsrl.agent.env."""
from __future__ import annotations

from typing import Callable, Optional

import dsrl.agent.envs  # noqa: F401  (the shipped environments register on import)
from dsrl.agent.env import ENVS, Env
from dsrl.registry import PluginError


def env_names() -> list:
    return sorted(ENVS)


def resolve_env(name: str, key: str = "rollout.env") -> Callable[..., Env]:
    """The factory registered as `name`, else the class/factory at dotted path `name`; errors
    name `key`."""
    if not name:
        raise PluginError(f"{key} is empty: name an environment {env_names()} or a dotted path 'pkg.module.Class'")
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
