"""Config lookup for the loss hub.

Objectives and estimators receive the algo config as a plain Mapping (the run's AlgoConfig as a
dict, possibly merged with a work unit's overrides), so a key may be absent. Every read falls
back to the typed schema's default, so the loss hub and `dsrl/config/schema.py` cannot disagree.
"""
from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Mapping, Optional

from dsrl.config.schema import AlgoConfig

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
    """`config[key]`, else the typed schema's default."""
    if config is not None and key in config:
        return config[key]
    if key in SCHEMA_DEFAULTS:
        return SCHEMA_DEFAULTS[key]
    raise KeyError(f"unknown loss config key {key!r}")


def clip_bounds(config: Optional[Mapping[str, Any]]) -> tuple[float, float]:
    """PPO ratio bounds (1 - eps_clip, 1 + eps_clip_high); eps_clip_high None = eps_clip."""
    lo = float(opt(config, "eps_clip"))
    hi = opt(config, "eps_clip_high")
    hi = lo if hi is None else float(hi)
    return 1.0 - lo, 1.0 + hi


def objective_config(spec, algo: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """The config an objective receives. Objectives with their own `config_defaults` (Tinker's)
    get exactly those keys, overridden by `overrides`; the others get the run's algo config with
    `overrides` on top. KeyError names unknown override keys."""
    valid = algo if spec.config_defaults is None else spec.config_defaults
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        where = "algo.* names" if spec.config_defaults is None else f"{spec.name} accepts {sorted(valid)}"
        raise KeyError(f"unknown loss_fn_config key(s) {unknown} (valid: {where})")
    return {**valid, **overrides}
