"""A calculator tool and the tool-call syntax the model uses to call it.

SmolLM2's chat template (ChatML) has no tool support, so dsrl defines a plain syntax, taught in
the system prompt (TOOL_SYSTEM_PROMPT):

    model:        <tool>calc: 12 * (3 + 4)</tool>
    environment:  <result>84</result>          (or <result>error: ...</result>)

`parse_tool_calls` finds the calls in a model turn; `run_tool_call` answers one. Nothing a model
writes is ever passed to eval: `safe_arith` walks the expression's syntax tree and allows only
numbers, + - * / // % ** and parentheses, with caps on size so a call cannot hang the rollout."""
from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

TOOL_SYSTEM_PROMPT = (
    "You can use a calculator. To use it, write <tool>calc: EXPRESSION</tool>, for example "
    "<tool>calc: 12 * (3 + 4)</tool>, and you will receive <result>84</result>. "
    "When you know the answer, reply with the number only.")

# <tool>NAME: ARGUMENT</tool>; the name is a word, the argument anything up to the closing tag.
_CALL = re.compile(r"<tool>\s*([A-Za-z_][\w-]*)\s*:(.*?)</tool>", re.DOTALL)
_OPEN = re.compile(r"<tool>")

MAX_EXPR_CHARS = 200  # longer expressions are refused (error result), never evaluated
MAX_ABS_VALUE = 1e15  # intermediate results beyond this are refused (no giant integers)
MAX_EXPONENT = 64  # a ** b with |b| above this is refused
MAX_CALLS_PER_TURN = 4  # further calls in one turn are answered with an error


class ToolError(ValueError):
    """A tool call that cannot be answered; its message becomes the error result."""


_BINARY: Dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
                                 ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: Dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _checked(v):
    if isinstance(v, float) and not math.isfinite(v):
        raise ToolError("result is not a finite number")
    if abs(v) > MAX_ABS_VALUE:
        raise ToolError("number too large")
    return v


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError("exponent too large")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("number too large") from None
    raise ToolError(f"unsupported syntax: {type(node).__name__}")


def safe_arith(expr: str):
    """Value of an arithmetic expression (ints stay exact); ToolError on anything else."""
    text = (expr or "").strip().replace("\u00d7", "*").replace("\u2212", "-").replace("^", "**")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # thousands commas: 1,234 -> 1234
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {text!r}") from None
    return _eval(tree)


def format_number(v) -> str:
    """84 -> "84", 2.5 -> "2.5", 4.0 -> "4", 1/3 -> "0.333333" (6 significant digits past the point)."""
    if isinstance(v, float):
        if v.is_integer():
            return str(int(v))
        return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.6f}".rstrip("0").rstrip(".")
    return str(v)


def calc(argument: str) -> str:
    return format_number(safe_arith(argument))


TOOLS: Dict[str, Callable[[str], str]] = {"calc": calc}  # name in <tool>NAME: ...</tool> -> function


@dataclass
class ToolCall:
    name: str
    argument: str


def parse_tool_calls(text: str) -> tuple:
    """(well-formed calls in order, malformed: True when a <tool> tag is opened but not closed as
    <tool>NAME: ARGUMENT</tool>)."""
    calls = [ToolCall(m.group(1), m.group(2).strip()) for m in _CALL.finditer(text or "")]
    malformed = len(_OPEN.findall(text or "")) > len(calls)
    return calls, malformed


def run_tool_call(call: ToolCall, tools: Optional[Dict[str, Callable[[str], str]]] = None) -> tuple:
    """(result text, ok). A failing tool or an unknown name gives an error text, never an
    exception: a bad call is the model's mistake, answered in the conversation."""
    tools = TOOLS if tools is None else tools
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", False
    try:
        return fn(call.argument), True
    except ToolError as e:
        return f"error: {e}", False
    except (ValueError, TypeError, ArithmeticError, RecursionError) as e:  # a tool's own failure
        return f"error: {type(e).__name__}: {e}", False


def tool_results_message(results: List[str]) -> str:
    """The observation answering one turn's calls: one <result>...</result> per call."""
    return "\n".join(f"<result>{r}</result>" for r in results)
