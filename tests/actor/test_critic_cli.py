"""`python -m dsrl.main algo.advantage_estimator=gae` end to end on the tiny model: the Hydra entry
point, validation, the actor and the critic on their own DeepSpeed engines, two RL steps and a
checkpoint holding the critic. rollout.backend=hf (the actor's module generates) keeps it under a
minute; the same command on the default vLLM worker took 68 s here (its engine start is ~35 s)."""
import pytest

from dsrl.testing import run_job

CRITIC_KEYS = ("critic/value_loss", "critic/value_clipfrac", "critic/explained_variance", "critic/values",
               "critic/returns", "critic/grad_norm", "critic/skipped_steps", "timing/critic_values",
               "timing/critic_train")


@pytest.mark.slow
def test_gae_job_runs_from_the_command_line(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    cmd = ["-m", "dsrl.main", "algo.advantage_estimator=gae", "trainer.total_steps=2",
           f"model.path={tiny_model_path}", "model.dtype=float32", "rollout.backend=hf", "algo.gamma=0.9",
           "algo.gae_lambda=0.95", "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=4",
           "algo.global_batch_size=8", "rollout.max_new_tokens=8", "trainer.eval_before=false",
           "trainer.eval_after=false", "trainer.save_every=2", "logger.plot=false", "logger.tensorboard=false",
           f"hydra.run.dir={run_dir}"]
    rows = run_job(cmd, run_dir, timeout=600)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        missing = [k for k in CRITIC_KEYS if k not in row]
        assert not missing, missing
        assert row["critic/grad_norm"] > 0 and row["critic/value_clipfrac"] == 0.0
        assert row["timing/critic_values"] > 0 and row["timing/critic_train"] > 0
    assert rows[0]["critic/values"] != rows[1]["critic/values"]  # the critic trained between the steps
    # The run log says what the critic changes for reuse.
    assert "the critic of algo.advantage_estimator=gae does not change this" in (run_dir / "run.log").read_text()
    ckpt = run_dir / "checkpoints" / "step-000002"
    assert (ckpt / "COMPLETE.json").exists() and any((ckpt / "critic").iterdir())
    assert (run_dir / "final_model" / "model.safetensors").exists()
