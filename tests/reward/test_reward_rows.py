"""A user's reward function may take the row's fields by name (`def reward(completion, answer, **row)`)
besides today's fn(completion_text, prompt): dsrl tells the two apart by signature, once, when the
function is registered or loaded (dsrl/reward/registry.py), and calls both as fn(completion_text, prompt).
Also reward.strict (partial credit -> 0). No model."""
import pytest

from dsrl.data import user_prompt
from dsrl.errors import ConfigError
from dsrl.registry import PluginError
from dsrl.reward.registry import RowVerifier, as_verifier, build_eval_verifier, build_verifier, get_verifier
from dsrl.testing import compose_config

PROMPT = user_prompt("What is 3 + 5?", 8, task="sums", difficulty=2)
CALLS = []


# --- the functions loaded by dotted path below (test_reward_rows.<name>) ---------------
def trl_style(completion, answer, **row):
    CALLS.append(("trl_style", completion, answer, sorted(row)))
    return float(completion.strip() == answer)


def named_only(completion, answer, difficulty, meta=None):
    CALLS.append(("named_only", completion, answer, difficulty, meta))
    return 0.25 * difficulty


def pair_style(completion_text, prompt):
    CALLS.append(("pair_style", completion_text, prompt.answer))
    return 0.5


def pair_named_completion(completion, p):  # today's positional form, whatever the names
    return 1.0 if p.answer in completion else 0.0


def batch_style(completions, answer, **kw):
    return [0.0 for _ in completions]


def one_argument(text):
    return 0.0


def needs_missing(completion, answer, rubric):
    return 1.0


def test_the_two_forms_are_told_apart_by_signature_and_called_alike():
    CALLS.clear()
    trl = get_verifier("test_reward_rows.trl_style")
    assert isinstance(trl, RowVerifier)
    assert trl(" 8 ", PROMPT) == 1.0 and trl("9", PROMPT) == 0.0
    assert CALLS[0] == ("trl_style", " 8 ", "8", ["difficulty", "messages", "meta", "prompt", "question", "task"])
    named = get_verifier("test_reward_rows.named_only")
    assert named("x", PROMPT) == 0.5
    assert CALLS[-1] == ("named_only", "x", "8", 2, {"task": "sums", "difficulty": 2})
    # Today's form: the function itself, unchanged (no wrapper, no extra call cost).
    assert get_verifier("test_reward_rows.pair_style") is pair_style
    assert pair_style("x", PROMPT) == 0.5 and CALLS[-1] == ("pair_style", "x", "8")
    assert as_verifier(pair_named_completion) is pair_named_completion
    assert as_verifier(lambda c, p: 1.0)("x", PROMPT) == 1.0


def test_the_form_is_decided_once_when_loaded():
    a = get_verifier("test_reward_rows.trl_style")
    b = get_verifier("test_reward_rows.trl_style", "reward.eval_fn")
    assert a is b  # the same wrapper: inspected once


def test_the_row_fields():
    CALLS.clear()
    seen = {}

    def everything(**row):
        seen.update(row)
        return 0.0

    as_verifier(everything)("the text", PROMPT)
    assert seen["completion"] == "the text" and seen["prompt"] is PROMPT and seen["answer"] == "8"
    assert seen["question"] == "What is 3 + 5?" and seen["messages"] == PROMPT.messages
    assert (seen["task"], seen["difficulty"], seen["meta"]) == ("sums", 2, {"task": "sums", "difficulty": 2})
    # A file row's own fields (data=jsonl|parquet|hf keep the row as meta["record"]) come by name too.
    seen.clear()
    from_file = user_prompt("What is 2 + 2?", 4, record={"question": "What is 2 + 2?", "answer": 4, "level": "easy"})
    as_verifier(everything)("4", from_file)
    assert (seen["level"], seen["answer"], seen["record"]["answer"]) == ("easy", "4", 4)


@pytest.mark.parametrize("name,needle", [
    ("batch_style", "takes `completions`, a batch"),
    ("one_argument", "takes two positional arguments (completion_text, prompt)"),
])
def test_unusable_signatures_name_the_config_key(name, needle):
    with pytest.raises(PluginError) as e:
        get_verifier(f"test_reward_rows.{name}", "reward.fn")
    assert str(e.value).startswith(f"reward.fn='test_reward_rows.{name}': not a usable verifier")
    assert needle in str(e.value)


def test_a_field_the_row_lacks_is_named_at_the_call():
    fn = get_verifier("test_reward_rows.needs_missing")
    with pytest.raises(TypeError, match=r"takes \['rubric'\], which this row lacks; the row's fields are \["):
        fn("8", PROMPT)


class _Reward:
    def __init__(self, **kw):
        self.__dict__.update(dict(fn=None, eval_fn=None, url=None, strict=False, timeout_s=1.0, retries=0), **kw)


class _Source:
    default_verifier = "arith"


def test_strict_applies_to_training_and_eval_verifiers():
    src = _Source()
    half = "test_reward_rows.pair_style"  # always 0.5
    assert build_verifier(_Reward(fn=half), src)("x", PROMPT) == 0.5
    assert build_verifier(_Reward(fn=half, strict=True), src)("x", PROMPT) == 0.0
    assert build_eval_verifier(_Reward(), src) is None  # the training reward's
    assert build_eval_verifier(_Reward(eval_fn=half), src)("x", PROMPT) == 0.5
    assert build_eval_verifier(_Reward(eval_fn=half, strict=True), src)("x", PROMPT) == 0.0
    # 0 and 1 stay as they are.
    assert build_verifier(_Reward(strict=True), src)("8", PROMPT) == 1.0
    assert build_verifier(_Reward(strict=True), src)("9", PROMPT) == 0.0


def test_config_validation_accepts_a_row_function_and_refuses_a_bad_one():
    from dsrl.validation.validate import validate

    validate(compose_config("+exp=grpo_reuse", "reward.fn=test_reward_rows.trl_style"))
    with pytest.raises(ConfigError, match="reward.fn='test_reward_rows.batch_style': not a usable"):
        validate(compose_config("+exp=grpo_reuse", "reward.fn=test_reward_rows.batch_style"))
