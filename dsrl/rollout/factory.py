"""Builds the rollout worker a run asks for (`rollout.backend`, `rollout.placement`): the one
place that knows which engines exist. Every worker has the same interface (generate,
push_weights, engine_alive, close).

- placement=colocated: one engine per trainer rank on the rank's machine, wrapped in a
  ResilientWorker, which rebuilds a dead engine.
- placement=ray: `rollout.num_engines` engines as Ray actors shared by all ranks
  (dsrl.rollout.ray_engines); a dead engine stops the run with its name."""
from __future__ import annotations

import functools
import os

from dsrl.distributed.ranks import global_rank, local_rank, world_size
from dsrl.hardware import local_world_size
from dsrl.rollout.resilient import ResilientWorker


def build_rollout(cfg, model_path: str, run_dir: str, actor=None):
    """This rank's rollout worker (built before the trainer's models: a colocated engine sizes
    its memory first). Collective under placement=ray (every rank joins the Ray cluster).
    backend=hf: `actor` (an ActorEngine, when built first) lets the worker share its module."""
    r = cfg.rollout
    if r.backend == "hf":
        return _in_process_hf(cfg, model_path, actor)
    if r.placement == "ray":
        return _ray_engines(cfg, model_path, run_dir)
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
        local_rank=local_rank(), local_world=local_world_size(world_size()), colocated=True,
        weights_dir=os.path.join(run_dir, ".weights", f"rank{global_rank()}"),
        lora_rank=cfg.actor.lora.rank,  # actor.lora: the engine serves the synced adapter (dsrl.rollout.lora_sync)
        cores=r.engine_cores)


def _in_process_hf(cfg, model_path: str, actor):
    """A transformers rollout worker in this process (dsrl.rollout.hf_worker): the actor's own
    module under ZeRO 0-2 when the actor is given (no copy, no push), else its own copy on this
    rank's device (ZeRO-3 partitions the actor's parameters, and overlapped generation must not
    read weights mid-update; the push copies weights in)."""
    from dsrl.rollout.hf_worker import HFWorker

    r = cfg.rollout
    # Generation beside training (algo.off_policy_steps) must not read weights the optimizer writes.
    share = actor is not None and actor.zero_stage < 3 and not getattr(cfg.algo, "off_policy_steps", 0)
    make = functools.partial(HFWorker, model_path, module=actor.module if share else None, dtype=r.dtype,
                             device=actor.engine.device if actor is not None else None,
                             seed=r.seed + 1000 * global_rank(), max_model_len=r.max_model_len)
    return ResilientWorker(make, name=f"hf rollout worker of rank {global_rank()} ({model_path})",
                           max_restarts=0, timeout_s=r.timeout_s)


def _ray_engines(cfg, model_path: str, run_dir: str):
    """`rollout.num_engines` vLLM engines as Ray actors, shared by every trainer rank."""
    from dsrl.distributed.ray_cluster import join
    from dsrl.rollout.ray_engines import RayEngines

    r = cfg.rollout
    cluster = join(r.ray_address, leader=global_rank() == 0,
                   num_cpus=max(os.cpu_count() or 1, r.num_engines * r.cpus_per_engine))
    try:
        return RayEngines.start(
            cluster, num_engines=r.num_engines, seed=r.seed, weights_root=os.path.join(run_dir, ".weights"),
            tensor_parallel_size=r.tensor_parallel_size, cpus_per_engine=r.cpus_per_engine,
            timeout_s=r.timeout_s, rank=global_rank(),
            worker_kwargs=dict(model_path=model_path, dtype=r.dtype, max_model_len=r.max_model_len,
                               kv_cache_gib=r.kv_cache_gib, gpu_memory_utilization=r.gpu_memory_utilization,
                               enforce_eager=r.enforce_eager))
    except BaseException:
        cluster.shutdown()
        raise
