"""LoRA on the RL actor (`actor.lora.rank > 0`): a PEFT adapter on the HF model before DeepSpeed
wraps it, so only the adapter's parameters train (ZeRO 0-3; the base weights are frozen and never
enter the optimizer).

What leaves the trainer:
- `adapter_state`: the adapter alone, in PEFT's file layout (what vLLM's LoRA loader and
  `PeftModel.from_pretrained` read); the rollout sync sends only this (dsrl.rollout.lora_sync).
- `merge_group`: the HF-named full weights with each adapter folded into its base weight
  (W + alpha/r * B @ A): the final HF folder, and the full weight sync for engines without LoRA
  support (the HF rollout worker, Ray engines).

Config checks run before anything heavy: ranges in `config_errors` (dsrl.validation.validate), the
target modules against the model's module names (`check_targets`, a meta-device model)."""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

PEFT_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's parameter names
ADAPTER = "default"  # the one adapter's name inside the PeftModel
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's file names (vLLM reads the same)
ADAPTER_CONFIG = "adapter_config.json"
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed max_lora_rank values
UNSUPPORTED_TARGETS = ("lm_head", "embed_tokens")  # not adaptable by vLLM's LoRA (and the head is tied)
_LORA_PARAM = re.compile(r"^(.*)\.lora_([AB])\." + ADAPTER + r"\.weight$")
_SAVED_LORA = re.compile(r"^(.*)\.lora_([AB])\.weight$")  # PEFT's saved names (no adapter name)


def lora_enabled(lora_cfg) -> bool:
    return lora_cfg is not None and int(lora_cfg.rank) > 0


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    for r in VLLM_MAX_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"actor.lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_MAX_RANKS[-1]}")


def config_errors(lora_cfg) -> List[str]:
    """Range checks of `actor.lora` (no model needed); [] when off or valid."""
    if lora_cfg is None or int(lora_cfg.rank) == 0:
        return []
    errors = []
    if not 0 < int(lora_cfg.rank) <= VLLM_MAX_RANKS[-1]:
        errors.append(f"actor.lora.rank={lora_cfg.rank} must be 0 (off) or in [1, {VLLM_MAX_RANKS[-1]}]")
    if not float(lora_cfg.alpha) > 0:
        errors.append(f"actor.lora.alpha={lora_cfg.alpha} must be > 0")
    if not 0 <= float(lora_cfg.dropout) < 1:
        errors.append(f"actor.lora.dropout={lora_cfg.dropout} must be in [0, 1)")
    targets = list(lora_cfg.target_modules or [])
    if not targets or not all(isinstance(t, str) and t for t in targets):
        errors.append(f"actor.lora.target_modules={targets} must be a non-empty list of module names")
    bad = [t for t in targets if isinstance(t, str) and t.split(".")[-1] in UNSUPPORTED_TARGETS]
    if bad:
        errors.append(f"actor.lora.target_modules: {bad} are not supported (vLLM's LoRA adapts the decoder's "
                      f"Linear layers only; the embedding / tied head cannot take an adapter)")
    return errors


def matched_modules(model: torch.nn.Module, targets: Sequence[str]) -> List[str]:
    """Linear modules PEFT would adapt for a list of target names: a module whose full name is
    a target or ends with "." + a target."""
    import torch

    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            out.append(name)
    return out


def _no_match_error(model: torch.nn.Module, targets: Sequence[str]) -> ValueError:
    import torch

    from dsrl.errors import ConfigError

    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return ConfigError(f"actor.lora.target_modules={list(targets)} matches no Linear layer of the model "
                       f"(its Linear layers are named: {leaves})")


def check_targets(lora_cfg, model_path: str) -> None:
    """Raise a ConfigError naming actor.lora.target_modules when it matches no Linear layer of the
    model: checked on a meta-device copy built from config.json (no weights loaded)."""
    if not lora_enabled(lora_cfg):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    if not matched_modules(model, list(lora_cfg.target_modules)):
        raise _no_match_error(model, list(lora_cfg.target_modules))


def apply_lora(model: torch.nn.Module, lora_cfg) -> torch.nn.Module:
    """Wrap `model` in a PEFT LoRA model: adapter A random, B zero (the start equals the base
    model exactly), every base parameter frozen."""
    import warnings

    from peft import LoraConfig, get_peft_model

    targets = list(lora_cfg.target_modules)
    if not matched_modules(model, targets):
        raise _no_match_error(model, targets)
    config = LoraConfig(r=int(lora_cfg.rank), lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                        target_modules=targets, bias="none", init_lora_weights=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    for name, p in peft_model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return peft_model


def scaling(module: torch.nn.Module) -> float:
    """alpha / rank of the adapter (PEFT's `scaling`)."""
    cfg = module.peft_config[ADAPTER]
    return float(cfg.lora_alpha) / float(cfg.r)


def hf_name(name: str) -> str:
    """A PEFT parameter name as the plain HF model names it."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def merge_group(tensors: Iterable[Tuple[str, torch.Tensor]], scale: float) -> List[Tuple[str, torch.Tensor]]:
    """One layer group of PEFT-named tensors -> HF-named tensors, each adapted weight replaced by
    W + scale * B @ A (computed in float32, cast back to W's dtype); the adapter tensors dropped.
    A group holds a layer's base weights and adapters together (dsrl.actor.engine._layer_groups)."""
    tensors = list(tensors)
    parts = {}
    for name, t in tensors:
        m = _LORA_PARAM.match(name)
        if m:
            parts.setdefault(m.group(1), {})[m.group(2)] = t
    out = []
    for name, t in tensors:
        if _LORA_PARAM.match(name):
            continue
        module = name[:-len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if module is not None and module in parts:
            t = merged_weight(t, parts[module]["A"], parts[module]["B"], scale)
        out.append((hf_name(name), t))
    return out


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A, computed in float32 on W's device and cast back to W's dtype: the one
    LoRA merge (the actor's layer groups, the service's pool and its sampler)."""
    import torch

    delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
    return (w.float() + scale * delta).to(w.dtype)


def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
                  scale: float) -> Dict[str, torch.Tensor]:
    """HF-named full weights: ``base`` (HF names) with each module that ``adapter`` (PEFT's saved
    names, "base_model.model.<module>.lora_A.weight") adapts replaced by its merged weight.
    KeyError naming the module if the base has no weight for it."""
    parts: Dict[str, dict] = {}
    for name, t in adapter.items():
        m = _SAVED_LORA.match(name)
        if m is None:
            raise ValueError(f"adapter tensor {name!r} is not a PEFT lora_A / lora_B weight")
        parts.setdefault(hf_name(m.group(1)), {})[m.group(2)] = t
    out = dict(base)
    for module, ab in parts.items():
        key = module + ".weight"
        if key not in out:
            raise KeyError(f"the adapter adapts {module!r}, which the base weights do not have")
        out[key] = merged_weight(out[key], ab["A"], ab["B"], scale)
    return out


def adapter_state(actor) -> dict:
    """The adapter's tensors on the CPU under PEFT's saved names (the adapter name dropped:
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"). Collective under ZeRO-3
    (the adapter parameters are gathered)."""
    named = [(n, p) for n, p in actor.module.named_parameters() if _LORA_PARAM.match(n)]
    if actor.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n.replace(f".{ADAPTER}.", "."): p.detach().to("cpu", copy=True).contiguous() for n, p in named}
    return {n.replace(f".{ADAPTER}.", "."): p.detach().to("cpu", copy=True).contiguous() for n, p in named}


def adapter_config_dict(module: torch.nn.Module, adapter: str = ADAPTER) -> dict:
    """Adapter ``adapter``'s PEFT config as saved in adapter_config.json."""
    cfg = module.peft_config[adapter].to_dict()
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    return cfg


def write_adapter(folder: str, state: dict, config: dict) -> int:
    """A PEFT adapter folder (adapter_model.safetensors + adapter_config.json); returns the
    weight bytes written."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, default=str)
    return sum(t.numel() * t.element_size() for t in state.values())


class AdapterOffReference:
    """The reference policy (KL) of a LoRA run without a second model: the actor's own engine
    scoring with its adapter disabled, i.e. the frozen base weights (saves a model copy; its
    log-probs equal a separate base-model engine's bit for bit, tests/actor/test_lora.py).
    Scoring only; the trainer calls it between steps, never inside a training forward."""

    role = "ref"
    trainable = False

    def __init__(self, actor):
        self.actor = actor
        self.hf_config = actor.hf_config
        self.temperature = actor.temperature

    def score(self, microbatches, *, progress=None) -> list:
        with self.actor.module.disable_adapter():
            return self.actor.score(microbatches, progress=progress)
