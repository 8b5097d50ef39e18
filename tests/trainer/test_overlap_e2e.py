"""A short real run with overlap and dynamic sampling together: the Hydra entry point, a real
vLLM worker and DeepSpeed engine on the tiny random model (its rewards are all 0: every group is
all-equal, so each step runs max_sampling_rounds rounds and trains filler groups), eval after
training, and a checkpoint that holds the next step's finished rollout. The full-length learning
check on SmolLM2 (30 steps of the default job) is `make bench-overlap-learn`."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsrl.testing import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_overlap_with_dynamic_sampling_runs_and_logs(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", f"model.path={tiny_model_path}",
           "trainer.total_steps=2", "trainer.save_every=1", "trainer.keep_checkpoints=0",
           "trainer.eval_before=false", "data.num_eval=4",
           "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=4", "algo.global_batch_size=8",
           "rollout.max_new_tokens=8", "model.dtype=float32", "rollout.dtype=float32", "actor.lr=1e-4",
           "algo.entropy_coef=0.01", "algo.off_policy_steps=1", "algo.use_rollout_logprobs=true",
           "algo.dynamic_sampling=true", "algo.max_sampling_rounds=2", "logger.plot=false",
           f"hydra.run.dir={run_dir}"]
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    r = subprocess.run(cmd, cwd=Path(__file__).parents[2], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert [row["rollout/staleness"] for row in rows] == [0.0, 1.0]
    for row in rows:
        assert row["reward/mean"] == 0.0  # random model: nothing is correct
        assert row["rollout/sampling_rounds"] == 2.0
        assert (row["rollout/kept_groups"], row["rollout/dropped_groups"], row["rollout/filler_groups"]) == (0, 2, 2)
        assert row["train/grad_norm"] > 0  # the entropy bonus trains the filler groups
    assert "found 0 of algo.rollout_batch_size=2 informative groups" in r.stdout + r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "eval/accuracy_after" in summary
    # After step 1 the rollout of step 2 (made with the initial weights) is in the checkpoint;
    # after the last step there is none.
    ckpts = run_dir / "checkpoints"
    step, rollout = torch.load(ckpts / "step-000001" / "rank-0.pt", weights_only=False)["trainer"]["next_rollout"]
    assert step == 2 and rollout.weights_step == 0 and len(rollout.samples) == 2 * 4
    last = torch.load(ckpts / "step-000002" / "rank-0.pt", weights_only=False)["trainer"]
    assert last["next_rollout"] is None
