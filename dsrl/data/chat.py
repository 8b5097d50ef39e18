"""Prompt -> token ids, through the tokenizer's chat template or a plain-text fallback."""
from __future__ import annotations

import logging
from typing import Any, Optional

from dsrl.data.types import Prompt

log = logging.getLogger(__name__)


def build_messages(prompt: Prompt, system_prompt: Optional[str] = "") -> list[dict]:
    msgs = [dict(m) for m in prompt.messages]
    if system_prompt and not (msgs and msgs[0]["role"] == "system"):
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def plain_prompt_text(prompt: Prompt, system_prompt: Optional[str] = "") -> str:
    """Chat-free rendering: the message contents, blank-line separated, ending in a newline."""
    parts = [m["content"] for m in build_messages(prompt, system_prompt)]
    return "\n\n".join(p.strip() for p in parts if p.strip()) + "\n"


def _ids(out: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (dict) from apply_chat_template(tokenize=True).
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        if len(out) != 1:
            raise ValueError("expected a single sequence")
        out = out[0]
    return [int(t) for t in out]


def render_prompt(tokenizer: Any, prompt: Prompt, system_prompt: Optional[str] = "",
                  chat_template: bool = True) -> str:
    """The prompt text the model sees (for logging / text-based engines)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(build_messages(prompt, system_prompt),
                                             add_generation_prompt=True, tokenize=False)
    return plain_prompt_text(prompt, system_prompt)


_warned_no_template = False


def apply_chat_template(tokenizer: Any, prompt: Prompt, system_prompt: Optional[str] = "",
                        chat_template: bool = True) -> list[int]:
    """Token ids of `prompt` ready for generation (add_generation_prompt=True). With
    `chat_template=False`, or a tokenizer without one, the plain-text rendering is tokenized
    (special tokens as the tokenizer adds them by default)."""
    global _warned_no_template
    if chat_template:
        if getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template(build_messages(prompt, system_prompt),
                                                add_generation_prompt=True, tokenize=True)
            return _ids(out)
        if not _warned_no_template:
            log.warning("tokenizer has no chat template: using the plain prompt format")
            _warned_no_template = True
    return _ids(tokenizer(plain_prompt_text(prompt, system_prompt))["input_ids"])


def encode_prompts(tokenizer: Any, prompts: list[Prompt], system_prompt: Optional[str] = "",
                   chat_template: bool = True) -> list[list[int]]:
    return [apply_chat_template(tokenizer, p, system_prompt, chat_template) for p in prompts]
