"""Verifier cases worked out by hand."""
import pytest

from dsrl.data import Prompt, make_source, user_prompt
from dsrl.reward import (VERIFIERS, find_numbers, get_verifier, normalize_number, score,
                         verifier_for_source, verifier_names)
from decimal import Decimal


def P(answer):
    return user_prompt("q", answer)


@pytest.mark.parametrize("completion,answer,expected", [
    ("8", "8", 1.0),                       # correct, bare
    ("  8  ", "8", 1.0),                   # surrounding whitespace
    ("8.", "8", 1.0),                      # sentence-final period
    ("**8**", "8", 1.0),                   # markdown punctuation
    ("(8)", "8", 1.0),
    ("8\n\nThat's it.", "8", 1.0),
    ("The answer is 8.", "8", 1.0),        # chatter before the number is allowed
    ("9", "8", 0.0),                       # wrong
    ("", "8", 0.0),                        # empty
    ("   \n", "8", 0.0),
    ("eight", "8", 0.0),                   # words are not numbers
    ("3 + 5 = 8", "8", 1.0),               # an echo of the expression is skipped
    ("3+5=8.", "8", 1.0),
    ("**3 + 5 = 8**", "8", 1.0),
    ("3 + 5 = 9", "8", 0.0),
    ("3 + 5 is 8", "8", 0.0),              # no "=": FIRST number counts (3)
    ("3 + 5", "8", 0.0),
    ("2 + 3 + 3 = 8", "8", 1.0),           # three operands
    ("The answer is 3 + 5 = 8", "8", 0.0),  # echo only skipped at the start
    ("8 or 9", "8", 1.0),
    ("9 or 8", "8", 0.0),
    ("-3", "-3", 1.0),                     # negatives
    ("3", "-3", 0.0),
    ("-3", "3", 0.0),
    ("1,000", "1000", 1.0),                # thousands commas
    ("1000", "1,000", 1.0),
    ("8.0", "8", 1.0),                     # trailing .0 is the same integer
    ("8.5", "8", 0.0),                     # a decimal is not its integer part
    ("18", "8", 0.0),                      # no substring matches
    ("v8", "8", 0.0),                      # glued to a word
])
def test_arith_exact(completion, answer, expected):
    assert get_verifier("arith")(completion, P(answer)) == expected


@pytest.mark.parametrize("completion,answer,expected", [
    ("She sells 16 - 3 - 4 = 9 eggs, so 9 * 2 = 18.", "18", 1.0),  # LAST number counts
    ("9 * 2 = 18 dollars, not 19", "18", 0.0),
    ("The answer is $18.", "18", 1.0),         # dollar sign
    ("#### 18", "18", 1.0),
    ("Total: 1,080 clips", "1080", 1.0),       # commas in the completion
    ("Total: 1080", "1,080", 1.0),             # commas in the reference
    ("$1,450,000.00", "1450000", 1.0),         # commas + $ + trailing .00
    ("answer 18.0", "18", 1.0),                # trailing .0
    ("answer 18.5", "18", 0.0),
    ("The change is -5", "-5", 1.0),           # negative
    ("5-3=2", "2", 1.0),                       # minus between numbers is not a sign
    ("", "18", 0.0),
    ("I don't know", "18", 0.0),
])
def test_gsm8k_last_number(completion, answer, expected):
    assert get_verifier("gsm8k")(completion, P(answer)) == expected


def test_find_and_normalize_numbers():
    assert find_numbers("5-3=2, then 1,234.5 and -7.") == [Decimal(5), Decimal(3), Decimal(2),
                                                          Decimal("1234.5"), Decimal(-7)]
    assert normalize_number("$1,080") == Decimal(1080)
    assert normalize_number("7.0") == Decimal(7)
    assert normalize_number("abc") is None
    # A non-numeric reference never matches.
    assert get_verifier("arith")("abc", P("abc")) == 0.0


def test_registry_and_source_defaults():
    assert {"arith", "gsm8k"} <= set(verifier_names()) <= set(VERIFIERS)
    with pytest.raises(KeyError, match="nope"):
        get_verifier("nope")
    arith = make_source("arith")
    assert verifier_for_source(arith) is get_verifier("arith")
    assert verifier_for_source(arith, override="gsm8k") is get_verifier("gsm8k")
    prompts = arith.eval_set(3)
    rewards = score(verifier_for_source(arith), [p.answer for p in prompts] + [], prompts)
    assert rewards == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        score(get_verifier("arith"), ["1"], [])


def test_verifier_accepts_prompt_objects():
    p = Prompt(messages=[{"role": "user", "content": "What is 2 + 2?"}], answer="4")
    assert get_verifier("arith")(" 4", p) == 1.0
    assert isinstance(get_verifier("arith")(" 4", p), float)


@pytest.mark.parametrize("completion,answer,expected", [
    ("So she has 72 left.", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),  # a GSM8K solution
    ("So she has 24 left.", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 0.0),  # 24 is in the work, not after ####
    ("It costs $1,080.", "#### 1,080", 1.0),
    ("43", 43.0, 1.0),                   # a JSON number as the reference (MAWPS "target": 43.0)
    ("2.5 cups", 2.5, 1.0),
    ("no number", "#### 5", 0.0),
])
def test_gsm8k_verifier_reads_the_answer_after_hashes(completion, answer, expected):
    assert get_verifier("gsm8k")(completion, P(str(answer))) == expected


def test_reward_fn_names_the_key():
    from dsrl.registry import PluginError

    class NoDefault:
        default_verifier = None

    with pytest.raises(PluginError, match=r"reward\.fn: prompt source .* names no default verifier"):
        verifier_for_source(NoDefault())
    with pytest.raises(PluginError, match=r"reward\.fn='nope'"):
        verifier_for_source(NoDefault(), "nope")
    assert verifier_for_source(NoDefault(), "gsm8k") is get_verifier("gsm8k")


@pytest.mark.parametrize("completion,answer,expected", [
    ("9 * 2 = 18. The answer is 18.", "18", 1.0),       # correct and stated: 1.0, no extra credit
    ("So she makes 18 dollars", "18", 1.0),             # correct without the statement: still 1.0
    ("9 * 2 = 18. The answer is 19.", "18", 0.1),       # wrong but stated: format credit
    ("The answer is 19", "18", 0.1),                    # no final period
    ("Answer: $1,080.", "1080", 1.0),
    ("Answer: $1,070.", "1080", 0.1),                   # "Answer:" form, $ and commas
    ("The final answer is **-3**.", "3", 0.1),          # markdown bold, negative
    ("The answer is 19. Let me check: 9 * 2 = 18", "18", 1.0),  # last number is right: correct
    ("The answer is 19. Let me check: 9 * 2 = 17", "18", 0.0),  # statement not at the end: nothing
    ("9 * 2 = 17 and 17 + 2 =", "18", 0.0),             # cut off mid-work
    ("The answer is eighteen.", "18", 0.0),             # words are not numbers
    ("", "18", 0.0),
    ("The answer is 7.5.", "#### 7", 0.1),              # decimal stated, reference after ####
])
def test_gsm8k_format_credit(completion, answer, expected):
    assert get_verifier("gsm8k_format")(completion, P(answer)) == expected


def test_gsm8k_format_is_one_exactly_when_gsm8k_is_correct():
    # Reward 1.0 <=> the correctness-only verifier says correct, on every case above and more.
    texts = ["The answer is 18.", "18", "The answer is 19.", "x 18 y", "Answer: 18.0", "the answer is -18"]
    for t in texts:
        for ans in ("18", "-18", "19"):
            shaped, correct = get_verifier("gsm8k_format")(t, P(ans)), get_verifier("gsm8k")(t, P(ans))
            assert (shaped == 1.0) == (correct == 1.0) and shaped in (0.0, 0.1, 1.0)
