"""The loss hub: registries of objectives and advantage estimators, the DP-invariant
aggregation, the detach boundaries, and every built-in objective (native RL + Tinker).

Importing this package registers all built-ins."""
from dsrl.loss.registry import (  # noqa: F401
    ADVANTAGE_ESTIMATORS,
    OBJECTIVES,
    get_advantage_estimator,
    get_objective,
    register_advantage,
    register_objective,
)
from dsrl.loss.types import Aggregator, LossInputs, LossOutput  # noqa: F401
