"""Find what makes a model's training forward stochastic, by name, so that log-prob reuse can
refuse it (see dsrl/validation/reuse.py).

Reuse is exact only if the training forward (train mode) equals the old-policy pass (eval
mode). Dropout, stochastic depth, MoE router jitter and injected noise all break that, and
the model may carry them under any name (GPT-2's `attn_pdrop`, `activation_dropout`,
`router_jitter_noise`, ...). Instead of a fixed list of known names, both scans apply one
naming rule:

    a name is *stochastic* when, lower-cased, it contains "drop", "jitter" or "noise";
    it *blocks* reuse when its value is a number (int or float, not bool) other than 0,
    or a list/tuple holding such a number.

So `attn_pdrop=0.1`, `layerdrop=0.05`, `drop_path_rate=0.1`, `router_jitter_noise=0.01` block;
`dropout=0.0`, `classifier_dropout=None` and flags such as `use_noise_free_x=False` (a bool's
meaning depends on its wording, and the module scan catches the live layers either way) do not.
A number whose name merely contains the word (e.g. a hypothetical `noise_seed=3`) blocks too:
fail-closed, the user clears it. Randomness hard-coded in a forward without a named attribute
cannot be seen here."""
from __future__ import annotations

import numbers
from typing import Any, Iterator, List, Tuple

import torch

from dsrl.errors import ConfigError

STOCHASTIC_WORDS = ("drop", "jitter", "noise")

# dsrl's own dropout knobs (model.<knob>) and the one HF config field each sets.
DROPOUT_KNOBS = ("attention_dropout", "hidden_dropout")


def is_stochastic_name(name: str) -> bool:
    low = name.lower()
    return any(word in low for word in STOCHASTIC_WORDS)


def _blocking_value(value: Any) -> bool:
    """A non-zero number (bools excluded), or a list/tuple holding one."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Number):
        return value != 0
    if isinstance(value, (list, tuple)):
        return any(_blocking_value(v) for v in value)
    return False


def _config_items(obj: Any, prefix: str, seen: set) -> Iterator[Tuple[str, Any]]:
    """(dotted name, value) of every public field, recursing into sub-configs and dicts."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    items = obj.items() if isinstance(obj, dict) else vars(obj).items()
    for key, value in items:
        key = str(key)
        if key.startswith("_"):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict) or _is_hf_config(value):
            yield from _config_items(value, name + ".", seen)
        else:
            yield name, value


def _is_hf_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def stochastic_config_fields(hf_config: Any) -> List[str]:
    """Every field of an HF config (nested sub-configs and dicts included, dotted) whose name
    is stochastic and whose value blocks, as "name=value"."""
    return [f"{name}={value}" for name, value in _config_items(hf_config, "", set())
            if is_stochastic_name(name.rsplit(".", 1)[-1]) and _blocking_value(value)]


def _findings(qual: str, mod: torch.nn.Module) -> List[str]:
    """What in `mod` itself (not its children) makes a forward random, as labels."""
    label, kind = qual or "<root>", type(mod).__name__
    if isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0:
        return [f"{label} ({kind} p={mod.p})"]
    return [f"{label} ({kind} {attr}={value})" for attr, value in vars(mod).items()
            if not attr.startswith("_") and is_stochastic_name(attr) and _blocking_value(value)]


def stochastic_modules(module: torch.nn.Module) -> List[str]:
    """Every submodule that is a torch dropout layer with p > 0, or that holds a public numeric
    attribute with a stochastic name and a blocking value (e.g. Llama's `attention_dropout`,
    Mixtral's `jitter_noise`), as "qualified.name (Type p=...)" / "(Type attr=...)"."""
    return [f for qual, mod in module.named_modules() for f in _findings(qual, mod)]


def live_stochastic_modules(module: torch.nn.Module) -> List[str]:
    """`stochastic_modules` restricted to submodules in train mode: what makes *this* forward
    random (an eval-mode dropout layer is the identity)."""
    return [f for qual, mod in module.named_modules() if mod.training for f in _findings(qual, mod)]


def apply_dropout_knobs(hf_config: Any, *, attention_dropout: float, hidden_dropout: float) -> List[str]:
    """Set dsrl's `model.attention_dropout` / `model.hidden_dropout` on the HF config field of
    the same name (top level and sub-configs that have it) and nothing else: a model's other
    stochastic fields (attn_pdrop, ...) stay as its config says and block reuse by name. A
    non-zero knob the model has no field for raises ConfigError instead of being ignored.
    Returns the fields set, as "name=value"."""
    knobs = {"attention_dropout": float(attention_dropout), "hidden_dropout": float(hidden_dropout)}
    configs = [("", hf_config)] + [(p, c) for p, c in _sub_configs(hf_config, "", set())]
    applied = []
    for knob, value in knobs.items():
        hits = [(prefix, c) for prefix, c in configs if knob in vars(c)]
        if not hits and value != 0:
            raise ConfigError(
                f"model.{knob}={value}: the model config ({type(hf_config).__name__}) has no field "
                f"{knob!r}, so the knob would do nothing; set model.{knob}=0 (the model's own "
                f"dropout fields are read from its config.json)")
        for prefix, c in hits:
            setattr(c, knob, value)
            applied.append(f"{prefix}{knob}={value}")
    return applied


def _sub_configs(obj: Any, prefix: str, seen: set) -> Iterator[Tuple[str, Any]]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for key, value in vars(obj).items():
        if not key.startswith("_") and _is_hf_config(value):
            yield f"{prefix}{key}.", value
            yield from _sub_configs(value, f"{prefix}{key}.", seen)
