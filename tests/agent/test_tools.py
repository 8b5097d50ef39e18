"""The calculator tool: exact arithmetic against hand-computed values, refusal (an error text,
never an exception, never eval) of names, calls, attributes, huge numbers and bad syntax, and
the <tool>NAME: ARG</tool> parsing with malformed and unknown calls."""
from __future__ import annotations

import pytest

from dsrl.agent.tools import (ToolCall, ToolError, calc, format_number, parse_tool_calls, run_tool_call, safe_arith,
                              tool_results_message)


@pytest.mark.parametrize("expr, want", [
    ("3+5", "8"), ("12 * (3 + 4)", "84"), ("7/2", "3.5"), ("8/2", "4"), ("1/3", "0.333333"), ("-4 + 1", "-3"),
    ("(-5)//2", "-3"), ("17 % 5", "2"), ("2^10", "1024"), ("2**3**2", "512"), ("1,234 + 1", "1235"),
    ("6 \u00d7 7", "42"), ("10 \u2212 3", "7"), ("0.1 + 0.2", "0.3"), ("99999 * 99999", "9999800001"),
])
def test_calc_values(expr, want):
    assert calc(expr) == want


def test_integers_stay_exact():
    assert safe_arith("123456789 * 1000 + 1") == 123456789001 and isinstance(safe_arith("7*6"), int)


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "unsupported syntax: Call"),
    ("x + 1", "unsupported syntax: Name"),
    ("(1).real", "unsupported syntax: Attribute"),
    ("[1, 2]", "unsupported syntax: List"),
    ("'a' * 3", "unsupported syntax: Constant"),
    ("True + 1", "unsupported syntax: Constant"),
    ("1 if 1 else 2", "unsupported syntax: IfExp"),
    ("3 < 4", "unsupported syntax: Compare"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("9**9**9", "exponent too large"),
    ("10**15 * 10", "number too large"),
    ("1e308 * 10", "number too large"),
    ("3 +", "cannot parse"),
    ("", "empty expression"),
    ("1+" * 150 + "1", "longer than 200"),
])
def test_refusals(expr, why):
    with pytest.raises(ToolError, match=why):
        safe_arith(expr)
    text, ok = run_tool_call(ToolCall("calc", expr))
    assert not ok and text.startswith("error:") and why.split(":")[0] in text


def test_parse_calls_in_order_and_malformed():
    calls, bad = parse_tool_calls("First <tool>calc: 3+5</tool>, then <tool> calc :2*4 </tool>.")
    assert [(c.name, c.argument) for c in calls] == [("calc", "3+5"), ("calc", "2*4")] and not bad
    calls, bad = parse_tool_calls("<tool>calc: 1+1")  # never closed
    assert calls == [] and bad
    calls, bad = parse_tool_calls("<tool>3+5</tool>")  # no tool name
    assert calls == [] and bad
    calls, bad = parse_tool_calls("The answer is 8.")
    assert calls == [] and not bad


def test_unknown_tool_and_results_message():
    text, ok = run_tool_call(ToolCall("python", "print(1)"))
    assert not ok and text == "error: unknown tool 'python'; available: calc"
    assert tool_results_message(["8", "error: x"]) == "<result>8</result>\n<result>error: x</result>"
    assert format_number(4.0) == "4" and format_number(2.5) == "2.5" and format_number(12) == "12"
