"""The tiny fp32 CLI job the e2e tests share, and how they launch it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from dsrl.testing import subprocess_env

TINY = ["+exp=grpo_reuse", "model.path=tiny", "data.num_eval=8", "algo.rollout_batch_size=4",
        "algo.n_samples_per_prompt=4", "algo.global_batch_size=16", "rollout.max_new_tokens=8", "actor.lr=1e-4",
        "algo.entropy_coef=0.01", "model.dtype=float32", "rollout.dtype=float32", "trainer.eval_before=false",
        "trainer.eval_after=false", "logger.plot=false", "logger.tensorboard=false", "trainer.keep_checkpoints=0"]
STEPS = 4
UNINTERRUPTED = [*TINY, f"trainer.total_steps={STEPS}", "trainer.save_every=1"]


def job_env(**extra: str) -> dict:
    return subprocess_env(RAY_AUTH_MODE="disabled", HYDRA_FULL_ERROR="1", **extra)


def job_cmd(run_dir: Path, *overrides: str) -> list:
    return [sys.executable, "-m", "dsrl.main", *overrides, f"hydra.run.dir={run_dir}"]


def metric_rows(run_dir: Path) -> list:
    """The run's metrics.jsonl, a dict per step."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def untimed(rows: list) -> list:
    """The rows without their timings (which differ from run to run)."""
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]


def untimed_metrics(run_dir: Path) -> list:
    return untimed(metric_rows(run_dir))
