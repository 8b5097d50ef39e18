"""Data types shared by every objective. Per-token tensors are [B, L], aligned with the
*target* positions: column t holds the score of token t+1 of the packed sequence (the token
that logits at position t predict). Fixed scores are zero where the loss mask is zero."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum")


@dataclass
class Aggregator:
    """Reduces a per-token tensor to a scalar *partial sum*.

    Each sequence b gets a weight `seq_weight[b]` computed from global counts (all ranks, all
    microbatches of the optimizer step), so summing the partial sums of every microbatch on
    every rank gives the global aggregate whatever the sharding. Modes:
      token-mean               w_b = 1 / (global masked tokens)
      seq-mean-token-sum       w_b = 1 / (global sequences)
      seq-mean-token-mean      w_b = 1 / (global sequences * tokens_b)
      seq-mean-token-sum-norm  w_b = 1 / (global sequences * norm_len)
      sum                      w_b = 1  (raw sums; Tinker objectives)
    """

    mask: torch.Tensor  # [B, L] float
    seq_weight: torch.Tensor  # [B] float

    def __call__(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        m = self.mask if mask is None else mask
        per_seq = (x * m).sum(dim=-1)
        return (per_seq * self.seq_weight.to(per_seq.dtype)).sum()

    @staticmethod
    def build(mode: str, mask: torch.Tensor, *, global_tokens: float = 0.0, global_seqs: float = 0.0,
              norm_len: float = 0.0) -> "Aggregator":
        mask = mask.float()
        b = mask.shape[0]
        if mode == "sum":
            w = torch.ones(b)
        elif mode == "token-mean":
            w = torch.full((b,), 1.0 / max(global_tokens, 1.0))
        elif mode == "seq-mean-token-sum":
            w = torch.full((b,), 1.0 / max(global_seqs, 1.0))
        elif mode == "seq-mean-token-mean":
            w = 1.0 / (max(global_seqs, 1.0) * mask.sum(-1).clamp(min=1.0))
        elif mode == "seq-mean-token-sum-norm":
            if norm_len <= 0:
                raise ValueError("seq-mean-token-sum-norm needs norm_len > 0")
            w = torch.full((b,), 1.0 / (max(global_seqs, 1.0) * norm_len))
        else:
            raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {AGG_MODES}")
        return Aggregator(mask=mask, seq_weight=w.to(mask.device))  # one place builds it: on the mask's device


@dataclass(frozen=True)
class Reduction:
    """What an engine needs to build a microbatch's `Aggregator`: the mode and the step's global
    counts (all ranks, all microbatches). Callers hand engines this, never a reducer: the engine
    builds the `Aggregator` from the microbatch's loss mask once that mask is on its device, so
    the reducer's tensors live where the objective's do (a host mask under CUDA is a crash)."""

    mode: str
    global_tokens: float = 0.0
    global_seqs: float = 0.0
    norm_len: float = 0.0

    def build(self, mask: torch.Tensor) -> Aggregator:
        return Aggregator.build(self.mode, mask, global_tokens=self.global_tokens, global_seqs=self.global_seqs,
                                norm_len=self.norm_len)


@dataclass
class LossInputs:
    """Everything an objective may read. Only `log_probs` (and `entropy` when weighted) carry
    gradient; objectives must treat every tensor in `batch` as a fixed score."""

    log_probs: torch.Tensor  # [B, L] current-policy log-prob of each target token (with grad)
    mask: torch.Tensor  # [B, L] float loss mask
    batch: Mapping[str, Any]  # fixed per-token scores and per-datum inputs (see keys below)
    config: Mapping[str, Any]  # objective config: the run's algo config merged with unit overrides
    reduce: Aggregator  # DP/microbatch-invariant reducer
    entropy: Optional[torch.Tensor] = None  # [B, L] token entropy of the (tempered) policy
    # Old policy = detached `log_probs` (training log-prob reuse, single optimizer step).
    reuse_training_logprobs: bool = False
    # Global sample index of each row (Tinker per-datum outputs).
    sample_indices: Optional[list] = None


# Keys of LossInputs.batch used by the built-in objectives (all [B, L] unless noted):
#   advantages, old_log_probs, rollout_log_probs, ref_log_probs, teacher_log_probs,
#   opd_reverse_kl, loss_weights (Tinker CE), sampling_logprobs (Tinker q)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar partial sum (see Aggregator)
    metrics: dict = field(default_factory=dict)  # name -> scalar tensor partial sum (detached)
    per_datum: Optional[list] = None  # Tinker work units: [{sample_index, logprobs, loss}] on CPU
