"""Name -> function registries. Adding an objective is one decorated function; the trainer
looks objectives up here and never branches on their names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from dsrl.loss.types import LossInputs, LossOutput
from dsrl.registry import Registry

Objective = Callable[[LossInputs], LossOutput]


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    fn: Objective
    # Per-work-unit config keys this objective accepts, with defaults (None = any algo key).
    config_defaults: Optional[Mapping[str, object]] = None
    # Keys of LossInputs.batch the objective needs.
    required_inputs: tuple = ()


OBJECTIVES = Registry("objective")
ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register


def register_objective(name: str, *, config_defaults: Optional[Mapping[str, object]] = None,
                       required_inputs: tuple = ()) -> Callable[[Objective], Objective]:
    def deco(fn: Objective) -> Objective:
        OBJECTIVES.add(name, ObjectiveSpec(name, fn, config_defaults, tuple(required_inputs)))
        return fn
    return deco


def get_objective(name: str) -> ObjectiveSpec:
    _load_builtins()
    return OBJECTIVES.get_or_raise(name)


def get_advantage_estimator(name: str) -> Callable:
    _load_builtins()
    return ADVANTAGE_ESTIMATORS.get_or_raise(name)


def _load_builtins() -> None:
    # Importing the topic modules runs their @register_* decorators.
    import dsrl.loss.objectives  # noqa: F401
    import dsrl.loss.advantages  # noqa: F401
    import dsrl.loss.tinker  # noqa: F401
