"""One record of the user's data -> one Prompt, or a RowProblem saying exactly what is wrong.

The prompt field (`data.prompt_key`) holds either plain text (one user message) or chat messages
(a list of {role, content}); the answer field (`data.answer_key`) a string or a number (null key:
rows carry no reference answer). Every other field stays available to verifiers as
`prompt.meta["record"]`."""
from __future__ import annotations

import math
from typing import Any, Optional

from dsrl.data.errors import RowProblem
from dsrl.data.types import Prompt

ROLES = ("system", "user", "assistant")


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _messages(value: Any, key: str) -> list:
    if isinstance(value, str):
        if not value.strip():
            raise RowProblem("empty prompt", f"empty prompt (field {key!r} is blank)")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)):
        raise RowProblem("wrong type", f"field {key!r} (data.prompt_key) must be a string or a list of "
                                       f"{{role, content}} messages, got {_type_name(value)}")
    if not value:
        raise RowProblem("empty prompt", f"empty prompt (field {key!r} is an empty message list)")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowProblem("wrong type", f"message {i} of field {key!r} must be a {{role, content}} object, "
                                           f"got {_type_name(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RowProblem("wrong type", f"message {i} of field {key!r}: role must be one of {list(ROLES)}, "
                                           f"got {role!r}")
        if not isinstance(content, str):
            raise RowProblem("wrong type", f"message {i} of field {key!r}: content must be a string, "
                                           f"got {_type_name(content)}")
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        raise RowProblem("wrong type", f"field {key!r}: the last message is the assistant's; the model answers "
                                       "the last user message")
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise RowProblem("empty prompt", f"empty prompt (field {key!r} has no non-blank user message)")
    return out


def _answer(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowProblem("wrong type", f"field {key!r} (data.answer_key) must be a string or a number, "
                                       f"got {_type_name(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RowProblem("wrong type", f"field {key!r} (data.answer_key) is {value}, not a finite number")
    text = str(value)
    if not text.strip():
        raise RowProblem("empty answer", f"empty answer (field {key!r} is blank)")
    return text


def record_to_prompt(record: Any, prompt_key: str, answer_key: Optional[str], meta: dict) -> Prompt:
    """The Prompt of one record; RowProblem when the record is not usable."""
    if not isinstance(record, dict):
        raise RowProblem("wrong type", f"a row must be an object with field {prompt_key!r}, got "
                                       f"{_type_name(record)}")
    for key, config_key in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key is None:
            continue
        if key not in record:
            raise RowProblem("missing field", f"missing field {key!r} ({config_key}); the row has "
                                              f"{sorted(map(str, record))[:10]}")
        if record[key] is None:
            raise RowProblem("missing field", f"field {key!r} ({config_key}) is null")
    messages = _messages(record[prompt_key], prompt_key)
    answer = _answer(record[answer_key], answer_key) if answer_key is not None else ""
    return Prompt(messages=messages, answer=answer, meta={**meta, "record": record})
