"""The rollout worker of one vLLM engine (`VLLMWorker`): generate, weight pushes, probes,
adapters, sleep/wake, liveness, whatever process the engine runs in (`resolve_host`). One worker
per trainer rank; each generates its rank's share of the prompts. On CPU the weights are staged in
shared memory here (dsrl.rollout.shm_transport) and the staged files stay until the next sync, so a
rebuilt engine gets the last pushed weights back (`reload_pushed_weights`, dsrl.rollout.resilient).
The engine itself: dsrl.rollout.vllm_engine."""
from __future__ import annotations

import time
from typing import List, Mapping, Optional, Sequence

import torch

from dsrl.rollout.engine_host import EngineHost
from dsrl.rollout.vllm_engine import DEFAULT_BUCKET_BYTES, Completion, VLLMEngine

_said_no_sleep = []


def note_no_sleep_mode() -> None:
    """Say once per process that sleep() does nothing here."""
    if not _said_no_sleep:
        _said_no_sleep.append(True)
        import logging

        logging.getLogger("dsrl").info("vLLM sleep mode is off (CPU engine, or an engine on GPUs of its own): "
                                       "the engine keeps its memory during training")


HOSTS = ("auto", "process", "inline", "vllm")


def resolve_host(host: str) -> str:
    """Where a worker's engine runs. `process` (what `auto` picks on CPU): one child process of
    dsrl's (dsrl.rollout.engine_host) with vLLM's engine core and model in it; vLLM's own CPU
    multiprocessing would spawn two layers (engine core, then model worker), each importing torch
    and vLLM: a tiny model's engine took 20-22 s to start and 5 s to close that way, 4 s and 1 s
    in-process (measured, 2-core Xeon). `vllm` (what `auto` picks on CUDA): in this process, with
    vLLM's own engine-core process (CUDA IPC weight pushes need the `vllm.LLM` here). `inline`: in
    this process with no child at all (a Ray actor, or the host's child itself: vLLM then binds
    this process's threads and replaces its torch.set_num_threads)."""
    if host not in HOSTS:
        raise ValueError(f"engine host {host!r}: expected one of {HOSTS}")
    if host == "auto":
        return "vllm" if torch.cuda.is_available() else "process"
    return host


class LocalEngine:
    """An engine in this process, called like the host's child (`call`)."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine

    def call(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    def alive(self) -> bool:
        return self.engine.engine_alive()

    def kill(self) -> None:
        self.engine.kill()

    def close(self) -> None:
        self.engine.close()


class VLLMWorker:
    """The rollout worker of one vLLM engine: generate, weight pushes, probes, adapters,
    sleep/wake, liveness. The engine runs where `host` says (`resolve_host`); every call goes
    through one `call`, so a worker behaves the same wherever its engine is."""

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 512,
                 kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 local_rank: int = 0, local_world: int = 1, weights_dir: Optional[str] = None,
                 colocated: bool = False, lora_rank: int = 0, host: str = "auto", cores: str = ""):
        self.host = resolve_host(host)
        self.model_path = str(model_path)
        self.weights_dir = weights_dir  # unused: weights arrive through shared memory (kept for callers)
        self.lora_enabled = int(lora_rank) > 0
        engine_kwargs = dict(dtype=dtype, seed=seed, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                             gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                             local_rank=local_rank, local_world=local_world, colocated=colocated,
                             lora_rank=lora_rank, cores=cores)
        if self.host == "process":
            self._engine = EngineHost(str(model_path), engine_kwargs)
        else:
            self._engine = LocalEngine(VLLMEngine(str(model_path), **engine_kwargs, multiprocess=self.host == "vllm"))
        facts = self._engine.call("facts")
        self.start_seconds = float(facts["start_seconds"])
        self.sleep_mode = bool(facts["sleep_mode"])

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens, show_progress: bool = False, seeds: Optional[Sequence[int]] = None,
                 stop: Optional[Sequence[Sequence[str]]] = None) -> List[List[Completion]]:
        """n completions per prompt, each with its sampling log-probs (VLLMEngine.generate; max_tokens
        and stop strings may be per prompt)."""
        return self._engine.call("generate", [list(p) for p in prompt_ids], n=n, temperature=temperature,
                                 top_p=top_p, max_tokens=max_tokens if isinstance(max_tokens, int) else list(max_tokens),
                                 show_progress=show_progress, seeds=None if seeds is None else [int(s) for s in seeds],
                                 stop=None if stop is None else [list(s) for s in stop])

    def run(self, requests: list, params: list) -> list:
        """vLLM requests with their SamplingParams; vLLM's RequestOutputs, in request order."""
        return self._engine.call("run", requests, params)

    def probe_sampled(self, prompt_ids: Sequence[Sequence[int]], *, max_tokens: int, seed: int) -> List[tuple]:
        return self._engine.call("probe_sampled", [list(p) for p in prompt_ids], max_tokens=max_tokens, seed=seed)

    def probe_logprobs(self, token_id_lists: Sequence[Sequence[int]]) -> List[List[float]]:
        return self._engine.call("probe_logprobs", [list(t) for t in token_id_lists])

    # ------------------------------------------------------------------ weights
    # Own staging of a worker used without a ResilientWorker (e.g. inside a Ray actor or the bench).
    _staging = None

    @property
    def shared_memory_sync(self) -> bool:
        """Weights arrive through shared-memory files (CPU engine); on CUDA through IPC handles."""
        return not torch.cuda.is_available()

    def push_weights(self, weights, step: int) -> float:
        """New weights into the engine: a state dict ({HF name: tensor}) or an iterable of Buckets
        (dsrl.rollout.buckets; a lazy iterator is consumed to the end). CPU: staged in this
        worker's shared memory to the end, then loaded bucket by bucket
        (dsrl.rollout.shm_transport.stage_then_load); CUDA: IPC handles (dsrl.rollout.cuda_ipc).
        Returns seconds."""
        from dsrl.rollout.buckets import pack_buckets

        t0 = time.perf_counter()
        if not self.shared_memory_sync:
            self._engine.call("push_ipc", weights)
            return time.perf_counter() - t0
        from dsrl.rollout.shm_transport import stage_then_load

        staging = self._own_staging()
        if isinstance(weights, Mapping):
            weights = pack_buckets(weights.items(), DEFAULT_BUCKET_BYTES, alloc=staging.alloc)
        try:
            stage_then_load(staging, weights, self.load_shared_bucket, self.finish_shared_load,
                            name=f"vLLM engine ({self.model_path})")
        except BaseException:
            staging.discard()  # a failed load: the engine holds a half-loaded sync, the run stops on this error
            raise
        return time.perf_counter() - t0

    def load_shared_weights(self, refs) -> float:
        """Load staged buckets (dsrl.rollout.shm_transport.ShmBucketRef, in packing order). Returns seconds."""
        return self._engine.call("load_shared_weights", list(refs))

    def load_shared_bucket(self, ref, first: bool) -> float:
        """One bucket of a staged sync (dsrl.rollout.shm_transport.stage_then_load). Returns seconds."""
        return self._engine.call("load_shared_bucket", ref, bool(first))

    def finish_shared_load(self) -> float:
        """Close a staged sync's reload session (after its last bucket). Returns seconds."""
        return self._engine.call("finish_shared_load")

    def reload_pushed_weights(self) -> bool:
        """Load this worker's last staged weights again; False when nothing was pushed through it."""
        if self._staging is None or not self._staging.refs:
            return False
        self.load_shared_weights(self._staging.refs)
        return True

    def reload_folder(self, folder: str) -> None:
        """Every weight from an HF safetensors folder (VLLMEngine.reload_folder)."""
        self._engine.call("reload_folder", str(folder))

    def reset_prefix_cache(self) -> None:
        self._engine.call("reset_prefix_cache")

    def load_adapter(self, path: str, adapter_id: int) -> float:
        """actor.lora: serve the PEFT adapter folder at `path` from now on (VLLMEngine.load_adapter)."""
        if not self.lora_enabled:
            raise RuntimeError("load_adapter on a vLLM engine started without LoRA (lora_rank=0)")
        return self._engine.call("load_adapter", str(path), int(adapter_id))

    def adapter_id(self) -> Optional[int]:
        """The id of the adapter the engine serves (None: the base model)."""
        return self._engine.call("adapter_id")

    def _own_staging(self):
        from dsrl.rollout.shm_transport import ShmStaging

        if self._staging is None:
            self._staging = ShmStaging()
        return self._staging

    # ------------------------------------------------------------------ memory, liveness
    def sleep(self, level: int = 1) -> None:
        """VLLMEngine.sleep; a no-op, said once, without sleep mode (CPU engines, engines on GPUs of their own)."""
        if not self.sleep_mode:
            note_no_sleep_mode()
            return
        self._engine.call("sleep", int(level))

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """VLLMEngine.wake_up; a no-op without sleep mode."""
        if not self.sleep_mode:
            return
        self._engine.call("wake_up", None if tags is None else list(tags))

    def engine_alive(self) -> bool:
        """Every process of the engine still runs (a zombie counts as dead); answered here,
        never by asking the engine, so a hung engine is seen as alive, not waited for."""
        return self._engine is not None and self._engine.alive()

    def kill(self) -> None:
        """Stop a dead or hung engine at once (SIGKILL); a call still waiting on it returns with
        an engine-death error."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.kill()
        self._close_staging()

    def close(self) -> None:
        """Shut the engine down; none of its processes survives (killed after a grace period)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        self._close_staging()

    def _close_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.close()
