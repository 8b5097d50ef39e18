"""Which objective a forward/forward_backward request runs.

* The five Tinker losses by name (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``,
  ``dro``) from the loss hub, with their ``loss_fn_config`` checked there (unknown keys rejected).
* ``loss_fn="custom"`` with ``loss_fn_config={"loss_id": NAME, ...}``: a server-side objective
  that the operator registered by dotted path (``serve.custom_losses: {NAME: pkg.mod.fn}``). It
  runs on the log-probs of the same forward (one pass, unlike the SDK's client-side
  ``forward_backward_custom``, which needs a forward and then a cross-entropy backward). The
  function takes `LossInputs` and returns a `LossOutput` or a scalar loss tensor; it may declare
  ``required_inputs`` (extra per-token loss_fn_inputs keys, read under the same names) and
  ``config_defaults`` (the only accepted config keys besides ``loss_id``).

Every problem is a `UserError` naming the loss or the key."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from dsrl.loss import tinker as tinker_losses
from dsrl.loss.registry import OBJECTIVES, ObjectiveSpec
from dsrl.loss.types import LossInputs, LossOutput
from dsrl.registry import PluginError, load_callable
from dsrl.serve.errors import UserError


@dataclass(frozen=True)
class ResolvedObjective:
    spec: ObjectiveSpec
    config: Mapping[str, Any]
    required: Tuple[str, ...]  # loss_fn_inputs keys every datum must carry
    merge_key: Optional[tuple]  # requests with equal keys may share one forward; None: never merged


def _freeze(config: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in config.items()))


class ObjectiveTable:
    """Resolves (loss_fn, loss_fn_config) of a request; custom losses are loaded once, at start."""

    def __init__(self, custom_losses: Optional[Mapping[str, str]] = None):
        self.custom: Dict[str, ObjectiveSpec] = {}
        for name, path in dict(custom_losses or {}).items():
            try:
                fn = load_callable(str(path), f"serve.custom_losses.{name}")
            except PluginError as e:
                raise ValueError(str(e)) from e
            self.custom[str(name)] = _custom_spec(str(name), fn)

    def supported(self) -> list:
        out = list(tinker_losses.TINKER_LOSS_FNS)
        if self.custom:
            out.append(f"custom (loss_id one of {sorted(self.custom)})")
        return out

    def resolve(self, loss_fn: str, loss_fn_config: Optional[Mapping[str, Any]]) -> ResolvedObjective:
        cfg = dict(loss_fn_config or {})
        if loss_fn in tinker_losses.TINKER_LOSS_FNS:
            try:
                config = tinker_losses.resolve_config(loss_fn, cfg)
            except ValueError as e:
                raise UserError(str(e)) from None
            spec = OBJECTIVES[tinker_losses.tinker_objective_name(loss_fn)]
            return ResolvedObjective(spec, config, tuple(tinker_losses.REQUIRED_INPUTS[loss_fn]),
                                     ("tinker", loss_fn, _freeze(config)))
        if loss_fn == "custom":
            return self._resolve_custom(cfg)
        raise UserError(tinker_losses.unsupported_message(loss_fn, self.supported()))

    def _resolve_custom(self, cfg: Dict[str, Any]) -> ResolvedObjective:
        loss_id = cfg.pop("loss_id", None)
        if not self.custom:
            raise UserError("loss_fn 'custom': this server has no server-side custom losses "
                            "(serve.custom_losses is empty)")
        if loss_id not in self.custom:
            raise UserError(f"loss_fn 'custom': loss_fn_config['loss_id']={loss_id!r} is not one of "
                            f"{sorted(self.custom)}")
        spec = self.custom[loss_id]
        defaults = dict(spec.config_defaults or {})
        config = dict(defaults)
        for key, value in cfg.items():
            if key not in defaults:
                raise UserError(f"unknown loss_fn_config key {key!r} for custom loss {loss_id!r} "
                                f"(accepted keys: {sorted(defaults) or 'none'} besides loss_id)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
                raise UserError(f"loss_fn_config[{key!r}] for custom loss {loss_id!r} must be a finite number")
            config[key] = float(value)
        required = ("target_tokens",) + tuple(spec.required_inputs)
        # A custom loss reports its own loss:sum; requests are not merged (its sum is not per datum).
        return ResolvedObjective(spec, config, required, None)


def _custom_spec(name: str, fn) -> ObjectiveSpec:
    required = tuple(getattr(fn, "required_inputs", ()))
    if "target_tokens" in required:
        required = tuple(k for k in required if k != "target_tokens")

    def run(inputs: LossInputs) -> LossOutput:
        out = fn(inputs)
        if isinstance(out, torch.Tensor):
            out = LossOutput(loss=out, metrics={})
        if not isinstance(out, LossOutput) or not isinstance(out.loss, torch.Tensor) or out.loss.dim() != 0:
            raise TypeError(f"custom loss {name!r} must return a scalar tensor or a LossOutput with a scalar loss")
        metrics = dict(out.metrics or {})
        metrics.setdefault("loss:sum", out.loss.detach())
        per_datum = out.per_datum
        if per_datum is None:
            per_datum = tinker_losses.datum_records(inputs, logprobs=inputs.log_probs)  # each row's target log-probs
        return LossOutput(loss=out.loss, metrics=metrics, per_datum=per_datum)

    return ObjectiveSpec(f"custom:{name}", run, getattr(fn, "config_defaults", None) or {}, required,
                         aggregation="sum")

