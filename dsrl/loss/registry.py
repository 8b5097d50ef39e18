"""Name -> function registries. Adding an objective is one decorated function; the trainer
looks objectives up here and never branches on their names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from dsrl.loss.types import LossInputs, LossOutput

Objective = Callable[[LossInputs], LossOutput]


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    fn: Objective
    # Per-work-unit config keys this objective accepts, with defaults (None = any algo key).
    config_defaults: Optional[Mapping[str, object]] = None
    # Keys of LossInputs.batch the objective needs.
    required_inputs: tuple = ()


OBJECTIVES: dict[str, ObjectiveSpec] = {}
ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}


def register_objective(name: str, *, config_defaults: Optional[Mapping[str, object]] = None,
                       required_inputs: tuple = ()) -> Callable[[Objective], Objective]:
    def deco(fn: Objective) -> Objective:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} registered twice")
        OBJECTIVES[name] = ObjectiveSpec(name, fn, config_defaults, tuple(required_inputs))
        return fn
    return deco


def register_advantage(name: str) -> Callable:
    def deco(fn: Callable) -> Callable:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return deco


def get_objective(name: str) -> ObjectiveSpec:
    _load_builtins()
    if name not in OBJECTIVES:
        raise KeyError(f"unknown objective {name!r}; registered: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def get_advantage_estimator(name: str) -> Callable:
    _load_builtins()
    if name not in ADVANTAGE_ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def _load_builtins() -> None:
    # Importing the topic modules runs their @register_* decorators.
    import dsrl.loss.objectives  # noqa: F401
    import dsrl.loss.advantages  # noqa: F401
    import dsrl.loss.tinker  # noqa: F401
