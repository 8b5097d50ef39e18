"""Multi-LoRA slots on one base model (PEFT): every LoRA training client is one named adapter of
a shared PEFT model, with its own AdamW parameter group (so its own optimizer state).

* Forward/backward: rows of several slots go through ONE forward. PEFT's mixed-adapter batches
  (``adapter_names=[slot per row]``) route each row through its own adapter only, so the raw-sum
  loss of slot A's rows reaches only A's adapter: clients never see each other's gradients.
  PEFT allows mixed batches only in eval mode; every dropout here is zero (LoRA dropout 0, the
  base model's as loaded for training), so eval and train forwards are the same function and
  autograd runs as usual.
* Optimizer step for K slots: ONE AdamW step over the pool. Each slot's gradient-norm clip is
  applied to its own gradients first (torch ``clip_grad_norm_`` semantics), the slots that are
  not stepping have their gradients set aside for the step and put back after it. Per slot this
  is exactly the update a single-slot step would make (AdamW updates each tensor on its own);
  there is one step call instead of K (the seed's O(KN) concern: no per-slot barrier).

`PoolEngine` gives the pool the engine contract of `ActorEngine.forward_backward` so that the
in-process Tinker work units (`TrainingSession`) drive it unchanged; the adapter of each row
comes from ``mb["datum_tags"]``."""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import torch

from dsrl.actor.device import to_device
from dsrl.actor.logprobs import token_logprobs
from dsrl.actor.work_units import AdamParams, TrainingSession
from dsrl.loss.types import LossInputs, LossOutput, Reduction
from dsrl.actor.lora import adapter_config_dict, merge_adapter, write_adapter

ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "adapter_optimizer.pt"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: Optional[int] = None

    def as_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "train_attn": self.train_attn, "train_mlp": self.train_mlp,
                "train_unembed": self.train_unembed, "seed": self.seed}


def linear_layers(model: torch.nn.Module) -> Dict[str, str]:
    """Full name -> kind of each Linear layer LoRA may adapt: ``attn`` (a parent module named
    *attn* / *attention*), ``mlp`` (*mlp* / *feed_forward* / *ffn*) or ``unembed`` (the head).
    Read from the bare base model, before any adapter wraps its layers."""
    head = model.get_output_embeddings()
    kinds = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        parents = name.split(".")[:-1]
        if mod is head:
            kinds[name] = "unembed"
        elif any("attn" in p or "attention" in p for p in parents):
            kinds[name] = "attn"
        elif any(p in ("mlp", "feed_forward", "ffn") for p in parents):
            kinds[name] = "mlp"
    return kinds


def target_modules(kinds: Mapping[str, str], spec: LoraSpec) -> List[str]:
    """The layers a client's LoRA config selects (train_attn / train_mlp / train_unembed)."""
    wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
    names = [name for name, kind in kinds.items() if wanted[kind]]
    if not names:
        raise ValueError("the LoRA config selects no layer of this model (train_attn/train_mlp/train_unembed)")
    return names


class LoraPool:
    """The base model, its adapters (one per slot) and one AdamW over all of them."""

    def __init__(self, model_path: str, *, dtype: torch.dtype, attn_implementation: str, micro_batch_size: int,
                 pad_id: int, device=None):
        """`device`: where the model and its adapters live and train (None: the accelerator's
        current device, cuda:N on a GPU machine, else the CPU)."""
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn_implementation)
        for p in base.parameters():
            p.requires_grad_(False)
        self.hf_config = base.config
        # Base weights by HF name (head included even when tied): merged exports start from these.
        self._base_state = {n: p.detach().clone() for n, p in base.named_parameters()}
        if "lm_head.weight" not in self._base_state and base.get_output_embeddings() is not None:
            self._base_state["lm_head.weight"] = base.get_output_embeddings().weight.detach().clone()
        self._base = base.to(_pool_device(device))  # the host copies above stay on the host (exports)
        self._layers = linear_layers(base)
        self.peft = None  # PeftModel, built with the first slot
        self.optimizer: Optional[torch.optim.AdamW] = None
        self.slots: Dict[str, LoraSpec] = {}
        self._params: Dict[str, Dict[str, torch.nn.Parameter]] = {}  # slot -> portable name -> param
        self._groups: Dict[str, dict] = {}
        self.engine = PoolEngine(self)
        self.session = TrainingSession(self.engine, micro_batch_size, pad_id=pad_id)

    @property
    def device(self) -> torch.device:
        """Where the pool's model lives (its microbatches are moved there)."""
        return (self.peft if self.peft is not None else self._base).device

    # ------------------------------------------------------------------ slots
    def add_slot(self, name: str, spec: LoraSpec) -> None:
        from peft import LoraConfig, get_peft_model

        if name in self.slots:
            raise ValueError(f"LoRA slot {name!r} exists")
        config = LoraConfig(r=int(spec.rank), lora_alpha=float(spec.alpha), lora_dropout=0.0, bias="none",
                            target_modules=target_modules(self._layers, spec), init_lora_weights=True)
        rng = torch.random.fork_rng(devices=[]) if spec.seed is not None else contextlib.nullcontext()
        with rng, warnings.catch_warnings():
            # PEFT warns that a LoRA on the head of a tied model unties it on merge: exports here
            # always write the head on its own (dsrl.hf_folder), so that is what we want.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            if spec.seed is not None:
                torch.manual_seed(int(spec.seed))
            if self.peft is None:
                self.peft = get_peft_model(self._base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        self.peft.eval()  # mixed-adapter batches need eval mode; every dropout is zero (module docstring)
        params = {}
        for full, p in self.peft.named_parameters():
            if f".{name}." in full and "lora_" in full:
                p.requires_grad_(True)
                params[full.replace(f".{name}.", ".")] = p
        self.slots[name] = spec
        self._params[name] = params
        self._all_slots_train()  # PEFT re-marks trainables when adding
        group = {"params": list(params.values()), "lr": 0.0}
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW([group], lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        else:
            self.optimizer.add_param_group(group)
        self._groups[name] = self.optimizer.param_groups[-1]

    def remove_slot(self, name: str) -> None:
        if name not in self.slots:
            return
        params = self._params.pop(name)
        ids = {id(p) for p in params.values()}
        for p in params.values():
            self.optimizer.state.pop(p, None)
        self.optimizer.param_groups[:] = [g for g in self.optimizer.param_groups
                                          if not any(id(p) in ids for p in g["params"])]
        self._groups.pop(name, None)
        self.slots.pop(name)
        if self.slots:
            with warnings.catch_warnings():  # "active adapter deleted": every forward names its adapters per row
                warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
                self.peft.delete_adapter(name)
            # Deleting the active adapter makes PEFT activate another and freeze the rest
            # (requires_grad=False): the other clients' next forward_backward would fail, or train
            # nothing in a merged batch. Every remaining slot trains.
            self._all_slots_train()
        else:
            # Last adapter gone: back to the bare base model (PEFT cannot delete its last adapter).
            self._base = self.peft.unload()
            self.peft = None
            self.optimizer = None

    def _all_slots_train(self) -> None:
        for slot_params in self._params.values():
            for p in slot_params.values():
                p.requires_grad_(True)

    def slot_parameters(self, name: str) -> Dict[str, torch.nn.Parameter]:
        return dict(self._params[name])

    # ------------------------------------------------------------------ optimizer
    def step(self, requests: Mapping[str, AdamParams]) -> Dict[str, Dict[str, float]]:
        """One optimizer step for the slots in ``requests`` (each with its own AdamW settings and
        grad clip); other slots' gradients and states are untouched. Returns per-slot metrics."""
        stepping = set(requests)
        aside = {}
        for name, params in self._params.items():
            if name not in stepping:
                for p in params.values():
                    aside[p] = p.grad
                    p.grad = None
        metrics = {}
        try:
            for name, adam in requests.items():
                g = self._groups[name]
                g["lr"] = float(adam.learning_rate)
                g["betas"] = (float(adam.beta1), float(adam.beta2))
                g["eps"] = float(adam.eps)
                g["weight_decay"] = float(adam.weight_decay)
                norm = _clip_(list(self._params[name].values()), float(adam.grad_clip_norm or 0.0))
                metrics[name] = {"grad_norm:mean": norm}
            self.optimizer.step()
        finally:
            for name in stepping:
                for p in self._params[name].values():
                    p.grad = None
            for p, grad in aside.items():
                p.grad = grad
        return metrics

    def gradient_snapshot(self, name: str) -> Dict[str, Optional[torch.Tensor]]:
        """A copy of slot ``name``'s accumulated gradient (None where a parameter has none)."""
        return {k: None if p.grad is None else p.grad.detach().clone() for k, p in self._params[name].items()}

    def restore_gradients(self, name: str, snapshot: Mapping[str, Optional[torch.Tensor]]) -> None:
        for k, p in self._params[name].items():
            p.grad = snapshot[k]

    # ------------------------------------------------------------------ state
    def save_slot(self, name: str, folder: Path, *, optimizer: bool = True) -> None:
        from safetensors.torch import save_file

        params = self._params[name]
        save_file({k: p.detach().to("cpu").contiguous() for k, p in params.items()}, str(folder / ADAPTER_FILE))
        if optimizer:
            state = {k: {sk: (sv.clone() if torch.is_tensor(sv) else sv)
                         for sk, sv in self.optimizer.state.get(p, {}).items()} for k, p in params.items()}
            torch.save(state, folder / OPTIMIZER_FILE)

    def load_slot(self, name: str, folder: Path, *, optimizer: bool) -> None:
        from safetensors.torch import load_file

        params = self._params[name]
        tensors = load_file(str(folder / ADAPTER_FILE))
        if set(tensors) != set(params):
            raise ValueError(f"adapter in {folder} does not match slot {name!r} "
                             f"({len(tensors)} tensors vs {len(params)}; different LoRA config?)")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(tensors[k])
        for p in params.values():
            p.grad = None
            self.optimizer.state.pop(p, None)
        if optimizer:
            state = torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location=self.device)
            for k, p in params.items():
                if state.get(k):
                    self.optimizer.state[p] = {sk: (sv.clone() if torch.is_tensor(sv) else sv)
                                               for sk, sv in state[k].items()}

    def adapter_state(self, name: str) -> Dict[str, torch.Tensor]:
        """Slot ``name``'s adapter on the host, in PEFT's saved names."""
        return {k: p.detach().to("cpu").contiguous() for k, p in self._params[name].items()}

    def adapter_config(self, name: str) -> dict:
        """Slot ``name``'s adapter_config.json (PEFT's; base_model_name_or_path: the base folder)."""
        cfg = adapter_config_dict(self.peft, name)
        cfg["base_model_name_or_path"] = self.model_path
        return cfg

    def merged_state(self, name: str) -> Dict[str, torch.Tensor]:
        """Base weights + this slot's LoRA deltas, HF names (head included), on the host."""
        spec = self.slots[name]
        return merge_adapter(self._base_state, self.adapter_state(name), float(spec.alpha) / float(spec.rank))

    def export_sampler(self, name: str, folder: Path) -> None:
        """The adapter alone, as a PEFT folder (adapter_model.safetensors + adapter_config.json):
        what ``PeftModel.from_pretrained(base, folder)`` loads and the sampler merges in memory."""
        write_adapter(str(folder), self.adapter_state(name), self.adapter_config(name))


def _pool_device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")


def _clip_(params: List[torch.nn.Parameter], max_norm: float) -> float:
    """Global-norm clip of these parameters' gradients (torch.nn.utils.clip_grad_norm_
    semantics: scale by max_norm / (norm + 1e-6) when that is below 1). Returns the norm before."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
    if max_norm > 0:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)
    return float(norm)


class PoolEngine:
    """`ActorEngine.forward_backward`'s contract on the LoRA pool (plain autograd: gradients add
    up in the adapters' ``.grad`` until the pool's step)."""

    def __init__(self, pool: LoraPool):
        self.pool = pool

    @property
    def hf_config(self):
        return self.pool.hf_config

    def forward_backward(self, mb: Mapping, objective, config: Mapping, reduction: Reduction, *,
                         is_last: bool = True, forward_only: bool = False, **_) -> LossOutput:
        names = mb.get("datum_tags")
        if names is None or len(names) != mb["input_ids"].shape[0]:
            raise ValueError("a LoRA pool microbatch needs one adapter name per row (mb['datum_tags'])")
        mb = to_device(mb, self.pool.device)  # host -> the pool's device; the reducer is built there
        reduce = reduction.build(mb["loss_mask"])
        ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with ctx:
            out = self.pool.peft(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False,
                                 adapter_names=list(names))
            lp, _ = token_logprobs(out.logits[:, :-1], mb["targets"])
            fixed = {k: v for k, v in mb.items() if k not in ("input_ids", "attention_mask", "targets")}
            res = objective.fn(LossInputs(log_probs=lp, mask=mb["loss_mask"], batch=fixed, config=config,
                                          reduce=reduce, sample_indices=mb.get("sample_indices")))
        if not forward_only:
            res.loss.backward()
        return res


class LoraSlot:
    """One LoRA training client: a named adapter of the pool."""

    is_lora = True

    def __init__(self, model_id: str, pool: LoraPool, name: str, spec: LoraSpec):
        self.model_id = model_id
        self.pool = pool
        self.tag = name
        self.spec = spec
        self.lora_rank = spec.rank
        self.lora_config = spec.as_dict()
        self.session = pool.session
        self.group_key = ("lora", id(pool))  # all slots of the pool may share a forward and a step

    @property
    def hf_config(self):
        return self.pool.hf_config

    def optim_step(self, params: AdamParams) -> Dict[str, float]:
        return self.pool.step({self.tag: params})[self.tag]

    def gradient_snapshot(self):
        return self.pool.gradient_snapshot(self.tag)

    def restore_gradients(self, snapshot) -> None:
        self.pool.restore_gradients(self.tag, snapshot)

    def save_state(self, folder: Path, *, optimizer: bool = True) -> None:
        self.pool.save_slot(self.tag, folder, optimizer=optimizer)

    def load_state(self, folder: Path, *, optimizer: bool) -> None:
        self.pool.load_slot(self.tag, folder, optimizer=optimizer)

    def export_sampler(self, folder: Path) -> None:
        self.pool.export_sampler(self.tag, folder)

    def release(self) -> None:
        self.pool.remove_slot(self.tag)
