"""A calculator agent written with LangChain (`langchain-openai`'s ChatOpenAI, function tools through
`bind_tools`), trained by dsrl through its endpoint with no dsrl import: a program agent,

    rollout.agent="cmd: .venv-agents/bin/python examples/frameworks/langchain_calculator.py"

ChatOpenAI is configured only through the `openai` client's settings, OPENAI_BASE_URL and
OPENAI_API_KEY (dsrl sets both per episode); it uses Chat Completions, unstreamed. The first call
names the tool (tool_choice), the tool runs, the second call answers. The task comes on stdin as
JSON; the reward goes to DSRL_REWARD_URL: 1 for the right number, +0.1 when the tool ran. `--log
FILE` appends one JSON line per episode (tool calls, answer, reward)."""
import json
import os
import sys

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from episode_end import DEMO_EXPRESSION, DEMO_QUESTION, DEMO_RESULT, calc, finish  # noqa: E402

calls = []


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "12 * (3 + 4)"."""
    calls.append(expression)
    return calc(expression)


def main() -> None:
    task = json.load(sys.stdin)
    llm = ChatOpenAI(model="policy", max_retries=0)
    messages = [SystemMessage("Use the calculate tool, then reply with the number only."),
                HumanMessage(DEMO_QUESTION),  # a worked exchange first
                AIMessage("", tool_calls=[{"name": "calculate", "args": {"expression": DEMO_EXPRESSION}, "id": "demo"}]),
                ToolMessage(DEMO_RESULT, tool_call_id="demo"), AIMessage(DEMO_RESULT),
                HumanMessage(task["messages"][-1]["content"])]
    reply = llm.bind_tools([calculate], tool_choice="calculate").invoke(messages)
    messages.append(reply)
    for call in reply.tool_calls:
        try:
            messages.append(calculate.invoke(call))  # a ToolMessage
        except Exception as e:  # arguments that do not fit the tool's schema
            messages.append(ToolMessage(f"error: {e}", tool_call_id=call["id"]))
    answer = llm.bind_tools([calculate]).invoke(messages).content if reply.tool_calls else reply.content
    finish("langchain", task, answer, calls)


main()
