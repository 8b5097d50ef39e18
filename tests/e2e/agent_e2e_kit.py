"""Shared by the multi-turn e2e tests (test_e2e_agent.py, test_e2e_agent_endpoint.py): the shortened
job on the tiny model, the entry point run for an `+exp=` preset, and the check that config errors
fail before any model loads."""
import subprocess
import sys
from pathlib import Path

from dsrl.testing import subprocess_env

ROOT = Path(__file__).parents[2]
# rewards of a random model are all 0: the entropy term makes every sample train
SHORT = ["trainer.total_steps=2", "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=4",
         "algo.global_batch_size=8", "rollout.max_new_tokens=8", "rollout.max_episode_tokens=64",
         "model.dtype=float32", "rollout.dtype=float32", "algo.entropy_coef=0.01"]


def run_exp(exp: str, args, timeout):
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "dsrl.main", f"+exp={exp}", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=timeout)


def assert_config_errors_before_loading(exp: str, tmp_path, overrides, fragments) -> None:
    """Exit code 2 with every error named; the model path does not even exist (nothing loaded)."""
    r = run_exp(exp, [*overrides, f"model.path={tmp_path / 'no_model_here'}", f"hydra.run.dir={tmp_path / 'run'}"],
                timeout=300)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    for fragment in fragments:
        assert fragment in r.stderr, r.stderr[-3000:]
    assert "Loading weights" not in r.stdout + r.stderr
