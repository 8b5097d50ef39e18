"""Built-in rule-based verifiers (1.0 correct / 0.0 otherwise)."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Optional

from dsrl.reward.registry import register_verifier

# A number: optional sign (not glued to a preceding digit/word: "5-3" is 5 then 3), optional
# "$", digits with optional thousands commas, optional decimal part. A trailing "." that ends a
# sentence is not a decimal point.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212]?)\$?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?(?![\d])")


def _to_decimal(sign: str, int_part: str, frac: Optional[str]) -> Optional[Decimal]:
    try:
        v = Decimal(int_part.replace(",", "") + (frac or ""))
    except InvalidOperation:
        return None
    return -v if sign else v


def find_numbers(text: str) -> list[Decimal]:
    """All numbers in `text`, in order ("1,234" -> 1234, "$5" -> 5, "-3" -> -3, "8.0" -> 8.0)."""
    out = []
    for m in _NUMBER.finditer(text or ""):
        v = _to_decimal(m.group("sign"), m.group("int"), m.group("frac"))
        if v is not None:
            out.append(v)
    return out


def normalize_number(s: Any) -> Optional[Decimal]:
    """Parse a reference answer like "1,080", "$18", "-3", "7.0" (None if not a number)."""
    t = str(s).strip().replace(",", "").replace("$", "").replace("\u2212", "-").rstrip(".")
    if t.endswith("%"):
        t = t[:-1]
    try:
        return Decimal(t)
    except InvalidOperation:
        return None


def _answer_of(prompt: Any) -> Any:
    return prompt.answer if hasattr(prompt, "answer") else prompt


# A leading echo of the question's expression, e.g. "3 + 5 = " or "**12 + 7 =**" (SmolLM2's
# habitual answer format is "3 + 5 = 8"): skipped before taking the first number.
_ECHO = re.compile(
    r"^[\s*_`(]*(?:[-\u2212]?\d[\d,]*\s*[-+*/x\u00d7\u2212]\s*)+[-\u2212]?\d[\d,]*[\s*_`)]*=")


def strip_expression_echo(text: str) -> str:
    m = _ECHO.match(text or "")
    return text[m.end():] if m else (text or "")


@register_verifier("arith")
def arith_exact(completion_text: str, prompt: Any) -> float:
    """1.0 when the FIRST number in the completion equals the integer answer ("8", " 8.",
    "The answer is 8", "1,000", "-3"); a leading echo of the expression ("3 + 5 = 8") is
    skipped first. A trailing ".0" is accepted, "8.5" is not 8; "9 or 8" is wrong."""
    ref = normalize_number(_answer_of(prompt))
    if ref is None:
        return 0.0
    nums = find_numbers(strip_expression_echo(completion_text))
    return 1.0 if nums and nums[0] == ref else 0.0


def reference_number(answer: Any) -> Optional[Decimal]:
    """The reference as a number: a plain answer ("72", "1,080", 43.0), or a worked GSM8K
    solution whose final answer follows the last "####" (as in the original data files)."""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return normalize_number(text)


@register_verifier("gsm8k")
def gsm8k_last_number(completion_text: str, prompt: Any) -> float:
    """1.0 when the LAST number in the completion equals the reference (commas, "$" and a
    trailing ".0" normalized; a reference holding a GSM8K solution counts from its "####")."""
    ref = reference_number(_answer_of(prompt))
    if ref is None:
        return 0.0
    nums = find_numbers(completion_text)
    return 1.0 if nums and nums[-1] == ref else 0.0


# A closing answer statement: "... answer is 18", "Answer: $1,080.", "the final answer is **-3**",
# at the very end of the completion (trailing spaces, "*" and one "." allowed).
_FINAL_STATEMENT = re.compile(
    r"answer\s*(?:is|:|=)\s*[*_]*\s*[-\u2212]?\$?\s*\d[\d,]*(?:\.\d+)?\s*[*_]*\s*\.?[*_]*\s*$",
    re.IGNORECASE)

# Reward of a wrong answer stated in the asked-for form: small beside a correct one (1.0), so
# correctness dominates whenever a group has one, and all-wrong groups still rank format.
FORMAT_CREDIT = 0.1


def states_final_answer(completion_text: str) -> bool:
    """True when the completion ENDS with a final-answer statement ("The answer is 18.")."""
    return bool(_FINAL_STATEMENT.search(completion_text or ""))


@register_verifier("gsm8k_format")
def gsm8k_format(completion_text: str, prompt: Any) -> float:
    """Shaped GSM8K reward: 1.0 when correct (exactly the `gsm8k` verifier: the last number equals
    the reference, however it is phrased); else FORMAT_CREDIT (0.1) when the completion ends with a
    final-answer statement "... answer is N" (the form the gsm8k_reasoning preset's system prompt
    asks for; a completion cut off mid-work has none); else 0.0. Reward 1.0 <=> correct."""
    if gsm8k_last_number(completion_text, prompt) == 1.0:
        return 1.0
    return FORMAT_CREDIT if states_final_answer(completion_text) else 0.0
