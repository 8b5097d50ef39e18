"""Tool-use task: a question from the data source (arith or GSM8K) answered with the help of a
calculator tool (dsrl.agent.tools).

Each model turn either calls the tool (one or more `<tool>calc: EXPR</tool>`, or a broken
`<tool>` tag): the environment answers with `<result>...</result>` (an error text for a bad
call) and the episode goes on; or it contains no tool tag: that is the final answer, scored by
the verifier (`verifier`, e.g. "arith" first number / "gsm8k" last number) and the episode ends.

`few_shot` (default on) puts one worked exchange before the question, as real chat turns (a
question, the tool call, its result, the answer): SmolLM2-135M ignores a tool described only in
the system prompt (0 calls in 32 episodes) but imitates a demonstrated one.

Reward of an episode: 1.0 for a correct final answer, plus `tool_bonus` (default 0.1) when at
least one tool call in it returned a result (not an error) and the answer was given. An
episode cut by max_turns or the token budget gets 0."""
from __future__ import annotations

from typing import Any, Optional

from dsrl.agent.env import StepResult, register_env
from dsrl.agent.tools import (MAX_CALLS_PER_TURN, TOOL_SYSTEM_PROMPT, parse_tool_calls, run_tool_call,
                              tool_results_message)


# One worked exchange in the arith task's own phrasing (dsrl.data.arith.ArithSource.template).
FEW_SHOT = [{"role": "user", "content": "Compute 12 + 30. Respond with the result only."},
            {"role": "assistant", "content": "<tool>calc: 12 + 30</tool>"},
            {"role": "user", "content": "<result>42</result>"},
            {"role": "assistant", "content": "42"}]


@register_env("calculator")
class CalculatorEnv:
    def __init__(self, verifier: str = "arith", tool_bonus: float = 0.1, system_prompt: str = TOOL_SYSTEM_PROMPT,
                 user_suffix: str = "", few_shot: bool = True):
        from dsrl.reward import get_verifier  # built-in verifiers register when dsrl.reward is imported

        self.verify = get_verifier(verifier, "rollout.env_kwargs.verifier")
        self.tool_bonus = float(tool_bonus)
        self.system_prompt = system_prompt
        self.user_suffix = user_suffix
        self.few_shot = bool(few_shot)
        self.prompt: Any = None
        self.good_calls = 0
        self.calls = 0

    def reset(self, prompt: Any = None, seed: Optional[int] = None):
        if prompt is None or not hasattr(prompt, "messages"):
            raise ValueError("calculator environment: reset() needs the data source's Prompt (rollout.env=calculator "
                             "takes its questions from `data`)")
        self.prompt, self.good_calls, self.calls = prompt, 0, 0
        msgs = [dict(m) for m in prompt.messages if m["role"] != "system"]
        if self.user_suffix and msgs and msgs[-1]["role"] == "user":
            msgs[-1]["content"] = msgs[-1]["content"] + self.user_suffix
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return head + ([dict(m) for m in FEW_SHOT] if self.few_shot else []) + msgs

    def step(self, action: str) -> StepResult:
        calls, malformed = parse_tool_calls(action)
        if calls or malformed:
            results, ok = [], 0
            for call in calls[:MAX_CALLS_PER_TURN]:
                text, good = run_tool_call(call)
                results.append(text)
                ok += good
            if len(calls) > MAX_CALLS_PER_TURN:
                results.append(f"error: at most {MAX_CALLS_PER_TURN} calls per turn")
            if malformed:
                results.append("error: malformed tool call; write <tool>calc: EXPRESSION</tool>")
            self.calls += len(calls)
            self.good_calls += ok
            return StepResult(observation=[{"role": "user", "content": tool_results_message(results)}],
                              info={"tool_calls": len(calls), "tool_errors": len(results) - ok})
        correct = float(self.verify(action, self.prompt))
        bonus = self.tool_bonus if self.good_calls > 0 else 0.0
        return StepResult(observation="", reward=correct + bonus, done=True,
                          info={"correct": correct, "tool_bonus": bonus})
