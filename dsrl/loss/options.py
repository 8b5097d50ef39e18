"""Config lookup for the loss hub.

Objectives and estimators receive the algo config as a plain Mapping (the run's AlgoConfig as a
dict, possibly merged with a work unit's overrides), so a key may be absent. Every read falls
back to the typed schema's default, so the loss hub and `dsrl/config/schema.py` cannot disagree.
"""
from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Mapping, Optional

from dsrl.config.schema import AlgoConfig

# Keys the loss hub reads that the typed schema does not declare (advanced / plug-in knobs).
EXTRA_DEFAULTS: dict[str, Any] = {
    "gamma": 1.0,                 # reinforce_pp discount
    "tis_function": None,         # None = built-in "vanilla"; a registered name or a dotted path
    "use_unbiased_kl": False,     # KL loss times the IS ratio exp(lp - old)
    # MIS (masked importance sampling, see corrections.mis)
    "mis_level": "token",         # token | sequence | geometric
    "mis_mode": "truncate",       # truncate | clip | mask
    "mis_lower": 0.5,
    "mis_upper": 2.0,
    "mis_veto_threshold": 1e-4,   # None disables the per-token veto
    "mis_batch_normalize": True,
    "mis_rs_lower": None,         # optional rejection-sampling bounds (mask outside)
    "mis_rs_upper": None,
}


def _schema_defaults() -> dict[str, Any]:
    out = {}
    for f in fields(AlgoConfig):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


SCHEMA_DEFAULTS = _schema_defaults()


def opt(config: Optional[Mapping[str, Any]], key: str) -> Any:
    """`config[key]`, else the schema default, else the loss hub's extra default."""
    if config is not None and key in config:
        return config[key]
    if key in SCHEMA_DEFAULTS:
        return SCHEMA_DEFAULTS[key]
    if key in EXTRA_DEFAULTS:
        return EXTRA_DEFAULTS[key]
    raise KeyError(f"unknown loss config key {key!r}")


def clip_bounds(config: Optional[Mapping[str, Any]]) -> tuple[float, float]:
    """PPO ratio bounds (1 - eps_clip, 1 + eps_clip_high); eps_clip_high None = eps_clip."""
    lo = float(opt(config, "eps_clip"))
    hi = opt(config, "eps_clip_high")
    hi = lo if hi is None else float(hi)
    return 1.0 - lo, 1.0 + hi
