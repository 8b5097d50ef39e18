"""The one record every prompt source produces."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=True)
class Prompt:
    # Chat messages, e.g. [{"role": "user", "content": "What is 3 + 5? ..."}].
    messages: list
    # Reference answer the verifier compares against (a plain string, e.g. "8").
    answer: str
    # Free-form extras: task name, a stable id, operands, source index ...
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    __hash__ = None  # messages are dicts: not hashable; use .uid

    def __post_init__(self) -> None:
        msgs = [dict(m) for m in self.messages]
        for m in msgs:
            if "role" not in m or "content" not in m:
                raise ValueError(f"chat message needs 'role' and 'content': {m!r}")
        object.__setattr__(self, "messages", msgs)
        object.__setattr__(self, "answer", str(self.answer))

    @property
    def uid(self) -> str:
        """Stable identifier of the problem (falls back to the text)."""
        return str(self.meta.get("id", self.text))

    @property
    def text(self) -> str:
        """The last user message (the question)."""
        for m in reversed(self.messages):
            if m["role"] == "user":
                return m["content"]
        return self.messages[-1]["content"] if self.messages else ""

    def to_dict(self) -> dict[str, Any]:
        return {"messages": [dict(m) for m in self.messages], "answer": self.answer,
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict) -> "Prompt":
        return cls(messages=list(d["messages"]), answer=d["answer"], meta=dict(d.get("meta", {})))


def user_prompt(text: str, answer: Any, **meta: Any) -> Prompt:
    return Prompt(messages=[{"role": "user", "content": text}], answer=str(answer), meta=meta)
