"""A verifiers 0.4 taskset as a prompt source (`data.name=verifiers data.taskset=MODULE`), for training
its environment through the agent endpoint (+exp=verifiers).

verifiers cannot share dsrl's venv (it pins openai<3 and mcp==2.0.0): launch/setup.sh makes
`.venv-verifiers` for it (launch/requirements-verifiers.txt), and everything that imports verifiers
runs there, in dsrl/envpkg/verifiers_episode.py: the listing of the taskset's tasks here (once, when
the source is built: a taskset that does not load is a DataError naming it and its error), and each
episode (the agent program rollout.agent="cmd: ..."), which runs the task through the environment's
harness against the episode's own base URL and posts the trace's reward.

Each prompt is one task: its messages (system prompt, prompt) for the record, and in its meta the
taskset and the task's `idx`, which is all the episode program needs. The taskset's own tasks are the
training stream (drawn with the stream's RNG); there is no held-out set (the agent endpoint's runs
turn the single-turn greedy eval off).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from dsrl.data.errors import DataError
from dsrl.data.registry import RngLike, as_random, register_source
from dsrl.data.types import Prompt

ROOT = Path(__file__).resolve().parents[2]
# The verifiers venv launch/setup.sh makes (DSRL_VERIFIERS_VENV overrides).
VENV = Path(os.environ.get("DSRL_VERIFIERS_VENV", ROOT / ".venv-verifiers"))
EPISODE_PROGRAM = ROOT / "dsrl" / "envpkg" / "verifiers_episode.py"


def verifiers_python() -> Path:
    return VENV / "bin" / "python"


def episode_command() -> str:
    """The agent program of one episode (rollout.agent="cmd: " + this)."""
    return f"{verifiers_python()} {EPISODE_PROGRAM} run"


def list_tasks(taskset: str, limit: int = 0, timeout_s: float = 300.0) -> list:
    """The taskset's tasks as dicts {idx, id, name, prompt, system_prompt}, listed by the verifiers venv."""
    py = verifiers_python()
    if not py.exists():
        raise DataError(f"data.taskset={taskset!r}: no verifiers venv at {VENV} (launch/setup.sh makes it; "
                        f"DSRL_VERIFIERS_VENV names another)")
    argv = [str(py), str(EPISODE_PROGRAM), "list", taskset] + (["--limit", str(limit)] if limit else [])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        raise DataError(f"data.taskset={taskset!r}: the verifiers taskset does not load: {tail}")
    tasks = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if not tasks:
        raise DataError(f"data.taskset={taskset!r}: the taskset yields no task")
    return tasks


@register_source("verifiers")
class VerifiersTasksetSource:
    # Rewards come from the episodes (the trace's reward, posted by the program): no verifier runs.
    default_verifier = "arith"

    def __init__(self, taskset: Optional[str] = None, num_eval: int = 0):
        if not taskset:
            raise DataError("data.taskset is required with data.name=verifiers: the verifiers taskset module")
        self.taskset = taskset
        self.tasks = list_tasks(taskset)

    @classmethod
    def check_config(cls, d) -> list:
        return [] if d.taskset else ["data.taskset is required with data.name=verifiers (a verifiers taskset module)"]

    def _prompt(self, task: dict) -> Prompt:
        messages = ([{"role": "system", "content": task["system_prompt"]}] if task.get("system_prompt") else [])
        messages += task.get("prompt") or [{"role": "user", "content": ""}]
        return Prompt(messages=messages, answer="",
                      meta={"task": "verifiers", "taskset": self.taskset, "idx": task["idx"],
                            "id": f"{self.taskset}:{task['idx']}", "name": task.get("name")})

    def sample_train(self, n: int, rng: RngLike) -> list[Prompt]:
        rng = as_random(rng)
        return [self._prompt(self.tasks[rng.randrange(len(self.tasks))]) for _ in range(n)]

    def eval_set(self, n: int) -> list[Prompt]:
        return [self._prompt(t) for t in self.tasks[:n]]

    def __repr__(self) -> str:
        return f"VerifiersTasksetSource(taskset={self.taskset!r}, tasks={len(self.tasks)})"


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m dsrl.data.verifiers_taskset MODULE
    for t in list_tasks(sys.argv[1]):
        print(t)
