"""The Hermes tool-call parser (rollout.tool_parser=hermes): calls out of the text, what does not
parse left as content, the forced-call openings, the registry."""
from __future__ import annotations

import pytest

from dsrl.agent.tool_parsers import HermesParser, ParsedCall, get_tool_parser, register_tool_parser

NAMES = ["add", "mul"]
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    (ADD, None, [ParsedCall("add", {"a": 1, "b": 2})]),
    ("Let me add.\n" + ADD + "\n" + ADD.replace("add", "mul"), "Let me add.",
     [ParsedCall("add", {"a": 1, "b": 2}), ParsedCall("mul", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>', None, [ParsedCall("add", {"a": 3})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}\nThe JSON above.', "The JSON above.", [ParsedCall("add", {"a": 1})]),
    # not calls: the whole text is content
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', None, []),
    ('<tool_call>{"name": "sub", "arguments": {}}</tool_call>', None, []),
    ('<tool_call>{"name": "add", "arguments": 24}</tool_call>', None, []),
    ('<tool_call>{"name": "add", "arguments": 60 + 24}\n</tool_call>', None, []),
    ("just text", None, []),
])
def test_hermes_parse(text, content, calls):
    out = HermesParser().parse(text, NAMES)
    assert out.calls == calls
    assert out.content == (content if calls else text)


def test_forced_openings_and_registry():
    p = get_tool_parser("hermes")
    assert p.prefix("add") == '<tool_call>\n{"name": "add", "arguments": {'
    assert p.prefix(None) == '<tool_call>\n{"name": "'
    # a forced opening the model completes parses as the call
    assert p.parse(p.prefix("add") + '"a": 1}}\n</tool_call>', NAMES).calls == [ParsedCall("add", {"a": 1})]
    with pytest.raises(ValueError, match="rollout.tool_parser='nope': not one of"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="'hermes' is already registered"):
        register_tool_parser("hermes", HermesParser)
