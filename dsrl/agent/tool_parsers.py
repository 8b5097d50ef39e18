"""Tool-call parsers (`rollout.tool_parser`): turn the text a model sampled into OpenAI-shaped
function calls, and say how a forced call begins (tool_choice `required` or a named function).

A parser has one typed signature (`ToolParser`): `parse(text, names)` gives the content (the text
outside the calls, None when empty) and the calls found, each a `ParsedCall(name, arguments)` with
`arguments` a JSON object already parsed; a call that is not well formed (no closing tag, not JSON,
not an object, or a name that is not one of the request's tools) is left in the content, so output
that does not parse comes back as text, never as an error. `prefix(name)` is the text that opens a
call (of `name`, up to the opening brace of its arguments object; or of any function when None),
which the endpoint writes after the generation prompt to force one.

Register more with `register_tool_parser(name, parser)`; the registry is keyed by the name the
config uses."""
from __future__ import annotations

import abc
import dataclasses
import json
import re
from typing import Callable, Dict, List, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    content: Optional[str]
    calls: List[ParsedCall]


class ToolParser(abc.ABC):
    """Base of the registry's parsers (see the module docstring)."""

    name = ""

    @abc.abstractmethod
    def parse(self, text: str, names: Sequence[str]) -> ParsedOutput:
        """The reply's text -> its content and the calls of the named tools."""

    @abc.abstractmethod
    def prefix(self, name: Optional[str]) -> str:
        """The text that opens a call (of tool `name`, or of any tool when None)."""


class HermesParser(ToolParser):
    """Hermes style (NousResearch's Hermes, Qwen2.5, dsrl's ChatML tool template): each call is
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the text, whitespace allowed
    around the JSON. The last call may lack its closing tag (small models often leave it out): its
    JSON object is the call and the text after it is content."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str, names: Sequence[str]) -> ParsedOutput:
        known = set(names)
        calls, kept, at = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = self._call(m.group(1), known)
            if call is None:
                continue  # stays in the content
            kept.append(text[at:m.start()])
            at = m.end()
            calls.append(call)
        tail = self._unclosed(text[at:], known)  # a last call the model did not close (small models often don't)
        if tail is not None:
            start, call, end = tail
            kept += [text[at:at + start], text[at + end:]]
            calls.append(call)
        else:
            kept.append(text[at:])
        content = "".join(kept).strip() if calls else text
        return ParsedOutput(content or None, calls)

    def _unclosed(self, rest: str, known: set):
        """(where it starts, the call, where it ends) of an opening tag with no closing tag after it,
        followed by one JSON call object; None otherwise. The text after the object is content."""
        at = rest.find(self.OPEN)
        if at < 0 or self.CLOSE in rest[at:]:
            return None
        body = rest[at + len(self.OPEN):]
        lead = len(body) - len(body.lstrip())
        try:
            _, end = json.JSONDecoder().raw_decode(body[lead:])
        except ValueError:
            return None
        call = self._call(body[lead:lead + end], known)
        return None if call is None else (at, call, at + len(self.OPEN) + lead + end)

    @staticmethod
    def _call(body: str, known: set) -> Optional[ParsedCall]:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in known:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], args)

    def prefix(self, name: Optional[str]) -> str:
        if name is None:
            return self.OPEN + '\n{"name": "'
        return self.OPEN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": {'


TOOL_PARSERS: Dict[str, Callable[[], ToolParser]] = {"hermes": HermesParser}


def register_tool_parser(name: str, parser: Callable[[], ToolParser]) -> None:
    if name in TOOL_PARSERS:
        raise ValueError(f"rollout.tool_parser: {name!r} is already registered")
    TOOL_PARSERS[name] = parser


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"rollout.tool_parser={name!r}: not one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
