"""A calculator-tool agent written against the `openai` client only (no dsrl import), trained by
dsrl through its OpenAI-compatible endpoint:

    python -m dsrl.main +exp=agent_endpoint      # rollout.agent=examples/calculator_agent.py:run

dsrl calls `run(base_url, episode_id, task)` once per episode. The agent keeps its conversation
and sends all of it on every call (so dsrl trains each episode as one token-exact sequence), runs
the tool itself, checks its final answer against task["answer"] and posts the reward.

Tool syntax (SmolLM2's chat template has no tool format): the model writes
<tool>calc: 12 + 30</tool>, the agent answers <result>42</result>. Reward: 1 for a correct final
answer, + 0.1 when a tool call returned a result before it (0 when the turns run out)."""
from __future__ import annotations

import ast
import operator
import re

import httpx
import openai

SYSTEM = ("You can use a calculator. To use it, write <tool>calc: EXPRESSION</tool>, for example "
          "<tool>calc: 12 * (3 + 4)</tool>, and you will receive <result>84</result>. "
          "When you know the answer, reply with the number only.")
# One worked exchange: a 135M model imitates a demonstrated tool, not a described one.
FEW_SHOT = [{"role": "user", "content": "Compute 12 + 30. Respond with the result only."},
            {"role": "assistant", "content": "<tool>calc: 12 + 30</tool>"},
            {"role": "user", "content": "<result>42</result>"},
            {"role": "assistant", "content": "42"}]
MAX_TURNS = 3
TOOL_BONUS = 0.1
CALL = re.compile(r"<tool>\s*calc\s*:(.*?)</tool>", re.DOTALL)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ECHO = re.compile(r"^[\s*_`(]*(?:-?\d[\d,]*\s*[-+*/x]\s*)+-?\d[\d,]*[\s*_`)]*=")  # "3 + 5 = 8": skip "3 + 5 ="


def calc(expr: str) -> str:
    """+ - * / on numbers, from the syntax tree (never eval)."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")
    try:
        if len(expr) > 200:
            raise ValueError("expression too long")
        value = ev(ast.parse(expr.strip(), mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def first_number(text: str):
    m = ECHO.match(text)
    found = NUMBER.findall(text[m.end():] if m else text)
    return float(found[0].replace(",", "")) if found else None


def run(base_url: str, episode_id: str, task: dict) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600,
                           default_headers={"X-Episode-Id": episode_id})
    question = [m for m in task["messages"] if m["role"] != "system"]
    messages = [{"role": "system", "content": SYSTEM}, *FEW_SHOT, *question]
    reward, used_tool = 0.0, False
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        calls = CALL.findall(reply)
        if not calls and "<tool>" not in reply:  # the final answer
            correct = first_number(reply) == float(task["answer"])
            reward = float(correct) + (TOOL_BONUS if used_tool else 0.0)
            break
        results = [calc(c) for c in calls[:4]] or ["error: malformed tool call; write <tool>calc: EXPRESSION</tool>"]
        used_tool = used_tool or any(not r.startswith("error") for r in results)
        messages.append({"role": "user", "content": "\n".join(f"<result>{r}</result>" for r in results)})
    httpx.post(f"{base_url}/episodes/{episode_id}/reward", json={"reward": reward}, timeout=60).raise_for_status()
