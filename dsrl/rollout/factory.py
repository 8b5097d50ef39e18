"""Builds the rollout worker a run asks for (`rollout.backend`, `rollout.placement`): the one
place that knows which engines exist. Every worker has the same interface (generate,
push_weights, close) and is wrapped in a ResilientWorker, which rebuilds a dead engine."""
from __future__ import annotations

import functools
import os

from dsrl.distributed.ranks import global_rank, local_rank, world_size
from dsrl.hardware import local_world_size
from dsrl.rollout.resilient import ResilientWorker


def build_rollout(cfg, model_path: str, run_dir: str) -> ResilientWorker:
    """This rank's rollout worker (built before the trainer's models: a colocated engine sizes
    its memory first)."""
    r = cfg.rollout
    make_engine = _colocated_vllm(cfg, model_path, run_dir)
    return ResilientWorker(make_engine, name=f"vLLM engine of rank {global_rank()} ({model_path})",
                           max_restarts=r.max_restarts, timeout_s=r.timeout_s)


def _colocated_vllm(cfg, model_path: str, run_dir: str):
    """A vLLM engine per trainer rank, on this rank's machine (and GPU, on CUDA)."""
    from dsrl.rollout.vllm_worker import VLLMWorker

    r = cfg.rollout
    # A dead or hung engine is rebuilt with these same arguments (dsrl.rollout.resilient).
    return functools.partial(
        VLLMWorker, model_path, dtype=r.dtype, seed=r.seed + 1000 * global_rank(),
        max_model_len=r.max_model_len, kv_cache_gib=r.kv_cache_gib,
        gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
        local_rank=local_rank(), local_world=local_world_size(world_size()),
        weights_dir=os.path.join(run_dir, ".weights", f"rank{global_rank()}"))
