"""In-process Tinker work units on an ActorEngine: forward / forward_backward / optim_step with
Tinker's data shapes and semantics (tinker-protocol §1).

    sess = TrainingSession(engine, micro_batch_size=4)
    out = sess.forward_backward([Datum(tokens, {"target_tokens": ..., "weights": ...})], "cross_entropy")
    out.loss_fn_outputs[d]["logprobs"]   # (N,) float32 CPU, request order
    out.metrics["loss:sum"]              # raw sum over every token of every datum (all ranks)
    sess.optim_step(AdamParams(learning_rate=1e-4))

Semantics
* A datum is N input tokens x_0..x_{N-1} plus per-token ``loss_fn_inputs`` of length N; position i
  scores the *explicit* label ``target_tokens[i]`` from the logits after x_0..x_i (the label need
  not be x_{i+1}). Losses are raw sums over tokens and datums (see dsrl.loss.tinker).
* ``forward_backward`` adds ∇θ Σ_datums Σ_tokens ℓ to the accumulated gradient; several calls
  accumulate exactly until ``optim_step`` applies (AdamW) and clears it. ``forward`` computes the
  same outputs and metrics under no_grad and never touches the gradient.
* Validation happens before any forward: unknown loss_fn / loss_fn_config key, a missing
  required input, a per-token input whose length is not N, out-of-vocabulary or non-integer
  tokens and non-finite values raise ValueError naming the datum index and the key.

Data parallelism: the caller splits the request's datums across the DP ranks and passes each
rank *its own share* (any split, even an empty one); every rank must make the same sequence of
calls. Each rank gets back the outputs of its own datums (local request order); ``loss:sum`` is
all-reduced (SUM) so every rank reports the global value, and the parameter gradient is the
gradient of the global summed loss (the engine scales each rank's partial sum by the world size,
undoing DeepSpeed's averaging). Ranks with fewer microbatches run empty, zero-gradient
microbatches so that every rank enters the same number of ZeRO collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from dsrl.actor.batch import dense_rows, dense_tokens, empty_microbatch, rank_padding
from dsrl.distributed.collectives import all_reduce_
from dsrl.loss import tinker as tinker_losses
from dsrl.loss.registry import OBJECTIVES, ObjectiveSpec
from dsrl.loss.types import Reduction


@dataclass
class Datum:
    """One Tinker datum: ``model_input`` = N token ids (list, tensor, or an object with
    ``to_ints()``); ``loss_fn_inputs`` = per-token arrays of length N (lists, tensors, numpy, or
    objects with ``to_torch()``)."""

    model_input: Any
    loss_fn_inputs: dict = field(default_factory=dict)


@dataclass
class AdamParams:
    """Tinker's AdamParams: torch AdamW semantics (decoupled weight decay), global-norm clipping
    when ``grad_clip_norm`` > 0."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class ForwardBackwardOutput:
    loss_fn_outputs: list  # per datum {"logprobs": (N,) float32, "elementwise_loss": (N,) float32}
    metrics: dict  # {"loss:sum": float}


@dataclass
class OptimStepOutput:
    metrics: dict  # {"grad_norm:mean": global grad norm before clipping}


# ---------------------------------------------------------------------------------------------
def _to_tensor(value: Any) -> torch.Tensor:
    if hasattr(value, "to_torch"):
        value = value.to_torch()
    elif hasattr(value, "to_ints"):
        value = value.to_ints()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.as_tensor(value)


def _token_ids(value: Any, where: str, vocab: Optional[int]) -> torch.Tensor:
    try:
        t = _to_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: cannot read token ids ({e})") from None
    if t.dim() != 1:
        raise ValueError(f"{where}: must be 1-D, got shape {tuple(t.shape)}"
                         + (" (top-K targets are not supported)" if t.dim() == 2 else ""))
    if t.is_floating_point():
        if not bool(torch.isfinite(t).all()) or not bool((t == t.round()).all()):
            raise ValueError(f"{where}: token ids must be integers")
    elif t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{where}: token ids must be integers, got {t.dtype}")
    t = t.to(torch.long)
    if t.numel() and (int(t.min()) < 0 or (vocab is not None and int(t.max()) >= vocab)):
        raise ValueError(f"{where}: token id out of range [0, {vocab})")
    return t


def _floats(value: Any, where: str) -> torch.Tensor:
    try:
        t = _to_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: cannot read values ({e})") from None
    if t.dim() != 1:
        raise ValueError(f"{where}: must be 1-D, got shape {tuple(t.shape)}")
    t = t.to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: values must be finite")
    return t


def _batch_key(client_key: str) -> str:
    """LossInputs.batch key of a client loss_fn_inputs key (Tinker names mapped, others kept)."""
    return tinker_losses.BATCH_KEYS.get(client_key, client_key)


@dataclass
class _Prepared:
    tokens: torch.Tensor  # (N,) long
    inputs: dict  # client key -> (N,) tensor


class TrainingSession:
    """Tinker-style work units on one ActorEngine (see module docstring)."""

    def __init__(self, engine, micro_batch_size: int, *, pad_id: int = 0):
        if int(micro_batch_size) < 1:
            raise ValueError("micro_batch_size must be >= 1")
        self.engine = engine
        self.micro_batch_size = int(micro_batch_size)
        self.pad_id = int(pad_id)
        cfg = getattr(engine, "hf_config", None)
        self.vocab_size = int(cfg.vocab_size) if cfg is not None and getattr(cfg, "vocab_size", None) else None

    # ------------------------------------------------------------------ public API
    def forward(self, data: Sequence, loss_fn: str, loss_fn_config: Optional[Mapping] = None) -> ForwardBackwardOutput:
        return self._run(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(self, data: Sequence, loss_fn: str,
                         loss_fn_config: Optional[Mapping] = None) -> ForwardBackwardOutput:
        return self._run(data, loss_fn, loss_fn_config, forward_only=False)

    def optim_step(self, adam_params: Any = None) -> OptimStepOutput:
        """Apply the accumulated gradient with AdamW(adam_params) and clear it."""
        p = adam_params if adam_params is not None else AdamParams()
        if isinstance(p, Mapping):
            p = AdamParams(**p)
        clip = float(p.grad_clip_norm or 0.0)
        if clip < 0:
            raise ValueError("grad_clip_norm must be >= 0")
        self.engine.set_optimizer_hparams(lr=float(p.learning_rate), betas=(float(p.beta1), float(p.beta2)),
                                          eps=float(p.eps), weight_decay=float(p.weight_decay), grad_clip=clip)
        norm = self.engine.optimizer_step()
        return OptimStepOutput(metrics={"grad_norm:mean": float(norm)})

    # ------------------------------------------------------------------ internals
    def _objective(self, loss_fn: str) -> ObjectiveSpec:
        name = tinker_losses.tinker_objective_name(loss_fn)  # ValueError for unknown loss_fn
        return OBJECTIVES[name]

    def validate(self, data: Sequence, loss_fn: str, required: Optional[Sequence[str]] = None) -> list:
        """Check every datum before any forward; returns the prepared (tokens, inputs) list.
        ``required``: the loss_fn_inputs keys to read (default: the Tinker loss's own set; a
        server-side custom objective passes ``target_tokens`` plus the keys it declares)."""
        required = tinker_losses.REQUIRED_INPUTS[loss_fn] if required is None else tuple(required)
        out = []
        for i, d in enumerate(data):
            if isinstance(d, Mapping):
                model_input, lfi = d.get("model_input"), d.get("loss_fn_inputs")
            else:
                model_input, lfi = getattr(d, "model_input", None), getattr(d, "loss_fn_inputs", None)
            if model_input is None:
                raise ValueError(f"datum {i}: missing model_input")
            if not isinstance(lfi, Mapping):
                raise ValueError(f"datum {i}: loss_fn_inputs must be a dict")
            tokens = _token_ids(model_input, f"datum {i}: model_input", self.vocab_size)
            n = int(tokens.numel())
            if n == 0:
                raise ValueError(f"datum {i}: model_input is empty")
            inputs = {}
            for key in required:
                if key not in lfi or lfi[key] is None:
                    raise ValueError(f"datum {i}: loss_fn_inputs is missing required key {key!r} "
                                     f"for loss_fn {loss_fn!r}")
                where = f"datum {i}: loss_fn_inputs[{key!r}]"
                v = (_token_ids(lfi[key], where, self.vocab_size) if key == "target_tokens"
                     else _floats(lfi[key], where))
                if v.numel() != n:
                    raise ValueError(f"{where} has length {v.numel()}, expected {n} (= len(model_input))")
                inputs[key] = v
            out.append(_Prepared(tokens, inputs))
        return out

    def _collate(self, items: Sequence[_Prepared], indices: Sequence[int],
                 tags: Optional[Sequence[Any]] = None) -> dict:
        L = max(int(it.tokens.numel()) for it in items)
        # One trailing pad column: the engine drops the last logit, we need N of them.
        input_ids, attention_mask = dense_tokens([it.tokens for it in items], self.pad_id, L + 1)
        mb = {"input_ids": input_ids, "attention_mask": attention_mask,
              "targets": dense_rows([it.inputs["target_tokens"] for it in items], L, dtype=torch.long),
              "loss_mask": dense_rows([torch.ones(int(it.tokens.numel()), dtype=torch.float32) for it in items], L),
              "sample_indices": list(indices),
              "datum_lengths": [int(it.tokens.numel()) for it in items]}
        if tags is not None:
            mb["datum_tags"] = [tags[i] for i in indices]
        mb.update({_batch_key(k): dense_rows([it.inputs[k] for it in items], L)
                   for k in items[0].inputs if k != "target_tokens"})
        return mb

    def _run(self, data: Sequence, loss_fn: str, loss_fn_config: Optional[Mapping], *,
             forward_only: bool) -> ForwardBackwardOutput:
        spec = self._objective(loss_fn)
        config = tinker_losses.resolve_config(loss_fn, loss_fn_config)
        prepared = self.validate(list(data), loss_fn)
        return self.run_prepared(prepared, spec, config, forward_only=forward_only)

    def run_prepared(self, prepared: Sequence[_Prepared], spec: ObjectiveSpec, config: Mapping, *,
                     forward_only: bool, tags: Optional[Sequence[Any]] = None) -> ForwardBackwardOutput:
        """Run already validated datums (`validate`) through ``spec`` with a resolved ``config``.
        ``tags`` (one per datum) reach the engine as ``mb["datum_tags"]``: a multi-adapter
        engine reads which adapter scores each row from them."""
        prepared = list(prepared)
        pad_keys = list(spec.required_inputs)  # batch keys of an empty (DP padding) microbatch
        mbs = self.micro_batch_size
        chunks = [list(range(s, min(s + mbs, len(prepared)))) for s in range(0, len(prepared), mbs)]
        n_local = len(chunks)
        # Collated one at a time in the loop below. A request with no datum on any rank runs none.
        n_global = n_local + rank_padding(n_local, at_least=0)

        outputs: list = [None] * len(prepared)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for k in range(n_global):
            if k < n_local:
                idx = chunks[k]
                mb = self._collate([prepared[i] for i in idx], idx, tags)
            else:
                mb = empty_microbatch(self.pad_id, pad_keys)
                mb["datum_lengths"] = [1]
            out = self.engine.forward_backward(mb, spec, config, Reduction("sum"), is_last=False,
                                               forward_only=forward_only)
            if k >= n_local:
                continue
            loss_sum += out.metrics["loss:sum"].detach().to("cpu", torch.float64)
            for rec in out.per_datum:
                outputs[int(rec["sample_index"])] = tinker_losses.datum_output(rec)
        all_reduce_(loss_sum)  # the sum over ranks (a no-op on one)
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": float(loss_sum.item())})
