"""The end of an episode for the framework agents of this folder (they run in the frameworks' own venv,
without dsrl): the reward (1 for the right number, +0.1 when the tool ran at least once without an
error), POSTed to DSRL_REWARD_URL, and with `--log FILE` one JSON line per episode."""
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from calculator_agent import TOOL_BONUS, calc, first_number  # noqa: E402,F401  (calc: for the agents)

# One worked exchange put before the question: a 135M model imitates a demonstrated tool call, not a
# described one (as in examples/calculator_agent.py).
DEMO_QUESTION, DEMO_EXPRESSION, DEMO_RESULT = "Compute 12 + 30. Respond with the result only.", "12 + 30", "42"


def finish(framework: str, task: dict, answer, tool_calls: list) -> float:
    used_tool = any(not calc(c).startswith("error") for c in tool_calls)
    reward = float(first_number(str(answer)) == float(task["answer"])) + (TOOL_BONUS if used_tool else 0.0)
    request = urllib.request.Request(os.environ["DSRL_REWARD_URL"], data=json.dumps({"reward": reward}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()
    if "--log" in sys.argv:
        with open(sys.argv[sys.argv.index("--log") + 1], "a") as f:
            f.write(json.dumps({"framework": framework, "tool_calls": tool_calls, "tool_ran": used_tool,
                                "answer": str(answer), "reward": reward}) + "\n")
    return reward
