"""A program agent that runs one of the framework agents of examples/frameworks/ per episode, by the
parity of the episode's index in its round (DSRL_EPISODE_ID = "r<round>-e<index>"): LangChain for
even indices, the OpenAI Agents SDK for odd ones. With 8 episodes per question, each GRPO group
holds both frameworks. Runs in .venv-agents; its arguments go to the framework agent (e.g. --log)."""
import os
import sys

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "frameworks")
PROGRAMS = ("langchain_calculator.py", "agents_sdk_calculator.py")

index = int(os.environ["DSRL_EPISODE_ID"].rsplit("-e", 1)[1])
program = os.path.normpath(os.path.join(FOLDER, PROGRAMS[index % 2]))
os.execv(sys.executable, [sys.executable, program, *sys.argv[1:]])  # stdin (the task) goes with it
