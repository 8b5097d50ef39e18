"""Attention of a shared-prompt microbatch computed block by block, never over the whole row.

A shared-prompt row (dsrl.actor.shared_prompt) holds runs of one prompt and its responses; the
4-D mask lets a prompt position see the prompt causally and a response position see its prompt
and itself causally. Attention over the full [L, L] row computes every masked pair too: a group of
8 responses of 256 tokens after a 150-token prompt is a ~2,200-token row, 3.7x the score entries of
the 8 dense rows it replaces, which made the shared layout slower than the dense one at such
lengths. Here each *block* attends only the keys it may see: a prompt block (queries: the prompt;
keys: the prompt, causal) and a response block (queries: the response; keys: its prompt, then the
response, causal over the response). Blocks of one kind are batched into one gather, one score
matmul, one softmax and one value matmul; the outputs are scattered back to their row positions
(padding positions get 0: nothing reads them).

Same math as the masked row (each query's softmax is over the same keys, in the same order, with
the same scaling; eager attention in eager models, SDPA in sdpa ones), up to float rounding of the
smaller matmuls. It runs while `attention_by_blocks` is entered around a forward that passes the
blocks (`dsrl_blocks=`); HF passes that keyword through to every attention layer. Short rows keep
the masked row (`blocks_pay_off`): there the gathers cost more than the masked pairs."""
from __future__ import annotations

import contextlib
from typing import List, Sequence, Tuple

import torch

# Attention implementations registered with transformers, by the model's own (eager / sdpa).
NAMES = {"eager": "dsrl_blocks_eager", "sdpa": "dsrl_blocks_sdpa"}
# The microbatch key holding the blocks (a list of dicts of tensors, one per kind of block).
BLOCKS_KEY = "attention_blocks"
# Blocks are used when the masked row computes at least MIN_RATIO times the score entries the blocks
# need and at least MIN_SAVED more (per head and layer). Measured (SmolLM2, bf16, one group's
# fwd+bwd, AMD EPYC 2 cores, bench/bench_block_attention.py, medians of 3-7): the default job's
# shape (P=43, 8 x 16 tokens; 29k entries, 3.1x the blocks') ran 1.15x slower by blocks (the gathers
# and two small batches cost more than the masked pairs); P=150 with 4 x 256 tokens (1.4M, 3.1x)
# 0.62x and with 8 x 256 (4.8M, 5.7x) 0.30x of the masked row's time.
MIN_RATIO = 2.0
MIN_SAVED = 250_000
_registered = False


def blocks_pay_off(batch: dict) -> bool:
    """Whether this shared-prompt microbatch's attention runs by blocks (MIN_RATIO, MIN_SAVED)."""
    G, L = batch["input_ids"].shape
    needed = sum(b["allowed"].shape[0] * b["allowed"].shape[2] * b["allowed"].shape[3] for b in batch[BLOCKS_KEY])
    masked = G * L * L
    return masked >= MIN_RATIO * needed and masked - needed >= MIN_SAVED


def build_blocks(spans: Sequence[Tuple[int, int, int, int, int]], row_len: int) -> List[dict]:
    """Blocks of one microbatch from its spans (row, context start, context length, own start,
    own length), row_len = L. Prompt blocks (no context) and response blocks are batched apart,
    so short responses are not padded to a long prompt's length. Each block dict holds
    q_index [N, Qm] and k_index [N, Km] (flat positions row * L + t; 0 where padded), `allowed`
    bool [N, 1, Qm, Km] and q_valid bool [N, Qm]. A padded query row may see key 0 only (a
    finite softmax; its output is dropped)."""
    out = []
    for kind in (lambda s: s[2] == 0, lambda s: s[2] > 0):
        chosen = [s for s in spans if kind(s) and s[4] > 0]
        if not chosen:
            continue
        qm = max(s[4] for s in chosen)
        km = max(s[2] + s[4] for s in chosen)
        n = len(chosen)
        q_index = torch.zeros((n, qm), dtype=torch.long)
        k_index = torch.zeros((n, km), dtype=torch.long)
        allowed = torch.zeros((n, 1, qm, km), dtype=torch.bool)
        q_valid = torch.zeros((n, qm), dtype=torch.bool)
        for j, (row, c0, c, s0, s) in enumerate(chosen):
            base = row * row_len
            q_index[j, :s] = torch.arange(base + s0, base + s0 + s)
            k_index[j, :c] = torch.arange(base + c0, base + c0 + c)
            k_index[j, c:c + s] = q_index[j, :s]
            allowed[j, 0, :s, :c] = True
            allowed[j, 0, :s, c:c + s] = torch.ones((s, s), dtype=torch.bool).tril_()
            allowed[j, 0, s:, 0] = True
            q_valid[j, :s] = True
        out.append({"q_index": q_index, "k_index": k_index, "allowed": allowed, "q_valid": q_valid})
    return out


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, Hkv, K, D] -> [N, Hkv * groups, K, D] (each key/value head serves `groups` query heads)."""
    if groups == 1:
        return x
    n, h, k, d = x.shape
    return x[:, :, None].expand(n, h, groups, k, d).reshape(n, h * groups, k, d)


def _blocks_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, *, sdpa: bool,
                      dsrl_blocks=None, **kwargs):
    """The attention interface of transformers: query [G, H, L, D], key/value [G, Hkv, L, D] ->
    ([G, L, H, D], None). `attention_mask` (the row's 4-D mask) is not read: the blocks are the mask."""
    if dsrl_blocks is None:
        raise RuntimeError("block attention without dsrl_blocks: enter attention_by_blocks only around a "
                           "forward of a shared-prompt microbatch that passes its blocks")
    if dropout:
        raise RuntimeError(f"block attention with dropout {dropout}: not supported (a random forward)")
    G, H, L, D = query.shape
    groups = H // key.shape[1]
    qf = query.transpose(1, 2).reshape(G * L, H, D)
    kf = key.transpose(1, 2).reshape(G * L, key.shape[1], D)
    vf = value.transpose(1, 2).reshape(G * L, value.shape[1], D)
    positions, outputs = [], []
    for blk in dsrl_blocks:
        q_index, k_index = blk["q_index"].to(query.device), blk["k_index"].to(query.device)
        allowed, q_valid = blk["allowed"].to(query.device), blk["q_valid"].to(query.device)
        q = qf[q_index].transpose(1, 2)  # [N, H, Qm, D]
        k = _repeat_kv(kf[k_index].transpose(1, 2), groups)  # [N, H, Km, D]
        v = _repeat_kv(vf[k_index].transpose(1, 2), groups)
        if sdpa:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
        else:  # as transformers' eager_attention_forward: scores, additive mask, fp32 softmax, values
            scores = torch.matmul(q, k.transpose(2, 3)) * scaling
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(probs, v)
        o = o.transpose(1, 2)  # [N, Qm, H, D]
        positions.append(q_index[q_valid])
        outputs.append(o[q_valid])
    out = query.new_zeros((G * L, H, D)).index_copy(0, torch.cat(positions), torch.cat(outputs))
    return out.view(G, L, H, D), None


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAMES["eager"], lambda *a, **k: _blocks_attention(*a, sdpa=False, **k))
    AttentionInterface.register(NAMES["sdpa"], lambda *a, **k: _blocks_attention(*a, sdpa=True, **k))
    _registered = True


@contextlib.contextmanager
def attention_by_blocks(model: torch.nn.Module, enabled: bool = True):
    """While entered, the model's attention layers (eager or sdpa) run block by block; yields
    whether they do (False when not `enabled`, for another kernel, or under gradient
    checkpointing, whose recompute in the backward would run outside this context: the masked row
    is used then)."""
    config = getattr(model, "config", None)
    base = getattr(config, "_attn_implementation", None)
    if not enabled or base not in NAMES or getattr(model, "is_gradient_checkpointing", False):
        yield False
        return
    _register()
    config._attn_implementation = NAMES[base]
    try:
        yield True
    finally:
        config._attn_implementation = base
