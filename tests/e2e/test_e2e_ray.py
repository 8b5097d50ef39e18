"""End to end with Ray-placed engines: 2 DeepSpeed ranks (ZeRO-3, `deepspeed --num_gpus 2`, the
tiny Llama) share 2 vLLM engines that are Ray actors of a private Ray cluster
(`rollout.placement=ray rollout.num_engines=2 rollout.ray_address=local`: rank 0 starts it and
the engines, rank 1 joins and looks them up).

Launch A, three steps: rollouts split across the ranks and both engines every step, identical
parameters on every rank after each step (trainer.check_rank_sync raises otherwise), the full
weights (gathered under ZeRO-3) pushed to both engines, whose probe log-probs then match the
trainer's (rollout/sync_logprob_diff is the largest over engines) and whose sampled log-probs agree
too; a checkpoint after step 2, the greedy eval after the last step, the final weights. Launch C,
resumed from A's step-2 checkpoint into a new run folder (trainer.resume_from), reproduces A's
step 3, eval and final weights exactly: the two-rank ZeRO-3 resume, engines rebuilt on the
resumed weights."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsrl.distributed.ports import free_port
from dsrl.testing import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ARGS = ["+exp=grpo_reuse", "trainer.total_steps=3", "algo.rollout_batch_size=4", "algo.n_samples_per_prompt=4",
        "algo.global_batch_size=16", "rollout.max_new_tokens=8", "actor.lr=1e-4", "algo.entropy_coef=0.01",
        "model.dtype=float32", "rollout.dtype=float32", "actor.zero_stage=3",
        "actor.stage3_param_persistence_threshold=0", "trainer.check_rank_sync=true", "trainer.eval_before=false",
        "trainer.eval_after=true", "data.num_eval=8", "trainer.save_every=2", "trainer.keep_checkpoints=0",
        "logger.plot=false", "logger.tensorboard=false",
        "rollout.placement=ray", "rollout.num_engines=2", "rollout.ray_address=local", "rollout.timeout_s=300"]


def _launch(run_dir: Path, model_path, *extra: str) -> str:
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "dsrl.main", *ARGS,
           f"model.path={model_path}", f"hydra.run.dir={run_dir}", *extra]
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    r = subprocess.run(cmd, cwd=Path(__file__).parents[2], capture_output=True, text=True, env=env, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    return out


def _rows(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list) -> list:
    return [{k: v for k, v in row.items() if not k.startswith("timing/")} for row in rows]


def test_two_ranks_share_two_ray_engines_and_resume_exactly(tmp_path, tiny_model_path):
    a, c = tmp_path / "a", tmp_path / "c"
    out = _launch(a, tiny_model_path)
    assert "ranks: 2" in out and "rollout engines up" in out
    rows = _rows(a)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        # Every engine scored the probe after the sync like the trainer (float32: ~1e-6).
        assert row["rollout/sync_logprob_diff"] < 1e-3, row
        assert row["rollout/logprob_diff"] < 1e-3, row
        assert row["rollout/engine0_prompts"] > 0 and row["rollout/engine1_prompts"] > 0, row
        assert row["rollout/engine0_prompts"] + row["rollout/engine1_prompts"] == 4, row
        assert row["rollout/restarts"] == 0.0
        assert row["train/grad_norm"] > 0
        assert row["timing/old_logprobs"] == 0.0  # reuse on: no forward-only pass
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step-000002"]
    summary_a = json.loads((a / "summary.json").read_text())
    assert "eval/accuracy_after" in summary_a

    out = _launch(c, tiny_model_path, f"trainer.resume_from={a}")
    assert "continuing after step 2" in out
    assert _untimed(_rows(c)) == _untimed(rows)
    assert json.loads((c / "summary.json").read_text())["eval/accuracy_after"] == summary_a["eval/accuracy_after"]
    wa, wc = (load_file(str(d / "final_model" / "model.safetensors")) for d in (a, c))
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
