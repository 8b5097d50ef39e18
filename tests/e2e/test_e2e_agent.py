"""`python -m dsrl.main +exp=agent_tools` end to end (Hydra entry, validation, vLLM worker
processes, DeepSpeed engine, the calculator environment) on the tiny random Llama, shortened;
and config errors of the multi-turn keys failing before any model loads, naming the key."""
import json

import pytest
from agent_e2e_kit import SHORT, assert_config_errors_before_loading, run_exp


def _run(args, timeout):
    return run_exp("agent_tools", args, timeout)


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
        assert row["rollout/logprob_diff"] < 1e-3 and row.get("rollout/sync_logprob_diff", 0.0) < 1e-4
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
    assert_config_errors_before_loading("agent_tools", tmp_path, overrides, fragments)
