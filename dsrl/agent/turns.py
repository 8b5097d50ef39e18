"""Token ids of a conversation's pieces through the chat template, without ever re-tokenizing
the conversation.

The model's own tokens are kept exactly as sampled. What the environment adds after a model turn
is rendered from the chat template applied to ONLY [a placeholder assistant turn, the new
messages]: the text after the placeholder's content is the template's closing of the assistant
turn, the new messages and the next generation prompt. The part of the closing that the model
already sampled (its end-of-turn token, e.g. ChatML's <|im_end|>) is left out, so a turn that
ended normally is followed by exactly what the template would have written ("\\n" and the next
message); a turn cut by the token cap gets the whole closing (as environment tokens)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from dsrl.data.chat import _ids

_PLACEHOLDER = "\u2063DSRL_TURN\u2063"  # assistant content never seen in real text


def _template(tokenizer: Any, messages: list, *, add_generation_prompt: bool, **template_kwargs) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)


def require_chat_template(tokenizer: Any, key: str = "rollout.env") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{key}: multi-turn episodes need a tokenizer with a chat template; "
                         f"{type(tokenizer).__name__} has none")


def prompt_ids(tokenizer: Any, messages: list, **template_kwargs) -> List[int]:
    """The first observation (system + user messages) ready for generation. `template_kwargs`
    go to apply_chat_template (e.g. `tools`, and `chat_template` for a template of dsrl's own)."""
    if not template_kwargs.get("chat_template"):
        require_chat_template(tokenizer)
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs))


class TurnRenderer:
    """Renders the environment's part between two model turns (see the module docstring).

    `system` is the episode's system message (if any): it is put before the placeholder so
    templates that insert a default system prompt when none is given render the same prefix in
    both texts and the difference is exactly the new part."""

    def __init__(self, tokenizer: Any, system: Optional[dict] = None, **template_kwargs):
        if not template_kwargs.get("chat_template"):
            require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs  # what every rendering passes to apply_chat_template
        self.head = [dict(system)] if system else []
        closed = _template(tokenizer, self.head + [{"role": "assistant", "content": _PLACEHOLDER}],
                           add_generation_prompt=False, **template_kwargs)
        at = closed.find(_PLACEHOLDER)
        if at < 0:
            raise ValueError("the chat template drops the assistant's content: cannot render turns")
        self._closed = closed
        self.closing = closed[at + len(_PLACEHOLDER):]  # e.g. "<|im_end|>\n" for ChatML
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def _sampled_closing(self, model_ids: Sequence[int]) -> str:
        """The part of the closing that the model's last sampled tokens already wrote: its
        trailing special tokens (an end-of-turn token) when they begin the closing."""
        tail = []
        for t in reversed(list(model_ids)):
            if int(t) not in self._special:
                break
            tail.append(int(t))
        text = self.tokenizer.decode(list(reversed(tail)), skip_special_tokens=False) if tail else ""
        return text if text and self.closing.startswith(text) else ""

    def observation_text(self, model_ids: Sequence[int], new_messages: list) -> str:
        """The text the environment adds after a model turn whose tokens are `model_ids`."""
        full = _template(self.tokenizer, self.head + [{"role": "assistant", "content": _PLACEHOLDER}]
                         + [dict(m) for m in new_messages], add_generation_prompt=True, **self.template_kwargs)
        if not full.startswith(self._closed):
            raise ValueError("the chat template renders an earlier turn differently once a message follows: "
                             "cannot append observations as token ids")
        return self.closing[len(self._sampled_closing(model_ids)):] + full[len(self._closed):]

    def observation_ids(self, model_ids: Sequence[int], new_messages: list) -> List[int]:
        """Token ids of `observation_text` (special tokens of the template parsed as such)."""
        text = self.observation_text(model_ids, new_messages)
        return _ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])
