"""The loss hub: registries of objectives and advantage estimators, the DP-invariant
aggregation, the detach boundaries, and every built-in objective (native RL + Tinker).

Importing this package registers all built-ins: the plug-in modules are imported here, after
the registry, so `dsrl.loss.registry` never imports them (no import circle) and yet every
lookup through it finds them (importing a submodule imports this package first)."""
from dsrl.loss.registry import (  # noqa: F401
    ADVANTAGE_ESTIMATORS,
    OBJECTIVES,
    ObjectiveSpec,
    get_advantage_estimator,
    get_objective,
    register_advantage,
    register_objective,
    uses_kl_in_reward,
)
from dsrl.loss.types import Aggregator, LossInputs, LossOutput, Reduction  # noqa: F401

# Built-in plug-ins: each registers itself on import.
from dsrl.loss import objectives, advantages, tinker  # noqa: F401,E402  (isort: skip)
