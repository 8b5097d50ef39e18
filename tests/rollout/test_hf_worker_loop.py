"""The real GRPO loop (dsrl.main, DeepSpeed actor) with rollout.backend=hf on the tiny model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.testing import subprocess_env

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_grpo_steps_with_the_hf_rollout_backend(tmp_path, tiny_model_path):
    """Two steps, no vLLM anywhere: the sampling log-probs of step 2 (after the push of step 1's
    update, made large by lr=1e-2 under Adam) agree with the trainer's to fp32 round-off, so the
    push reached the worker; step 1 agrees too (same initial weights)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", "rollout.backend=hf", "trainer.total_steps=2",
           "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=4", "algo.global_batch_size=8",
           "rollout.max_new_tokens=6", "actor.lr=1e-2", "algo.entropy_coef=0.01", "model.dtype=float32",
           "rollout.dtype=float32", f"model.path={tiny_model_path}", "trainer.eval_before=false",
           "trainer.eval_after=false", f"hydra.run.dir={run_dir}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=subprocess_env(DS_ACCELERATOR="cpu", RAY_AUTH_MODE="disabled"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout/logprob_diff"] < 1e-5, row["rollout/logprob_diff"]
        assert row.get("rollout/sync_logprob_diff", 0.0) < 1e-5  # the weight sync's own probe
        assert row["train/grad_norm"] > 0 and row["rollout/response_length"] > 0
