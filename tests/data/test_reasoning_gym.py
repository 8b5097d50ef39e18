"""data=reasoning_gym: reasoning-gym's tasks as a prompt source (dsrl/data/reasoning_gym.py), its
config errors before anything loads, and the `reasoning_gym` verifier with the task's own scorer.
No model, no network: items are generated on the spot."""
import random

import pytest

pytest.importorskip("reasoning_gym")
import reasoning_gym  # noqa: E402

from dsrl.data import DataError, PromptStream, build_source, make_source  # noqa: E402
from dsrl.errors import ConfigError  # noqa: E402
from dsrl.reward.registry import build_verifier, get_verifier  # noqa: E402
from dsrl.testing import compose_config  # noqa: E402
from dsrl.validation.validate import validate  # noqa: E402

ONE_DIGIT = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
             "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                  "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}}


def _source(num_eval=40, seed=0, tasks=("chain_sum", "basic_arithmetic"), knobs=None, **kw):
    return make_source("reasoning_gym", tasks=list(tasks), knobs=ONE_DIGIT if knobs is None else knobs,
                       seed=seed, num_eval=num_eval, **kw)


def test_items_are_the_tasks_own_and_scored_by_its_scorer():
    src = _source(num_eval=10)
    evals = src.eval_set(10)
    assert [p.meta["split"] for p in evals] == ["chain_sum"] * 5 + ["basic_arithmetic"] * 5
    verifier = get_verifier(src.default_verifier)
    for p in evals + src.sample_train(20, random.Random(3)):
        task, i = p.meta["task"], p.meta["index"]
        # Item i of a task is create_dataset(task, seed=seed, **knobs)[i], built here independently.
        ref = reasoning_gym.create_dataset(task, size=i + 1, seed=0, **ONE_DIGIT[task])[i]
        assert (p.meta["question"], p.answer) == (ref["question"], ref["answer"])
        assert p.messages[-1]["content"] == ref["question"] + "\n\nGive only the final answer."
        assert verifier(p.answer, p) == 1.0
        assert verifier(f"<answer>{p.answer}</answer>", p) == 1.0
        assert verifier(f"I think {int(p.answer) + 1}", p) == 0.0
        # No <answer> tag: the last word of the last line, punctuation and markdown stripped.
        assert verifier(f"The answer is **{p.answer}**.", p) == 1.0
        assert verifier(f"{p.meta['question'].split(':')[-1].strip(' =')} = {p.answer}", p) == 1.0
        assert verifier(f"{p.answer} is what I get, not", p) == 0.0


def test_the_fallback_answer():
    from dsrl.reward.reasoning_gym import extract_answer

    assert extract_answer("work\n<answer> -4 </answer>\n<answer>7</answer> bye", "7") == "7"
    assert extract_answer("3 - 7 = -4.", "-4") == "-4" and extract_answer("It is `12`!\n\n", "12") == "12"
    assert extract_answer("first\nThe words: cat, dog.", "cat, dog") == "The words: cat, dog."
    assert extract_answer("", "1") == "" and extract_answer("  \n ", "1") == ""


def test_train_and_eval_disjoint_by_question_and_same_seed_same_prompts():
    # 1-digit sums: a few hundred distinct questions, so the training draws do hit held-out ones.
    src = _source(num_eval=120)
    held = {p.meta["question"] for p in src.eval_set(120)}
    assert len(held) == 120  # distinct
    train = PromptStream(src, seed=5).next(600)
    assert not held & {p.meta["question"] for p in train}
    assert {p.meta["task"] for p in train} == {"chain_sum", "basic_arithmetic"}
    # Training items come after the held-out scan's items (no index shared with the held-out set).
    first_train = {t: min(p.meta["index"] for p in train if p.meta["task"] == t) for t in src.tasks}
    last_eval = {t: max(p.meta["index"] for p in src.eval_set(120) if p.meta["task"] == t) for t in src.tasks}
    assert all(first_train[t] > last_eval[t] for t in src.tasks)
    # Same seed, same prompts; a shorter eval set is a prefix of each task's held-out list.
    again = _source(num_eval=120)
    assert [p.to_dict() for p in again.eval_set(120)] == [p.to_dict() for p in src.eval_set(120)]
    assert [p.to_dict() for p in PromptStream(again, seed=5).next(600)] == [p.to_dict() for p in train]
    assert {p.meta["question"] for p in src.eval_set(20)} <= held
    other = _source(num_eval=120, seed=1)
    assert [p.meta["question"] for p in other.eval_set(120)] != [p.meta["question"] for p in src.eval_set(120)]
    with pytest.raises(DataError, match="data.num_eval=120"):
        src.eval_set(121)


def test_a_task_space_smaller_than_the_held_out_set_is_refused():
    # chain_sum with 1-digit non-negative terms: at most 100 ordered pairs x 2 operators questions.
    src = _source(num_eval=300, tasks=("chain_sum",), knobs={"chain_sum": ONE_DIGIT["chain_sum"]})
    with pytest.raises(DataError, match="task 'chain_sum' has only .* distinct questions"):
        src.eval_set(300)


@pytest.mark.parametrize("tasks,knobs,needles", [
    (["chain_sum", "no_such_task"], {}, ["unknown reasoning-gym task 'no_such_task'", "basic_arithmetic"]),
    (["chain_sum"], {"chain_sum": {"max_termz": 3}},
     ["data.knobs.chain_sum.max_termz", "task 'chain_sum' has no knob 'max_termz'", "min_terms", "allow_negation"]),
    (["chain_sum"], {"chain_sum": {"seed": 3}}, ["data.knobs.chain_sum.seed", "set by dsrl"]),
    (["chain_sum"], {"basic_arithmetic": {"min_terms": 2}}, ["data.knobs.basic_arithmetic", "not in data.tasks"]),
    (["chain_sum"], {"chain_sum": {"min_terms": 3, "max_terms": 2}},
     ["data.knobs.chain_sum=", "max_terms must be >= min_terms", "it takes: min_terms"]),
    ([], {}, ["data.tasks is empty"]),
])
def test_bad_tasks_and_knobs_name_the_task_and_its_knobs(tasks, knobs, needles):
    with pytest.raises(DataError) as e:
        make_source("reasoning_gym", tasks=tasks, knobs=knobs)
    for needle in needles:
        assert needle in str(e.value)


def test_config_group_preset_and_errors_before_anything_loads():
    cfg = compose_config("data=reasoning_gym", "data.tasks=[chain_sum,basic_arithmetic]",
                         "+data.knobs.chain_sum.max_terms=2", "+data.knobs.chain_sum.min_terms=2")
    validate(cfg)
    src = build_source(cfg.data)
    assert src.tasks == ["chain_sum", "basic_arithmetic"] and src.knobs["chain_sum"] == {"max_terms": 2, "min_terms": 2}
    preset = compose_config("+exp=reasoning_gym")
    validate(preset)
    assert preset.reward.strict and preset.data.num_eval == 240 and preset.rollout.max_new_tokens >= 64
    assert build_source(preset.data).knobs == ONE_DIGIT
    with pytest.raises(ConfigError) as e:
        validate(compose_config("data=reasoning_gym", "data.tasks=[chain_sum,spelling_bee]",
                                "+data.knobs.chain_sum.digits=2"))
    msg = str(e.value)
    assert "unknown reasoning-gym task 'spelling_bee'" in msg and "task 'chain_sum' has no knob 'digits'" in msg
    assert "min_digits" in msg  # the knobs it takes


def test_strict_turns_partial_credit_into_zero():
    src = _source(num_eval=2, tasks=("chain_sum",), knobs={"chain_sum": ONE_DIGIT["chain_sum"]})
    p = next(q for q in src.sample_train(50, random.Random(0)) if len(q.answer) == 1)
    cfg = compose_config("data=reasoning_gym").reward
    lenient = build_verifier(cfg, src)
    strict = build_verifier(compose_config("data=reasoning_gym", "reward.strict=true").reward, src)
    # The task's decimal scorer: an answer containing the right one gets len(right) / len(answer).
    assert lenient("1" + p.answer, p) == 0.5 and strict("1" + p.answer, p) == 0.0
    assert lenient(f"<answer>{p.answer}</answer> and more", p) == 1.0 == strict(f"<answer>{p.answer}</answer>", p)
    assert lenient(f" {p.answer}\n", p) == 1.0 == strict(f" {p.answer}\n", p)
    # spell_backward credits a matching prefix: partial there too, 0 under strict.
    sb = make_source("reasoning_gym", tasks=["spell_backward"], num_eval=1).eval_set(1)[0]
    half = sb.answer[: max(1, len(sb.answer) // 2)]
    assert 0.0 < lenient(half, sb) < 1.0 and strict(half, sb) == 0.0 and strict(sb.answer, sb) == 1.0
