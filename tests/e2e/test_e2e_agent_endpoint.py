"""`python -m dsrl.main +exp=agent_endpoint` end to end on the tiny random Llama (Hydra entry,
validation, the vLLM worker process, the DeepSpeed engine, the endpoint's HTTP server, and
examples/calculator_agent.py calling it through the real `openai` client), shortened; and the
endpoint's config errors, raised before any model loads and naming the key."""
import json

import pytest
from agent_e2e_kit import SHORT, assert_config_errors_before_loading, run_exp


def _run(args, timeout):
    return run_exp("agent_endpoint", args, timeout)


@pytest.mark.slow
@pytest.mark.e2e
def test_agent_endpoint_job_runs(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    r = _run([*SHORT, f"model.path={tiny_model_path}", f"hydra.run.dir={run_dir}"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "agent endpoint: serving http://127.0.0.1:" in r.stdout + r.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # every episode's agent ran to its reward through the endpoint, nothing was refused
        assert row["agent/finish_rewarded"] == 1.0 and row["agent/refused_requests"] == 0.0
        assert row["agent/calls"] >= 1.0 and row["agent/split_episodes"] == 0.0
        assert row["rollout/response_length"] == pytest.approx(row["agent/model_tokens"])
        # the trained tokens are the sampled ones: the trainer's log-probs of them equal vLLM's (float32)
        assert row["rollout/logprob_diff"] < 1e-3 and row.get("rollout/sync_logprob_diff", 0.0) < 1e-4
        assert row["timing/old_logprobs"] == 0.0  # reuse on (the preset)
        assert row["train/grad_norm"] > 0


@pytest.mark.parametrize("overrides, fragments", [
    # validation collects every error of a config: one run checks them all
    (["rollout.agent=no/such/agent.py:run", "rollout.env=calculator", "algo.global_batch_size=32",
      "trainer.eval_after=true", "rollout.agent_timeout_s=0"],
     ["rollout.agent='no/such/agent.py:run': no file",
      "rollout.env='calculator' and rollout.agent_endpoint=true: choose one",
      "algo.global_batch_size=32 must equal algo.rollout_batch_size * algo.n_samples_per_prompt=64 with "
      "rollout.agent_endpoint=true",
      "trainer.eval_after=true does not apply to multi-turn episodes (rollout.agent_endpoint=true)",
      "rollout.agent_timeout_s=0.0 must be > 0"]),
    (["rollout.agent_endpoint=false"], ["rollout.agent='examples/calculator_agent.py:run' is set but "
                                        "rollout.agent_endpoint=false"]),
])
def test_config_errors_fail_before_any_model_loads(tmp_path, overrides, fragments):
    assert_config_errors_before_loading("agent_endpoint", tmp_path, overrides, fragments)
