"""Shared-prompt layout: a group's samples share one prompt, so it is forwarded once.

A *run* is a maximal stretch of consecutive samples with the same prompt (a GRPO group, or the
part of a group that falls into this microbatch): the prompt, then each response back to back.
Runs are packed into rows no longer than the longest run (short runs share a row, `pack_rows`),
right-padded. A 4-D attention mask lets every response attend its prompt and itself (causally),
never another response or run; position ids restart at 0 for each prompt and at P for each
response, so each response sees exactly the context and positions it has in the dense layout.
The log-prob of response token 0 comes from the prompt's last position (shared by all responses
of the row), token k >= 1 from the response's own position k-1.

Per-token fields of such a microbatch are *response-aligned*: [B, R] with column k = response
token k of sample b (R = the longest response). `logit_index` [B, R] maps each column to one of
the kept positions of the rows flattened to [rows * logits_to_keep]; the actor heads only the
positions of real response tokens (`head_rows`), the critic reads its values there. The row
gather's backward sums the gradients of the shared prompt's last position over the responses,
and autograd sums the prompt's other contributions through the attention: the gradient equals
the dense one up to float rounding.

Exact (same math as the dense forward) for decoder-only models whose attention takes an arbitrary
4-D mask and explicit position ids, with eager or sdpa attention and no sliding window."""
from __future__ import annotations

import contextlib
import logging
from typing import List, NamedTuple, Optional, Sequence

import torch

from dsrl.actor.batch import Sample
from dsrl.actor.block_attention import BLOCKS_KEY, build_blocks
from dsrl.actor.masks import response_loss_mask

log = logging.getLogger("dsrl")

# Architectures whose HF attention takes a 4-D additive mask as-is and RoPE from position_ids.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Attention kernels that apply an arbitrary 4-D mask (flash-attention variants do not).
SUPPORTED_ATTENTION = ("eager", "sdpa")
# Keys a shared-prompt microbatch carries for the forward only (not objective inputs).
FORWARD_KEYS = ("input_ids", "attention_mask", "targets", "position_ids", "logit_index", "logits_to_keep",
                "token_count", BLOCKS_KEY)


class SharedPromptDecision(NamedTuple):
    on: bool
    reason: str


def _unsupported_reason(hf_config, attn_implementation: Optional[str]) -> Optional[str]:
    """Why the shared-prompt forward would not equal the dense one for this model, or None."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)} (4-D mask + position ids)"
    attn = attn_implementation or getattr(hf_config, "_attn_implementation", None)
    if attn not in (None, "auto") and attn not in SUPPORTED_ATTENTION:  # auto: resolved to eager or sdpa
        return f"attention implementation {attn!r} does not take a 4-D mask (needs one of {list(SUPPORTED_ATTENTION)})"
    if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
        return "the model uses sliding-window attention (a custom 4-D mask would replace the window)"
    return None


def decide_shared_prompt(mode: str, hf_config, attn_implementation: Optional[str] = None, *,
                         hooks: Sequence = (), key: str = "actor.shared_prompt",
                         follows: Optional[str] = None) -> SharedPromptDecision:
    """`key`=auto|on|off (actor.shared_prompt; critic.shared_prompt for the critic's model, which
    `follows` actor.shared_prompt where null) for one model. `on` where the layout is not exact
    for the model is a ConfigError naming the key; `auto` turns it off and says why."""
    from dsrl.errors import ConfigError

    setting = f"{key}={mode}" if follows is None else f"{key}=null, so {follows}={mode}"
    if mode == "off":
        return SharedPromptDecision(False, f"shared-prompt forward off ({setting})")
    why = _unsupported_reason(hf_config, attn_implementation)
    if why is not None:
        if mode == "on":
            raise ConfigError(f"{setting} is not exact for this model: {why}; set {key}=auto or off")
        return SharedPromptDecision(False, f"shared-prompt forward off: {why}")
    if mode == "auto" and hooks:
        return SharedPromptDecision(False, "shared-prompt forward off: trainer.before_train_step_hooks see "
                                           f"microbatches, which keep the dense layout (set {key}=on)")
    return SharedPromptDecision(True, f"shared-prompt forward on ({setting}): each group's "
                                      "prompt is forwarded once per microbatch")


def critic_shared_prompt_setting(cfg) -> dict:
    """decide_shared_prompt's arguments for the critic's layout: critic.shared_prompt, or
    actor.shared_prompt where it is null. trainer.before_train_step_hooks never see the critic's
    microbatches, so they never turn it off."""
    if cfg.critic.shared_prompt is None:
        return {"mode": cfg.actor.shared_prompt, "key": "critic.shared_prompt", "follows": "actor.shared_prompt"}
    return {"mode": cfg.critic.shared_prompt, "key": "critic.shared_prompt"}


def check_shared_prompt_config(cfg, model_path: str, critic_path: Optional[str] = None) -> SharedPromptDecision:
    """Before any weights load: read the model's HF config and fail on an inexact `on`; with
    `critic_path` (a critic is built) the same for the critic's model and mode."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path)
    decision = decide_shared_prompt(cfg.actor.shared_prompt, hf_config, cfg.model.attn_implementation,
                                    hooks=cfg.trainer.before_train_step_hooks)
    if critic_path is not None:
        critic_config = hf_config if critic_path == model_path else AutoConfig.from_pretrained(critic_path)
        decide_shared_prompt(hf_config=critic_config, attn_implementation=cfg.model.attn_implementation,
                             **critic_shared_prompt_setting(cfg))
    return decision


def engine_uses_shared_prompt(cfg, engine) -> bool:
    """The decision for one engine (actor, reference, teacher or critic may differ), made once
    per engine and logged once. The critic (role "critic") follows critic_shared_prompt_setting;
    every other engine actor.shared_prompt."""
    cached = getattr(engine, "_shared_prompt_decision", None)
    if cached is None and getattr(engine, "hf_config", None) is None:
        cached = SharedPromptDecision(False, "shared-prompt forward off: the engine has no HF model config")
        engine._shared_prompt_decision = cached
    if cached is None:
        if getattr(engine, "role", None) == "critic":
            setting = critic_shared_prompt_setting(cfg)
        else:
            hooks = cfg.trainer.before_train_step_hooks if getattr(engine, "trainable", True) else ()
            setting = {"mode": cfg.actor.shared_prompt, "hooks": hooks}
        cached = decide_shared_prompt(hf_config=engine.hf_config,
                                      attn_implementation=getattr(engine.hf_config, "_attn_implementation", None),
                                      **setting)
        engine._shared_prompt_decision = cached
        log.info("%s: %s", getattr(engine, "role", "engine"), cached.reason)
    return cached.on


def prompt_runs(samples: Sequence[Sample]) -> List[List[int]]:
    """Indices of maximal runs of consecutive samples with the same prompt ids (one packed row each)."""
    runs: List[List[int]] = []
    for i, s in enumerate(samples):
        if runs and list(samples[runs[-1][0]].prompt_ids) == list(s.prompt_ids):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def row_length(samples: Sequence[Sample], run: Sequence[int]) -> int:
    """Tokens of one packed row: the prompt once plus every response."""
    return len(samples[run[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in run)


def pack_rows(lengths: Sequence[int]) -> List[List[int]]:
    """Runs (by their lengths) into rows no longer than the longest run: first fit, longest run
    first (stable), so short runs share a row instead of each padding to the longest. Returns
    the run indices of each row, in placement order."""
    cap = max(lengths, default=0)
    rows: List[List[int]] = []
    room: List[int] = []
    for j in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[j] <= free:
                rows[r].append(j)
                room[r] -= lengths[j]
                break
        else:
            rows.append([j])
            room.append(cap - lengths[j])
    return rows


def collate_shared_prompt(samples: Sequence[Sample], pad_id: int, token_fields: Optional[dict] = None) -> dict:
    """Pack samples into one shared-prompt microbatch (see the module docstring).

    Runs are packed into rows by `pack_rows`; runs that share a row are blocks on its diagonal
    (positions restart at 0 for each prompt, a run attends only itself), so a row holds the same
    math as one row per run, with less padding.

    token_fields: name -> list (one per sample) of per-response-token tensors, placed
    response-aligned like the log-probs. `loss_mask` / `response_mask` as in
    dsrl.actor.batch.collate (model tokens / every response token)."""
    if not samples:
        raise ValueError("collate_shared_prompt needs at least one sample")
    for s in samples:
        if len(s.prompt_ids) < 1:
            raise ValueError(f"sample {s.index}: empty prompt")
    runs = prompt_runs(samples)
    rows = [[runs[j] for j in row] for row in pack_rows([row_length(samples, r) for r in runs])]
    G, B = len(rows), len(samples)
    L = max(sum(row_length(samples, r) for r in row) for row in rows)
    R = max(1, max(len(s.response_ids) for s in samples))
    # no target reads the logits of positions before the first prompt's end in any row
    keep_from = min(len(samples[row[0][0]].prompt_ids) for row in rows) - 1
    K = L - keep_from  # logits_to_keep: the last K positions of every row
    input_ids = torch.full((G, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((G, L), dtype=torch.long)
    allowed = torch.zeros((G, 1, L, L), dtype=torch.bool)
    logit_index = torch.zeros((B, R), dtype=torch.long)
    targets = torch.full((B, R), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((B, R), dtype=torch.float32)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    rollout_lp = torch.zeros((B, R), dtype=torch.float32)
    fields = {name: torch.zeros((B, R), dtype=torch.float32) for name in (token_fields or {})}
    spans = []  # (row, context start, context length, own start, own length): the attention blocks
    for g, row in enumerate(rows):
        offset = 0  # where the run starts in the row
        for run in row:
            prompt = list(samples[run[0]].prompt_ids)
            P = len(prompt)
            last = offset + P - 1  # the prompt's last position: response token 0 reads its logits
            input_ids[g, offset:offset + P] = torch.tensor(prompt, dtype=torch.long)
            position_ids[g, offset:offset + P] = torch.arange(P)
            allowed[g, 0, offset:offset + P, offset:offset + P] = torch.ones((P, P), dtype=torch.bool).tril_()
            spans.append((g, offset, 0, offset, P))
            start = offset + P
            for b in run:
                s = samples[b]
                resp = list(s.response_ids)
                n = len(resp)
                end = start + n
                # logits position of target k: the prompt's end for k = 0, start+k-1 after; columns
                # past the response point at the prompt's end too (finite values, zero masks)
                pos = torch.full((R,), last, dtype=torch.long)
                if n:
                    input_ids[g, start:end] = torch.tensor(resp, dtype=torch.long)
                    position_ids[g, start:end] = torch.arange(P, P + n)
                    allowed[g, 0, start:end, offset:offset + P] = True
                    allowed[g, 0, start:end, start:end] = torch.ones((n, n), dtype=torch.bool).tril_()
                    spans.append((g, offset, P, start, n))
                    pos[1:n] = torch.arange(start, end - 1)
                    targets[b, :n] = torch.tensor(resp, dtype=torch.long)
                    loss_mask[b, :n] = response_loss_mask(s)
                    response_mask[b, :n] = 1.0
                    rollout_lp[b, :n] = torch.as_tensor(s.rollout_log_probs, dtype=torch.float32)
                    for name, per_sample in (token_fields or {}).items():
                        v = per_sample[b]
                        if v is not None:
                            fields[name][b, :n] = torch.as_tensor(v, dtype=torch.float32).reshape(-1)[:n]
                logit_index[b] = g * K + (pos - keep_from)
                start = end
            offset = start
        pad = torch.arange(offset, L)
        allowed[g, 0, pad, pad] = True  # pad queries attend only themselves (no all-masked softmax row)
    batch = {
        "input_ids": input_ids,
        "attention_mask": allowed,
        "position_ids": position_ids,
        "logit_index": logit_index,
        "logits_to_keep": K,
        "token_count": sum(row_length(samples, r) for r in runs),
        BLOCKS_KEY: build_blocks(spans, L),  # the mask as blocks (dsrl.actor.block_attention)
        "targets": targets,
        "loss_mask": loss_mask,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_lp,
        "sample_indices": [s.index for s in samples],
    }
    batch.update(fields)
    return batch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [G, 1, L, L] (True = may attend) -> the additive float mask HF attention adds to its
    scores: 0 where allowed, the dtype's lowest value elsewhere (as HF's own masks)."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)


@contextlib.contextmanager
def head_rows(model: torch.nn.Module, rows: torch.Tensor):
    """While open, the model's LM head sees only `rows` of its input: the hidden states it gets
    ([G, K, H], the kept positions of every packed row) are flattened to [G * K, H] and these
    rows taken, in order (repeats allowed), as one [1, len(rows), H] sequence; the logits come
    out [1, len(rows), V]. A forward pre-hook, so the head still runs inside the engine's
    forward (ZeRO-3 gathers its weight as usual)."""
    head = model.get_output_embeddings()

    def take(_module, args):
        h = args[0]
        return (h.reshape(-1, h.shape[-1]).index_select(0, rows).unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        yield
    finally:
        handle.remove()


def is_shared_prompt_batch(batch) -> bool:
    return "logit_index" in batch
