"""Name -> function registries. Adding an objective is one decorated function; the trainer
looks objectives up here and never branches on their names.

This module imports no objective: the built-ins register themselves when the package
`dsrl.loss` is imported (its __init__ imports them), which always happens before this module
runs. A config may also name an objective or an estimator by dotted path."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

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
    # Reads the old-policy log-probs (batch old_log_probs, or the reused training log-probs);
    # objectives that do not (sft, Tinker's sampler-ratio losses) need no old-policy pass.
    needs_old_log_probs: bool = False
    # A sample whose advantages are all zero contributes exactly zero loss gradient, so the
    # trainer may leave it out of the forward (it stays in the normalizers).
    skip_zero_advantage_exact: bool = False
    # Fixed reduction the objective applies itself ("sum" for Tinker's raw sums); None = the
    # run's algo.loss_agg_mode through LossInputs.reduce.
    aggregation: Optional[str] = None
    # Why the RL loop cannot drive this objective (None = it can).
    rl_loop_error: Optional[str] = None


def objective_from_callable(obj: Any, path: str) -> ObjectiveSpec:
    """The spec of an objective named by dotted path. Spec fields may be declared as attributes
    of the function (`fn.needs_old_log_probs = False`); undeclared ones take the conservative
    choice: the old-policy pass runs, zero-advantage samples are not skipped."""
    if isinstance(obj, ObjectiveSpec):
        return obj
    if not callable(obj):
        raise TypeError("an objective must be a function fn(LossInputs) -> LossOutput")
    return ObjectiveSpec(path, obj, getattr(obj, "config_defaults", None),
                         tuple(getattr(obj, "required_inputs", ())),
                         needs_old_log_probs=bool(getattr(obj, "needs_old_log_probs", True)),
                         skip_zero_advantage_exact=bool(getattr(obj, "skip_zero_advantage_exact", False)),
                         aggregation=getattr(obj, "aggregation", None),
                         rl_loop_error=getattr(obj, "rl_loop_error", None))


def _estimator_from_callable(obj: Any, path: str) -> Callable:
    if not callable(obj):
        raise TypeError("an advantage estimator must be a function "
                        "fn(rewards, mask, group_ids, config, kl) -> (advantages, returns)")
    return obj


OBJECTIVES = Registry("objective", wrap=objective_from_callable)
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", wrap=_estimator_from_callable)


def register_advantage(name: str, *, uses_kl_in_reward: bool = False) -> Callable[[Callable], Callable]:
    """Register an estimator. `uses_kl_in_reward`: it reads the per-token KL it is passed
    (algo.kl_coef folded into the reward); validation rejects kl_coef != 0 for the others, which
    would pay for a reference pass whose result is ignored. Stored as the function attribute
    `uses_kl_in_reward`, which a dotted-path estimator declares itself."""
    def deco(fn: Callable) -> Callable:
        fn.uses_kl_in_reward = bool(uses_kl_in_reward)
        ADVANTAGE_ESTIMATORS.add(name, fn)
        return fn
    return deco


def uses_kl_in_reward(estimator: Callable) -> bool:
    return bool(getattr(estimator, "uses_kl_in_reward", False))


def register_objective(name: str, *, config_defaults: Optional[Mapping[str, object]] = None,
                       required_inputs: tuple = (), needs_old_log_probs: bool = False,
                       skip_zero_advantage_exact: bool = False, aggregation: Optional[str] = None,
                       rl_loop_error: Optional[str] = None) -> Callable[[Objective], Objective]:
    def deco(fn: Objective) -> Objective:
        OBJECTIVES.add(name, ObjectiveSpec(name, fn, config_defaults, tuple(required_inputs),
                                           needs_old_log_probs=needs_old_log_probs,
                                           skip_zero_advantage_exact=skip_zero_advantage_exact,
                                           aggregation=aggregation, rl_loop_error=rl_loop_error))
        return fn
    return deco


def get_objective(name: str, key: str = "algo.policy_loss") -> ObjectiveSpec:
    """A registered objective, or one loaded from a dotted path; errors name `key`."""
    return OBJECTIVES.resolve(name, key)


def get_advantage_estimator(name: str, key: str = "algo.advantage_estimator") -> Callable:
    """A registered estimator, or one loaded from a dotted path; errors name `key`."""
    return ADVANTAGE_ESTIMATORS.resolve(name, key)
