"""Asynchronous rollouts on the real engines (vLLM + DeepSpeed, tiny model, float32):
algo.off_policy_steps=2 with algo.async_schedule=deterministic. One run A; a run B killed with
SIGKILL right after its step-2 checkpoint (its engine generating the batches ahead), then resumed in
its folder: B's metrics (the two steps before the kill, written by another process than A's, and
the three after the resume: batches 3 and 4 from the checkpoint's buffer, batch 5 sampled by the
resumed engine) and its final weights equal A's bit for bit. The buffer logic itself:
tests/rollout/test_async_buffer.py."""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from e2e_jobs import TINY, job_cmd, job_env, metric_rows, untimed_metrics

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 5
ASYNC = [*TINY, f"trainer.total_steps={STEPS}", "trainer.save_every=1", "algo.off_policy_steps=2",
         "algo.async_schedule=deterministic", "algo.use_tis=true", "algo.reuse_logprobs=auto",
         "rollout.chunk_tokens=3"]


def _weights(run_dir):
    return load_file(str(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "hf" / "model.safetensors"))


def test_deterministic_async_run_repeats_and_resumes_exactly_after_sigkill(tmp_path, tiny_model_path):
    env = job_env()
    a, b = tmp_path / "a", tmp_path / "b"
    r = subprocess.run(job_cmd(a, *ASYNC), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = metric_rows(a)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    # version v loads when batch v + 2 closes: step s trains tokens of version max(0, s - 3)
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert [row["async/token_lag_mean"] for row in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    lags = [[row[f"async/tokens_lag/{j}"] for j in range(4)] for row in rows]
    assert [[j for j, n in enumerate(lag) if n] for lag in lags] == [[0], [1], [2], [2], [2]]
    # the checkpoint of step 2 holds the closed batches 3 and 4 (trained later) in its buffer
    state = torch.load(a / "checkpoints" / "step-000002" / "rank-0.pt", weights_only=False)["trainer"]["async_buffer"]
    assert (state["taken"], state["closed"], state["version"]) == (2, 4, 2)
    assert [batch.index for batch in state["ready"]] == [3, 4]

    proc = subprocess.Popen(job_cmd(b, *ASYNC), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    done = b / "checkpoints" / "step-000002" / "COMPLETE.json"
    end = time.time() + 600
    while not done.exists():
        assert proc.poll() is None and time.time() < end, "run B ended or hung before its step-2 checkpoint"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    psutil.wait_procs(children, timeout=20)
    assert len(metric_rows(b)) < STEPS

    r = subprocess.run(job_cmd(b, *ASYNC), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "continuing after step 2" in r.stderr + r.stdout
    assert untimed_metrics(b) == untimed_metrics(a)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


LEARN_STEPS = 16
# the default schedule for k = 2 (auto: clock), a reward the random tiny model can learn
# (tests/e2e/learn_rewards.py), 4 prompts x 8 samples, a learning rate that moves it within 16 steps
LEARN = ["+exp=grpo_reuse", "model.path=tiny", "model.dtype=float32", "rollout.dtype=float32",
         "algo.rollout_batch_size=4", "algo.n_samples_per_prompt=8", "algo.global_batch_size=32",
         "rollout.max_new_tokens=8", "actor.lr=5e-2", "reward.fn=learn_rewards.spaces",
         "algo.off_policy_steps=2", "algo.use_tis=true", "algo.reuse_logprobs=auto",
         f"trainer.total_steps={LEARN_STEPS}", "trainer.save_every=0", "trainer.save_final=false",
         "trainer.eval_before=false", "trainer.eval_after=false", "logger.plot=false", "logger.tensorboard=false"]


def test_two_steps_off_policy_learns(tmp_path, tiny_model_path):
    """Issue 19: the run learns under k = 2 (measured with rollout/data seeds 0, 5 and 9: first-5
    mean reward 0.67-0.69, last-5 0.99-1.00). It fails when the reward does not reach the sample it
    scored: with each group's rewards shuffled among its samples (tried by hand in the async buffer's
    scoring) the last-5 mean was 0.56."""
    env = job_env(PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p))
    run = tmp_path / "learn"
    r = subprocess.run(job_cmd(run, *LEARN), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = metric_rows(run)
    assert [row["step"] for row in rows] == list(range(1, LEARN_STEPS + 1))
    # it ran off-policy within the bound: the batches after the first two were sampled by older weights
    assert all(row["async/staleness_max"] <= 2 for row in rows)
    assert statistics.mean(row["async/staleness_mean"] for row in rows[2:]) >= 1.0
    rewards = [row["reward/mean"] for row in rows]
    first5, last5 = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert first5 < 0.8, rewards  # the random model's level: there was something to learn
    assert last5 - first5 >= 0.25, rewards
