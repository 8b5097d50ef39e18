"""The uninterrupted tiny fp32 run (real vLLM + DeepSpeed, a checkpoint every step) that both the
resume test and the before/after test compare against: one CLI job for the session."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from e2e_jobs import UNINTERRUPTED, job_cmd, job_env


@pytest.fixture(scope="session")
def uninterrupted_tiny_run(tmp_path_factory, tiny_model_path) -> Path:
    """Run folder of `UNINTERRUPTED` (4 steps, tiny model, float32, a checkpoint after every step)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    r = subprocess.run(job_cmd(run_dir, *UNINTERRUPTED), env=job_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir
