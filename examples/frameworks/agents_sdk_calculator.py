"""A calculator agent written with the OpenAI Agents SDK (`openai-agents`), trained by dsrl through its
endpoint with no dsrl import: a program agent, run once per episode,

    rollout.agent="cmd: .venv-agents/bin/python examples/frameworks/agents_sdk_calculator.py"

The SDK is configured only through the `openai` client's settings, OPENAI_BASE_URL and
OPENAI_API_KEY (dsrl sets both to the episode's own base URL and token). It uses the Responses API
(the SDK's default) and streams each model call (Runner.run_streamed). The task (the question and
its answer) comes on stdin as JSON; the reward goes to DSRL_REWARD_URL: 1 for the right number, +0.1
when the tool ran. `--log FILE` appends one JSON line per episode (tool calls, answer, reward)."""
import asyncio
import json
import os
import sys

from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from episode_end import DEMO_EXPRESSION, DEMO_QUESTION, DEMO_RESULT, calc, finish  # noqa: E402

set_tracing_disabled(True)  # traces would go to OpenAI's servers
calls = []


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "12 * (3 + 4)"."""
    calls.append(expression)
    return calc(expression)


# tool_choice names the tool for the first call; the SDK resets it after a tool call (reset_tool_choice)
agent = Agent(name="calculator", instructions="Use the calculate tool, then reply with the number only.",
              tools=[calculate], model="policy", model_settings=ModelSettings(tool_choice="calculate"))


async def main() -> None:
    task = json.load(sys.stdin)
    demo = [{"role": "user", "content": DEMO_QUESTION},  # a worked exchange first
            {"type": "function_call", "call_id": "demo", "name": "calculate",
             "arguments": json.dumps({"expression": DEMO_EXPRESSION})},
            {"type": "function_call_output", "call_id": "demo", "output": DEMO_RESULT},
            {"role": "assistant", "content": DEMO_RESULT}]
    question = demo + [{"role": "user", "content": task["messages"][-1]["content"]}]
    answer = None
    try:
        result = Runner.run_streamed(agent, question, max_turns=3)
        async for _ in result.stream_events():
            pass
        answer = str(result.final_output)
    except Exception as e:  # e.g. MaxTurnsExceeded: the episode's answer is missing, its reward 0
        answer = f"error: {type(e).__name__}"
    finish("openai-agents", task, answer, calls)


asyncio.run(main())
