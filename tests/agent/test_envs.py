"""The shipped environments. calculator: a tool turn gets <result> answers (errors for bad or
malformed calls, never an exception) and no reward; a final answer is scored by the verifier,
plus the tool bonus only after a successful call. guess_the_number (textarena's real game,
loaded offline): the hidden number follows the episode seed, hints are right, a win pays +1, two
invalid moves in a row -1, running out of guesses 0; the global `random` state is untouched."""
from __future__ import annotations

import random

import pytest

from dsrl.agent.environments import make_env
from dsrl.agent.envs.calculator import FEW_SHOT
from dsrl.agent.tools import TOOL_SYSTEM_PROMPT
from dsrl.data.arith import ArithSource


@pytest.fixture
def prompt():
    return ArithSource(digits=2).make_prompt((47, 38), "train")  # answer 85


def test_calculator_reset_adds_system_prompt_and_example(prompt):
    env = make_env("calculator", {"user_suffix": " Use the calculator."})
    msgs = env.reset(prompt, seed=0)
    assert msgs[0] == {"role": "system", "content": TOOL_SYSTEM_PROMPT}
    assert msgs[1:5] == FEW_SHOT and [m["role"] for m in msgs[1:5]] == ["user", "assistant", "user", "assistant"]
    assert msgs[5] == {"role": "user", "content": "Compute 47 + 38. Respond with the result only. Use the calculator."}
    assert len(msgs) == 6
    plain = make_env("calculator", {"few_shot": False, "system_prompt": ""}).reset(prompt)
    assert plain == [{"role": "user", "content": "Compute 47 + 38. Respond with the result only."}]
    with pytest.raises(ValueError, match="needs the data source's Prompt"):
        env.reset(None)


def test_calculator_tool_turn_then_correct_answer(prompt):
    env = make_env("calculator", {})
    env.reset(prompt)
    r = env.step("Let me compute. <tool>calc: 47 + 38</tool>")
    assert not r.done and r.reward == 0.0
    assert r.observation == [{"role": "user", "content": "<result>85</result>"}]
    assert r.info == {"tool_calls": 1, "tool_errors": 0}
    r = env.step("85")
    assert r.done and r.reward == pytest.approx(1.1) and r.info == {"correct": 1.0, "tool_bonus": 0.1}


def test_calculator_errors_are_observations(prompt):
    env = make_env("calculator", {"tool_bonus": 0.5})
    env.reset(prompt)
    r = env.step("<tool>calc: 47 +</tool> <tool>calc: open('x')</tool> <tool>calc: 1")
    assert not r.done
    assert r.observation[0]["content"] == ("<result>error: cannot parse '47 +'</result>\n"
                                           "<result>error: unsupported syntax: Call</result>\n"
                                           "<result>error: malformed tool call; write <tool>calc: EXPRESSION</tool></result>")
    assert r.info == {"tool_calls": 2, "tool_errors": 3}
    r = env.step("47 + 38 = 85")  # correct, but no successful call: no bonus
    assert r.done and r.reward == 1.0


def test_calculator_wrong_answer_gets_only_the_bonus(prompt):
    env = make_env("calculator", {"verifier": "gsm8k"})
    env.reset(prompt)
    env.step("<tool>calc: 47 + 38</tool>")
    r = env.step("The answer is 84.")
    assert r.done and r.reward == pytest.approx(0.1) and r.info["correct"] == 0.0


def test_calculator_rejects_unknown_verifier():
    with pytest.raises(KeyError, match="rollout.env_kwargs.verifier='nope'"):
        make_env("calculator", {"verifier": "nope"})


def test_guess_the_number_is_seeded_and_scored():
    random.seed(123)
    before = random.random()
    random.seed(123)
    envs = [make_env("guess_the_number", {"min_number": 1, "max_number": 20, "max_turns": 5}) for _ in range(3)]
    first = envs[0].reset(seed=11)
    assert "Guess The Number" in first and "between 1 and 20" in first
    assert first.endswith("\nReply with only your guess in square brackets, for example [10].")
    envs[1].reset(seed=11)
    envs[2].reset(seed=12)
    assert random.random() == before  # the global generator is left as it was
    assert envs[0].target == envs[1].target
    target = envs[0].target
    low = 1 if target > 1 else 2
    r = envs[0].step(f"I guess [{low}]")
    assert not r.done and r.observation == ("The target number is higher." if low < target else "The target number is lower.")
    r = envs[0].step(f"[{target}]")
    assert r.done and r.reward == 1.0

    env = envs[1]
    assert not env.step("no brackets").done  # first invalid move: a warning
    r = env.step("still none")
    assert r.done and r.reward == -1.0


def test_guess_the_number_runs_out_of_turns():
    env = make_env("guess_the_number", {"min_number": 1, "max_number": 20, "max_turns": 3})
    env.reset(seed=5)
    wrong = [n for n in range(1, 21) if n != env.target][:3]
    results = [env.step(f"[{n}]") for n in wrong]
    assert [r.done for r in results] == [False, False, True] and results[-1].reward == 0.0
