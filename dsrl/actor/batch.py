"""Rollout samples and their packing into dense, right-padded training microbatches.

Per-token fields are [B, T-1] and aligned with *targets*: column t scores token t+1 of the
row (the token the logits at position t predict). Response token k of a sample with prompt
length P therefore sits at column P-1+k."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dsrl.actor.masks import response_loss_mask
from dsrl.distributed.collectives import all_reduce_max


@dataclass
class Sample:
    prompt_ids: list  # token ids of the (templated) prompt
    response_ids: list  # sampled completion token ids (an episode: model and environment tokens)
    rollout_log_probs: list  # sampling log-prob of each response token (from vLLM; 0.0 on env tokens)
    group: int  # prompt index within the step (GRPO group id)
    index: int = 0  # global sample index within the step
    reward: float = 0.0
    finish_reason: str = ""
    text: str = ""  # decoded completion
    extra: dict = field(default_factory=dict)  # an episode's extra["model_mask"] is its loss mask


def collate(samples: Sequence[Sample], pad_id: int, token_fields: Optional[dict] = None) -> dict:
    """Pack samples into one microbatch dict of tensors.

    token_fields: name -> list (one per sample) of per-response-token tensors of length
    len(response_ids); they are scattered to the response columns. rollout log-probs come from
    the samples themselves. `loss_mask` is 1 on the tokens the model sampled (an episode's
    environment tokens are 0: dsrl.actor.masks), `response_mask` on every response token (the
    columns per-response-token fields occupy: scored rows are read back under it)."""
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    T = max(lens)
    B = len(samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T - 1), dtype=torch.float32)
    response_mask = torch.zeros((B, T - 1), dtype=torch.float32)
    out = {name: torch.zeros((B, T - 1), dtype=torch.float32) for name in (token_fields or {})}
    rollout_lp = torch.zeros((B, T - 1), dtype=torch.float32)
    for b, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        if P < 1:
            raise ValueError(f"sample {s.index}: empty prompt")
        input_ids[b, : P + R] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        attention_mask[b, : P + R] = 1
        loss_mask[b, P - 1: P - 1 + R] = response_loss_mask(s)
        response_mask[b, P - 1: P - 1 + R] = 1.0
        if R:
            rollout_lp[b, P - 1: P - 1 + R] = torch.as_tensor(s.rollout_log_probs, dtype=torch.float32)
        for name, per_sample in (token_fields or {}).items():
            v = per_sample[b]
            if v is not None and R:
                out[name][b, P - 1: P - 1 + R] = torch.as_tensor(v, dtype=torch.float32).reshape(-1)[:R]
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "targets": input_ids[:, 1:].clone(),
        "loss_mask": loss_mask,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_lp,
        "sample_indices": [s.index for s in samples],
    }
    batch.update(out)
    return batch


def empty_microbatch(pad_id: int, fields=()) -> dict:
    """A one-target row with an all-zero loss mask, plus a zero per-token tensor for each name in
    `fields`: contributes exactly zero loss and gradient. A rank with fewer microbatches than the
    others runs these so that every rank enters the same number of ZeRO collectives."""
    mb = {"input_ids": torch.full((1, 2), pad_id, dtype=torch.long),
          "attention_mask": torch.tensor([[1, 0]], dtype=torch.long),
          "targets": torch.full((1, 1), pad_id, dtype=torch.long),
          "loss_mask": torch.zeros((1, 1), dtype=torch.float32),
          "response_mask": torch.zeros((1, 1), dtype=torch.float32),
          "sample_indices": [-1]}
    for name in fields:
        mb[name] = torch.zeros((1, 1), dtype=torch.float32)
    return mb


def rank_padding(count: int, *, at_least: int = 1) -> int:
    """How many empty microbatches a rank with `count` of its own runs so that every rank runs
    the same number of forward/backward calls (ZeRO collectives): the largest count of any rank
    (at least `at_least`) minus `count`. Collective."""
    return max(at_least, int(all_reduce_max(count))) - count


def pad_to_largest_rank(mbs: list, pad_id: int, fields=()) -> list:
    """`mbs` (this rank's microbatches) padded with empty ones (`empty_microbatch`, one zero
    tensor per name in `fields`) to the largest count of any rank, at least one (`rank_padding`).
    Collective."""
    return list(mbs) + [empty_microbatch(pad_id, fields) for _ in range(rank_padding(len(mbs)))]


def masked_rows(values: torch.Tensor, mask: torch.Tensor) -> list:
    """Inverse of collate for one per-token field: each row's values under `mask` (the
    microbatch's response_mask gives one value per response token)."""
    keep = mask.bool()
    return [values[b][keep[b]] for b in range(values.shape[0])]
