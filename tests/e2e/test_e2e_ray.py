"""End to end with Ray-placed engines: 2 DeepSpeed ranks (ZeRO-3, `deepspeed --num_gpus 2`, the
tiny Llama) share 2 vLLM engines that are Ray actors of a private Ray cluster
(`rollout.placement=ray rollout.num_engines=2 rollout.ray_address=local`: rank 0 starts it and
the engines, rank 1 joins and looks them up). Two steps; after every weight sync each engine's
probe log-probs match the trainer's (rollout/sync_logprob_diff is the largest over engines),
the sampled log-probs agree too, and both engines served prompts every step."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.distributed.ports import free_port
from dsrl.testing import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ARGS = ["+exp=grpo_reuse", "trainer.total_steps=2", "algo.rollout_batch_size=4", "algo.n_samples_per_prompt=4",
        "algo.global_batch_size=16", "rollout.max_new_tokens=8", "actor.lr=1e-4", "algo.entropy_coef=0.01",
        "model.dtype=float32", "rollout.dtype=float32", "actor.zero_stage=3",
        "actor.stage3_param_persistence_threshold=0", "trainer.check_rank_sync=true", "trainer.eval_before=false",
        "trainer.eval_after=false", "trainer.save_final=false",
        "rollout.placement=ray", "rollout.num_engines=2", "rollout.ray_address=local", "rollout.timeout_s=300"]


def test_two_ranks_share_two_ray_engines(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run_ray"
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "dsrl.main", *ARGS,
           f"model.path={tiny_model_path}", f"hydra.run.dir={run_dir}"]
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    r = subprocess.run(cmd, cwd=Path(__file__).parents[2], capture_output=True, text=True, env=env, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # Every engine scored the probe after the sync like the trainer (float32: ~1e-6).
        assert row.get("rollout/sync_logprob_diff", 0.0) < 1e-3, row  # probed on the first push (auto)
        assert row["rollout/logprob_diff"] < 1e-3, row
        assert row["rollout/engine0_prompts"] > 0 and row["rollout/engine1_prompts"] > 0, row
        assert row["rollout/engine0_prompts"] + row["rollout/engine1_prompts"] == 4, row
        assert row["rollout/restarts"] == 0.0
        assert row["train/grad_norm"] > 0
    assert "ranks: 2" in out and "rollout engines up" in out
