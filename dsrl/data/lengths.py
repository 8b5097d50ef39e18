"""Over-long prompts are found, never truncated: once the tokenizer is loaded (and before any
engine), every prompt of a source that can list its prompts is encoded exactly as the rollout
encodes it and compared with the limit; the source refuses it (naming file and row) or, under
data.on_bad_row=skip, drops and counts it."""
from __future__ import annotations

from typing import Any, Tuple

from dsrl.data.chat import apply_chat_template


def prompt_token_limit(cfg: Any) -> Tuple[int, str]:
    """(limit, the config key(s) it comes from): data.max_prompt_tokens, else the longest prompt
    the rollout engine accepts with room for the completion."""
    if cfg.data.max_prompt_tokens is not None:
        return int(cfg.data.max_prompt_tokens), "data.max_prompt_tokens"
    return (int(cfg.rollout.max_model_len - cfg.rollout.max_new_tokens),
            "rollout.max_model_len - rollout.max_new_tokens")


def check_prompt_lengths(source: Any, tokenizer: Any, cfg: Any) -> None:
    """Apply the prompt-length limit to `source` (sources without `check_prompt_lengths`, such as
    the generated arith task, are left alone)."""
    check = getattr(source, "check_prompt_lengths", None)
    if check is None:
        return
    limit, key = prompt_token_limit(cfg)
    d = cfg.data
    check(lambda p: len(apply_chat_template(tokenizer, p, d.system_prompt, d.chat_template)), limit, key)
