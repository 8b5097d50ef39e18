"""The per-response-token loss mask of a Sample: its model mask for a multi-turn episode (1 =
sampled by the model, 0 = environment token), all ones for a single-turn completion.

Kept free of other dsrl imports: the actor's batches (dsrl.actor.batch, dsrl.actor.shared_prompt),
dynamic sampling (dsrl.rollout.dynamic) and the trainer's stages read it."""
from __future__ import annotations

import torch


def response_loss_mask(sample) -> torch.Tensor:
    """float32 [len(sample.response_ids)]: `sample.extra["model_mask"]` if present, else ones.
    A model mask of the wrong length is an error naming the sample."""
    extra = getattr(sample, "extra", None)
    mask = extra.get("model_mask") if extra else None
    if mask is None:
        return torch.ones(len(sample.response_ids), dtype=torch.float32)
    if len(mask) != len(sample.response_ids):
        raise ValueError(f"sample {sample.index}: model_mask has {len(mask)} entries for "
                         f"{len(sample.response_ids)} response tokens")
    return torch.as_tensor(mask, dtype=torch.float32)


def model_tokens(sample) -> int:
    """Tokens of the response that the model sampled (the loss-mask count)."""
    extra = getattr(sample, "extra", None)
    if not extra or extra.get("model_mask") is None:
        return len(sample.response_ids)
    return int(response_loss_mask(sample).sum())
