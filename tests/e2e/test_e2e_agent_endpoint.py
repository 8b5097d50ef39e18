"""`python -m dsrl.main +exp=agent_endpoint` end to end on the tiny random Llama (Hydra entry,
validation, the vLLM worker process, the DeepSpeed engine, the endpoint's HTTP server, and
examples/calculator_agent.py calling it through the real `openai` client), shortened; and the
endpoint's config errors, raised before any model loads and naming the key."""
import json
import statistics

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
        assert row["rollout/logprob_diff"] < 1e-3 and row["rollout/sync_logprob_diff"] < 1e-4
        assert row["timing/old_logprobs"] == 0.0  # reuse on (the preset)
        assert row["train/grad_norm"] > 0


# The preset as shipped (SmolLM2, examples/calculator_agent.py through the `openai` client, dtype auto),
# shortened: 2 questions x 8 episodes per step, 8 steps, lr 5e-5 (the preset's 1e-5 needs ~15 steps
# of 64 episodes), no checkpoints
LEARN_STEPS = 8
HALF = LEARN_STEPS // 2
LEARN = ["algo.rollout_batch_size=2", "algo.global_batch_size=16", "actor.lr=5e-5", f"trainer.total_steps={LEARN_STEPS}",
         "trainer.save_every=0", "trainer.save_final=false", "logger.plot=false", "logger.tensorboard=false"]


@pytest.mark.slow
@pytest.mark.e2e
def test_example_agent_learns_through_the_endpoint(tmp_path, smollm2_path):
    """Issue 19 §3: the calculator agent written against the `openai` client learns 2-digit sums
    through the endpoint: last-4 mean reward at least 0.3 above the first 4. Measured
    (AMD EPYC, bf16): 10 steps ~70 s on one core, rewards 0.2 0 0.36 0.59 1.02 | 1.03 1.1 1.03 1.1 1.1; 8 steps
    42 s on 2 idle cores, rewards 0.2 0 0.36 0.6 | 1.09 1.03 1.1 1.03, first-4 0.29 -> last-4 1.06, by
    calling the tool (calls per episode rise towards 2: one tool call, then the answer)."""
    run_dir = tmp_path / "run"
    r = _run([*LEARN, f"model.path={smollm2_path}", f"hydra.run.dir={run_dir}"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, LEARN_STEPS + 1))
    assert all(row["agent/refused_requests"] == 0.0 and row["agent/split_episodes"] == 0.0 for row in rows)
    rewards = [row["agent/reward"] for row in rows]
    calls = [row["agent/calls"] for row in rows]
    print(f"calculator agent through the endpoint: rewards {[round(r, 2) for r in rewards]}, "
          f"calls {[round(c, 2) for c in calls]}")
    assert statistics.mean(rewards[-HALF:]) - statistics.mean(rewards[:HALF]) >= 0.3, rewards
    assert statistics.mean(calls[-HALF:]) >= 1.5 > statistics.mean(calls[:2]), calls


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
