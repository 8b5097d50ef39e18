"""Log-probs of given target tokens (and entropy) from logits.

Works on row chunks so the fp32 log-softmax over the vocabulary is never materialized for the
whole batch at once: a custom autograd Function keeps only the per-row logsumexp (and entropy)
from the forward, and the backward recomputes the softmax one chunk at a time, writing the
logits gradient straight into one buffer of the logits' dtype. Values equal the naive
log_softmax + gather (same fp32 arithmetic per row). `token_logprobs_naive` is the reference."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

# Rows per chunk are chosen so one fp32 chunk holds about this many elements (32 MiB): large
# enough that per-op overhead (and OpenMP wake-ups on a busy CPU) stays small, small next to
# the [B, T, V] logits and their gradient.
CHUNK_ELEMENTS = 8 * 1024 * 1024


def _row_chunks(B: int, T: int, V: int, chunk_elements: int):
    """(b, t0, t1) ranges covering [B, T]; each chunk is a 2-D view logits[b, t0:t1] (no copy,
    whatever the strides of logits)."""
    rows = max(1, int(chunk_elements) // max(V, 1))
    for b in range(B):
        for t0 in range(0, T, rows):
            yield b, t0, min(T, t0 + rows)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    x = chunk.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    return x


class _TokenLogprobs(torch.autograd.Function):
    """Rows [:, :T] of `logits` ([B, T_full, V], T <= T_full); the gradient of the other rows is
    zero. Scoring a prefix of a larger tensor directly (instead of a sliced view) lets autograd
    skip SliceBackward's extra full-size zero-filled gradient buffer."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_elements):
        B, T = targets.shape
        V = logits.shape[-1]
        dev = logits.device
        lp = torch.empty((B, T), dtype=torch.float32, device=dev)
        lse = torch.empty((B, T), dtype=torch.float32, device=dev)
        ent = torch.empty((B, T) if with_entropy else (0,), dtype=torch.float32, device=dev)
        for b, t0, t1 in _row_chunks(B, T, V, chunk_elements):
            x = _scaled(logits[b, t0:t1], temperature)
            s = torch.logsumexp(x, dim=-1)
            lse[b, t0:t1] = s
            lp[b, t0:t1] = x.gather(-1, targets[b, t0:t1].unsqueeze(-1)).squeeze(-1) - s
            if with_entropy:
                p = torch.softmax(x, dim=-1)
                ent[b, t0:t1] = s - p.mul_(x).sum(-1)
                del p
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.chunk_elements = chunk_elements
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, _grad_lse):
        logits, targets, lse, ent = ctx.saved_tensors
        use_ent = grad_ent is not None and ctx.with_entropy
        if grad_lp is None and not use_ent:
            return None, None, None, None, None
        B, T = targets.shape
        V = logits.shape[-1]
        temperature = ctx.temperature
        scale = 1.0 / temperature if temperature not in (0.0, 1.0) else 1.0
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        if grad.shape[1] > T:
            grad[:, T:].zero_()
        direct = grad.dtype == torch.float32
        for b, t0, t1 in _row_chunks(B, T, V, ctx.chunk_elements):
            x = _scaled(logits[b, t0:t1], temperature)  # may alias logits: never modified in place
            s = lse[b, t0:t1].unsqueeze(-1)
            g = grad[b, t0:t1] if direct else torch.empty(x.shape, dtype=torch.float32, device=x.device)
            torch.sub(x, s, out=g)
            g.exp_()  # softmax p, recomputed
            # coefficient c per row so that grad = -p * c + onehot * grad_lp, where
            #   d lp/dx = onehot - p,  dH/dx = -p * (x - lse + H)
            if use_ent:
                gent = grad_ent[b, t0:t1].float().unsqueeze(-1)
                h = ent[b, t0:t1].unsqueeze(-1)
                coef = (x - s + h).mul_(gent)
                if grad_lp is not None:
                    coef.add_(grad_lp[b, t0:t1].float().unsqueeze(-1))
                g.mul_(coef).neg_()
                del coef
            else:
                g.mul_(grad_lp[b, t0:t1].float().unsqueeze(-1).neg())
            if grad_lp is not None:
                g.scatter_add_(-1, targets[b, t0:t1].unsqueeze(-1), grad_lp[b, t0:t1].float().unsqueeze(-1))
            if scale != 1.0:
                g.mul_(scale)
            if not direct:
                grad[b, t0:t1] = g
        return grad, None, None, None, None


def _prefix_base(logits: torch.Tensor) -> Optional[torch.Tensor]:
    """If `logits` is exactly base[:, :T] of a [B, T_full, V] tensor (e.g. out.logits[:, :-1]),
    return that base, else None."""
    base = logits._base
    if base is None or base.dim() != 3 or base.dtype != logits.dtype:
        return None
    if base.shape[0] != logits.shape[0] or base.shape[2] != logits.shape[2] or base.shape[1] < logits.shape[1]:
        return None
    if base.stride() != logits.stride() or base.storage_offset() != logits.storage_offset():
        return None
    if logits.requires_grad and not base.requires_grad:
        return None
    return base


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [B, T, V] (any float dtype), targets [B, T] -> (log_probs [B, T] fp32, entropy [B, T] | None)."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:2]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    targets = targets.to(device=logits.device, dtype=torch.long)
    src = _prefix_base(logits)
    if src is None:
        src = logits
    lp, ent, _ = _TokenLogprobs.apply(src, targets, float(temperature), bool(with_entropy), CHUNK_ELEMENTS)
    return lp, (ent if with_entropy else None)


def token_logprobs_naive(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                         with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference implementation: full fp32 log-softmax over the vocabulary (memory-heavy)."""
    x = logits.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        p = torch.softmax(x, dim=-1)
        ent = lse - (p * x).sum(-1)
    return lp, ent
