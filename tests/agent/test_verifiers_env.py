"""A verifiers 0.4 environment trains in dsrl (+exp=verifiers): the taskset's tasks are the prompts,
listed by the verifiers venv (.venv-verifiers, made by launch/setup.sh); each episode is a program in
that venv (dsrl/envpkg/verifiers_episode.py) that runs the task through verifiers' `null` harness
against the episode's own base URL on the agent endpoint (verifiers' eval client streams every Chat
Completions call) and posts the trace's reward.

The taskset is an offline one of the tests (tests/agent/vf_tasksets: eight "Reply with the digit N."
tasks, one reward; its `dsrl_digits_failing` twin's reward raises on the tasks of odd idx)."""
import json
import os
import sys
from pathlib import Path

import pytest

from dsrl.data import DataError, PromptStream, make_source
from dsrl.errors import ConfigError
from dsrl.testing import compose_config
from dsrl.validation.validate import validate

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from agent_e2e_kit import run_exp  # noqa: E402

ROOT = Path(__file__).parents[2]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
TASKSETS = Path(__file__).parent / "vf_tasksets"
DIGITS = [3, 5, 1, 8, 2, 9, 4, 7]

pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason="no .venv-verifiers: run `make setup` (launch/setup.sh)")


@pytest.fixture
def tasksets_on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TASKSETS), os.environ.get("PYTHONPATH")])))


def test_the_tasksets_tasks_are_the_prompts(tasksets_on_path):
    src = make_source("verifiers", taskset="dsrl_digits_taskset")
    prompts = src.eval_set(8)
    assert [p.messages for p in prompts] == [[{"role": "user", "content": f"Reply with the digit {d}."}] for d in DIGITS]
    assert [(p.meta["taskset"], p.meta["idx"]) for p in prompts] == [("dsrl_digits_taskset", i) for i in range(8)]
    draws = [p.meta["idx"] for p in PromptStream(src, seed=3).next(6)]
    assert draws == [p.meta["idx"] for p in PromptStream(src, seed=3).next(6)]  # same seed, same tasks
    with pytest.raises(DataError, match=r"data.taskset='no_such_taskset_here': the verifiers taskset does not load: "
                                        r".*taskset 'no_such_taskset_here' not found"):
        make_source("verifiers", taskset="no_such_taskset_here")


def test_the_preset_needs_a_taskset():
    with pytest.raises(ConfigError, match="data.taskset is required with data.name=verifiers"):
        validate(compose_config("+exp=verifiers"))


@pytest.mark.slow
@pytest.mark.e2e
def test_verifiers_environment_trains(tmp_path, smollm2_path, tasksets_on_path):
    """2 steps of 2 tasks x 3 episodes on SmolLM2 with the failing twin: the episodes whose reward raised
    fail (reward 0, counted), the run goes on; every other episode's trained reward is its trace's
    reward; the streamed calls are recorded token-exactly (each episode one sequence, the trainer's
    log-probs of the trained tokens equal the engine's sampling log-probs)."""
    traces = tmp_path / "traces.jsonl"
    run_dir = tmp_path / "run"
    os.environ["DSRL_VERIFIERS_TRACES"] = str(traces)
    try:
        r = run_exp("verifiers", ["data.taskset=dsrl_digits_failing", "data.seed=1", "trainer.total_steps=2",
                                  "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=3",
                                  "algo.global_batch_size=6", "rollout.max_new_tokens=16", "model.dtype=float32",
                                  "rollout.dtype=float32", "trainer.save_final=false", "logger.plot=false",
                                  "logger.tensorboard=false", f"model.path={smollm2_path}",
                                  f"hydra.run.dir={run_dir}"], timeout=900)
    finally:
        del os.environ["DSRL_VERIFIERS_TRACES"]
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    episodes = [json.loads(line) for line in traces.read_text().splitlines()]
    print("rewards", [row["agent/reward"] for row in rows], "episodes", episodes)
    assert [row["step"] for row in rows] == [1, 2] and len(episodes) == 12
    for row, step in zip(rows, (episodes[:6], episodes[6:])):  # a round ends when all its programs have
        # Failed episodes (not ok: no reward posted) train with reward 0; the others with their trace's.
        assert row["agent/reward"] == pytest.approx(sum(e["reward"] for e in step if e["ok"]) / 6, abs=1e-9)
        assert row["agent/failed_episodes"] == pytest.approx(sum(not e["ok"] for e in step) / 6, abs=1e-9)
        assert row["agent/refused_requests"] == 0.0 and row["agent/split_episodes"] == 0.0
        assert row["agent/calls"] >= 1.0
        # The trainer's log-probs of the trained tokens against the engine's sampling log-probs: logged
        # when the step trains a token (a step whose episodes all got one reward has zero advantages).
        if "rollout/logprob_diff" in row:
            assert row["rollout/logprob_diff"] < 1e-3
        else:
            assert len({e["reward"] for e in step}) == 1, row
    assert all(e["ok"] == (e["idx"] % 2 == 0) for e in episodes)
    failed = [e for e in episodes if not e["ok"]]
    assert failed and all("raises (on purpose)" in " ".join(e["errors"]) for e in failed)
    # the streamed replies reached the harness whole: each ok episode's reward is its reply's score
    digits = {i: d for i, d in enumerate(DIGITS)}
    assert all(e["reply"] for e in episodes if e["ok"]), episodes
    assert all(e["reward"] == float(str(digits[e["idx"]]) in e["reply"]) for e in episodes if e["ok"])
