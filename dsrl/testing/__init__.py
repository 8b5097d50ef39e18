"""Helpers shared by the test suites (and quick scripts): environment defaults for CPU tests
and the model folders prepared by dsrl.setup_assets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from dsrl.distributed.ports import free_port
from dsrl.setup_assets import (default_cache_dir, make_tiny_model, smollm2_path,
                               tiny_model_path, torch_extensions_dir, use_op_cache)

__all__ = ["configure_test_env", "ensure_tiny_model", "smollm2_available", "free_port", "run_job",
           "default_cache_dir", "tiny_model_path", "smollm2_path", "torch_extensions_dir"]


def configure_test_env(cache_dir: Optional[os.PathLike] = None) -> Path:
    """Environment defaults for CPU tests: no Ray token auth, DeepSpeed on CPU, the shared JIT
    op cache. Existing values are kept. Returns the cache folder."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    use_op_cache(cache)  # inherited by every job, rank and reference-tree run the tests start
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return cache


def ensure_tiny_model(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The tiny random Llama folder, built into the cache if absent (a few seconds)."""
    return make_tiny_model(tiny_model_path(cache_dir), cache_dir)


def smollm2_available(cache_dir: Optional[os.PathLike] = None) -> bool:
    p = smollm2_path(cache_dir)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


# Set in the test process once an in-process engine initialised torch.distributed; a child job
# inheriting them would try to join (or re-bind) that process group's port.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")


def subprocess_env(**extra: str) -> dict:
    """os.environ for a child job: without the parent's process-group variables."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(extra)
    return env


def run_job(cmd, run_dir: os.PathLike, *, timeout: float = 900, **extra_env: str) -> list:
    """Run a dsrl job (`cmd` after the interpreter: e.g. ["-m", "dsrl.main", ...], or a full
    launcher command) on CPU from the repository root; fail with the end of its output unless it
    exits 0; return the rows of its metrics.jsonl."""
    argv = [sys.executable, *cmd] if cmd[0] in ("-m", "-c") else list(cmd)
    env = subprocess_env(RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **extra_env)
    r = subprocess.run(argv, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, env=env,
                       timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}:\n{(r.stdout + r.stderr)[-6000:]}")
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def random_microbatch(seed: int, lengths) -> dict:
    """A dense microbatch of random samples (one per (prompt, response) length pair, token ids
    10-999, rollout log-probs in (-1, 0]) with random advantages on the response tokens: the
    engine tests' standard input, reproducible from `seed`."""
    import torch

    from dsrl.actor.batch import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(10, 1000, (p + r,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:],
                              rollout_log_probs=(-torch.rand(r, generator=g)).tolist(), group=0, index=i))
    mb = collate(samples, pad_id=0)
    mb["advantages"] = torch.randn(mb["loss_mask"].shape, generator=g) * mb["loss_mask"]
    return mb


def compose_config(*overrides: str):
    """The typed Config that `python -m dsrl.main OVERRIDES` would run with (conf/ composed by Hydra,
    not yet validated)."""
    from hydra import compose, initialize_config_dir

    from dsrl.config.schema import register_configs, to_config

    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def perturb_weights(params, rel: float, seed: int) -> None:
    """Each tensor moves by `rel` times its own spread, in a seeded random direction (a stand-in for
    training: dsrl.testing.stale_layer and bench/bench_sync_sensitivity.py)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            noise = torch.randn(p.shape, generator=g).to(p.device)  # drawn on the CPU: the same on any device
            p.add_((rel * p.float().std() * noise).to(p.dtype))


DEFAULT_JOB_SUMS = ((3, 5), (7, 2), (4, 4), (9, 1), (6, 8), (2, 2), (8, 5), (1, 7))


def default_job_prompts(tokenizer) -> list:
    """The default job's prompts (data: arith, chat template): 8 sums in ArithSource's template, as
    token ids."""
    from dsrl.data.arith import ArithSource
    from dsrl.data.chat import encode_prompts
    from dsrl.data.types import Prompt

    return encode_prompts(tokenizer, [Prompt([{"role": "user", "content": ArithSource.template.format(
        expr=f"{a} + {b}")}], str(a + b)) for a, b in DEFAULT_JOB_SUMS])
