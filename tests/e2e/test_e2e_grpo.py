"""End to end with the real parts: vLLM worker processes, DeepSpeed engines, the Hydra entry
point, on the tiny random Llama (SmolLM2 tokenizer): one process with ZeRO-3 and a KL loss against a
ZeRO-3 reference engine. Two ranks under DeepSpeed's launcher (ZeRO-3, with a resumed launch):
tests/e2e/test_e2e_resume.py; two ranks under ZeRO-0/2/3 at the engine level, a good step and
skipped ones: tests/actor/test_engine_nonfinite.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.testing import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REQUIRED_KEYS = ["step", "reward/mean", "timing/rollout", "timing/old_logprobs", "timing/ref_logprobs",
                 "timing/train", "timing/weight_sync", "timing/step", "train/ppo_kl", "train/pg_clipfrac",
                 "train/entropy", "train/grad_norm", "rollout/logprob_diff", "rollout/restarts", "reward/errors",
                 "reward/timeouts", "train/skipped_steps"]
COMMON = ["+exp=grpo_reuse", "trainer.total_steps=2", "data.num_eval=8", "algo.rollout_batch_size=4",
          "algo.n_samples_per_prompt=4", "algo.global_batch_size=16", "rollout.max_new_tokens=8",
          "actor.lr=1e-4", "algo.entropy_coef=0.01", "model.dtype=float32", "rollout.dtype=float32"]  # random model: reward 0, entropy gives a gradient



def _run(cmd, cwd, timeout):
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    return out


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_single_process_zero3_run_with_a_kl_loss_writes_everything(tmp_path, tiny_model_path):
    """Reuse with a KL loss: the reference engine (frozen, ZeRO-3) still scores every step and the
    KL loss starts at 0 (same weights) and becomes positive once the actor moved; the run writes
    metrics, plot, TensorBoard, evals and the final model."""
    run_dir = tmp_path / "run"
    # The reference scores microbatches of the training ones' shapes: at step 1 (same weights) its
    # log-probs equal the training forward's bit for bit, so the KL loss is exactly 0.
    out = _run([sys.executable, "-m", "dsrl.main", *COMMON, f"model.path={tiny_model_path}", "algo.use_kl_loss=true",
                "algo.kl_loss_coef=0.1", "actor.micro_batch_size=8", "actor.forward_micro_batch_size=8",
                "actor.zero_stage=3", "actor.stage3_param_persistence_threshold=0", f"hydra.run.dir={run_dir}"],
               cwd=Path(__file__).parents[2], timeout=600)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in REQUIRED_KEYS:
            assert k in r, (k, r)
        # The sync's own probe: the engine serves the trainer's weights after every sync.
        # (the probe on the first push and every 32nd: rollout.sync_probe_every auto; the train step checks the rest)
        assert r.get("rollout/sync_logprob_diff", 0.0) < 1e-4 and r["rollout/sync_buckets"] >= 1, r
        assert r["timing/old_logprobs"] == 0.0 and r["timing/ref_logprobs"] > 0  # reuse skipped the old pass
        # Weight push verified: the trainer and vLLM agree on the log-probs of the new samples.
        assert r["rollout/logprob_diff"] < 1e-3, r["rollout/logprob_diff"]
        assert r["train/grad_norm"] > 0
    assert rows[0]["train/kl_loss"] == 0.0 and rows[1]["train/kl_loss"] > 0.0
    assert "reusing detached training log-probs" in out
    assert (run_dir / "config.yaml").exists() and (run_dir / "plot.png").stat().st_size > 5000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"eval/accuracy_before", "eval/accuracy_after"} <= set(summary)
    from transformers import AutoModelForCausalLM
    import torch
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    diffs = [(a - b).abs().max().item() for a, b in zip(trained.parameters(), base.parameters())]
    assert max(diffs) > 0  # it trained
    assert all(torch.isfinite(p).all() for p in trained.parameters())
