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


def dense_rows(rows: Sequence[Optional[torch.Tensor]], width: int, *, fill=0, dtype=torch.float32,
               starts: Optional[Sequence[int]] = None, lengths: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The dense, right-padded layout of a microbatch field: a [len(rows), width] tensor of
    `fill` with row b's values in columns starts[b] .. starts[b] + lengths[b] (defaults: column 0
    and the row's own length). A None row stays `fill`."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for b, row in enumerate(rows):
        if row is not None:
            start = 0 if starts is None else int(starts[b])
            out[b, start: start + (len(row) if lengths is None else int(lengths[b]))] = row
    return out


def dense_tokens(rows: Sequence[torch.Tensor], pad_id: int, width: int) -> tuple:
    """`input_ids` [B, width] (each row's token ids, right-padded with `pad_id`) and its
    `attention_mask` (1 on each row's tokens)."""
    ones = [torch.ones(len(r), dtype=torch.long) for r in rows]
    return dense_rows(rows, width, fill=pad_id, dtype=torch.long), dense_rows(ones, width, dtype=torch.long)


def collate(samples: Sequence[Sample], pad_id: int, token_fields: Optional[dict] = None) -> dict:
    """Pack samples into one microbatch dict of tensors.

    token_fields: name -> list (one per sample) of per-response-token tensors of length
    len(response_ids); they are scattered to the response columns. rollout log-probs come from
    the samples themselves. `loss_mask` is 1 on the tokens the model sampled (an episode's
    environment tokens are 0: dsrl.actor.masks), `response_mask` on every response token (the
    columns per-response-token fields occupy: scored rows are read back under it)."""
    T = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids, model_masks, starts, lens = [], [], [], []
    for s in samples:
        P, R = len(s.prompt_ids), len(s.response_ids)
        if P < 1:
            raise ValueError(f"sample {s.index}: empty prompt")
        ids.append(torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long))
        model_masks.append(response_loss_mask(s))
        starts.append(P - 1)  # response token k sits at column P-1+k
        lens.append(R)

    def response_field(rows) -> torch.Tensor:  # float32 [B, T-1], each row in its response columns
        return dense_rows(rows, T - 1, starts=starts, lengths=lens)

    input_ids, attention_mask = dense_tokens(ids, pad_id, T)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "targets": input_ids[:, 1:].clone(),
        "loss_mask": response_field(model_masks),
        "response_mask": response_field([torch.ones(R, dtype=torch.float32) for R in lens]),
        "rollout_log_probs": response_field([torch.as_tensor(s.rollout_log_probs, dtype=torch.float32) if R else None
                                             for s, R in zip(samples, lens)]),
        "sample_indices": [s.index for s in samples],
    }
    for name, per_sample in (token_fields or {}).items():
        batch[name] = response_field([_response_values(per_sample[b], R) for b, R in enumerate(lens)])
    return batch


def _response_values(v, R: int) -> Optional[torch.Tensor]:
    """A token field's values for a response of R tokens (None: none given, or no response)."""
    return torch.as_tensor(v, dtype=torch.float32).reshape(-1)[:R] if v is not None and R else None


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
