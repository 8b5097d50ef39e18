"""Agents written with widely used agent frameworks train through the endpoint unchanged: each is a
program (rollout.agent="cmd: ...") in the frameworks' own venv (.venv-agents, made by
launch/setup.sh from launch/requirements-agents.txt), configured only through the `openai`
client's OPENAI_BASE_URL / OPENAI_API_KEY, with a function tool:

- LangChain (ChatOpenAI + bind_tools): Chat Completions, tools, unstreamed;
- the OpenAI Agents SDK: the Responses API (its default), every call streamed.

`python -m dsrl.main +exp=agent_endpoint` on SmolLM2-135M-Instruct (float32), 2 steps of 2 questions
x 4 episodes: both steps train, no request is refused, every episode posts its reward, at least one
tool call is executed, and the trained sequences are token-exact: every episode is one sequence
(no split: each call continued the previous one's tokens) and the trainer's log-probs of the
trained tokens equal the engine's sampling log-probs (rollout/logprob_diff, or the weight sync's
rollout/sync_logprob_diff where the run measures that instead)."""
import json
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from agent_e2e_kit import run_exp  # noqa: E402

ROOT = Path(__file__).parents[2]
PYTHON = ROOT / ".venv-agents" / "bin" / "python"
RUN = ["trainer.total_steps=2", "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=4", "algo.global_batch_size=8",
       "rollout.max_new_tokens=48", "rollout.max_episode_tokens=200", "rollout.max_turns=3",
       "model.dtype=float32", "rollout.dtype=float32", "trainer.save_every=0", "trainer.save_final=false",
       "logger.plot=false", "logger.tensorboard=false"]

pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(not PYTHON.exists(), reason="no .venv-agents: run `make setup` (launch/setup.sh)")]


@pytest.mark.parametrize("program, framework", [("langchain_calculator.py", "langchain"),
                                                ("agents_sdk_calculator.py", "openai-agents")])
def test_framework_agent_trains(tmp_path, smollm2_path, program, framework):
    log = tmp_path / "episodes.jsonl"
    agent = f"cmd: {shlex.quote(str(PYTHON))} {ROOT / 'examples' / 'frameworks' / program} --log {log}"
    run_dir = tmp_path / "run"
    r = run_exp("agent_endpoint", [*RUN, f"rollout.agent='{agent}'", f"model.path={smollm2_path}",
                                   f"hydra.run.dir={run_dir}"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    print(f"{framework}: rewards {[row['agent/reward'] for row in rows]}, calls {[row['agent/calls'] for row in rows]}, "
          f"tool calls {[e['tool_calls'] for e in episodes]}, answers {[e['answer'] for e in episodes]}")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["agent/refused_requests"] == 0.0 and row["agent/finish_rewarded"] == 1.0
        assert row["agent/split_episodes"] == 0.0 and row["agent/calls"] >= 1.0
        assert row["train/grad_norm"] > 0
    # the trainer's log-probs of the trained tokens vs the engine's (logged where the run measures them)
    diffs = [row[k] for row in rows for k in ("rollout/logprob_diff", "rollout/sync_logprob_diff") if k in row]
    assert diffs and max(diffs) < 1e-3, diffs
    assert len(episodes) == 16 and {e["framework"] for e in episodes} == {framework}
    assert any(e["tool_ran"] for e in episodes)  # a tool call was executed (and its expression evaluated)
