"""`python -m dsrl.main +exp=agent_tools` end to end (Hydra entry, validation, vLLM worker
processes, DeepSpeed engine, the calculator environment) on the tiny random Llama, shortened;
and config errors of the multi-turn keys failing before any model loads, naming the key."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.testing import subprocess_env

ROOT = Path(__file__).parents[2]
SHORT = ["trainer.total_steps=2", "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=4",
         "algo.global_batch_size=8", "rollout.max_new_tokens=8", "rollout.max_episode_tokens=64",
         "model.dtype=float32", "rollout.dtype=float32", "algo.entropy_coef=0.01"]


def _run(args, timeout):
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "dsrl.main", "+exp=agent_tools", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
@pytest.mark.e2e
def test_agent_tools_job_runs(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    r = _run([*SHORT, f"model.path={tiny_model_path}", f"hydra.run.dir={run_dir}"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key in ("agent/reward", "agent/turns", "agent/tool_calls", "agent/model_tokens", "agent/env_tokens"):
            assert key in row, key
        assert row["reward/mean"] == pytest.approx(row["agent/reward"])
        assert row["rollout/response_length"] == pytest.approx(row["agent/model_tokens"])
        assert row["rollout/logprob_diff"] < 1e-3 and row["rollout/sync_logprob_diff"] < 1e-4
        assert row["timing/old_logprobs"] == 0.0  # reuse on (the preset)
        assert row["train/grad_norm"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "reward/first5" in summary and "eval/accuracy_before" not in summary  # eval is off for episodes
    assert (run_dir / "final_model" / "model.safetensors").exists()


@pytest.mark.parametrize("overrides, fragments", [
    (["rollout.env=no_such_env", "rollout.max_turns=0"],
     ["rollout.env='no_such_env': unknown environment", "rollout.max_turns=0 must be >= 1"]),
    (["algo.advantage_estimator=gae"], ["algo.advantage_estimator=gae does not apply to multi-turn episodes"]),
    (["trainer.eval_after=true", "algo.reuse_logprobs=adaptive"],
     ["trainer.eval_after=true does not apply", "algo.reuse_logprobs='adaptive' does not apply"]),
])
def test_config_errors_fail_before_any_model_loads(tmp_path, overrides, fragments):
    """Exit code 2 with every error named; the model path does not even exist (nothing loaded)."""
    r = _run([*overrides, f"model.path={tmp_path / 'no_model_here'}", f"hydra.run.dir={tmp_path / 'run'}"],
             timeout=300)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    for fragment in fragments:
        assert fragment in r.stderr, r.stderr[-3000:]
    assert "Loading weights" not in r.stdout + r.stderr
