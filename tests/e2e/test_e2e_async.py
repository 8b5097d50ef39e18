"""Asynchronous rollouts on the real engines (vLLM + DeepSpeed, tiny model, float32):
algo.off_policy_steps=2 with algo.async_schedule=deterministic. One run A; a run B killed with
SIGKILL right after its step-2 checkpoint (its engine generating the batches ahead), then resumed in
its folder: B's metrics (the two steps before the kill, written by another process than A's, and
the four after the resume) and its final weights equal A's bit for bit. The buffer logic itself:
tests/rollout/test_async_buffer.py."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from e2e_jobs import TINY, job_cmd, job_env, metric_rows, untimed_metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 6
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
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert [row["async/token_lag_mean"] for row in rows] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    lags = [[row[f"async/tokens_lag/{j}"] for j in range(4)] for row in rows]
    assert [[j for j, n in enumerate(lag) if n] for lag in lags] == [[0], [1], [2], [2], [2], [2]]
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
