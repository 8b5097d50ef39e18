"""One vLLM engine where its `vllm.LLM` lives (`VLLMEngine`): the child of dsrl's engine host
(CPU, dsrl.rollout.engine_host), a Ray actor, or the trainer's process with vLLM's own engine-core
process (CUDA). The rollout worker in front of it, which picks where it runs, is
dsrl.rollout.vllm_worker.VLLMWorker.

Weight push (dsrl.rollout.weight_sync): the trainer's weights arrive as buckets (dsrl.rollout.buckets).
On CPU they are staged in shared memory by the worker (dsrl.rollout.shm_transport) and loaded here with
one RPC per bucket once all are staged (`load_shared_bucket`, then `finish_shared_load`; a rebuilt
engine: `load_shared_weights`, all in one call; dsrl.rollout.engine_load). On CUDA a colocated engine gets
them through CUDA IPC handles (`push_ipc`, dsrl.rollout.cuda_ipc; not yet run on a GPU).
`probe_logprobs` scores fixed token sequences so the trainer can check the sync
(`rollout/sync_logprob_diff`).

Scheduling (`run`): every request of a call is in the engine's queue before the engine core's
first step for them. vLLM's engine core steps as soon as its first request arrives, so the batches
it scheduled depended on when each request reached it; in bf16, where a kernel's rounding depends
on the batch, the same seeds gave other tokens from run to run (2 to 18 of 64 completions of
SmolLM2 differed between two identical calls). Paused while the requests are added (`sleep(level
0, mode="keep")`, then `wake_up(["scheduling"])`), the batches depend only on the requests.

Process hygiene (vLLM's own multiprocessing): the engine records its processes (psutil handles)
when it starts, so `engine_alive` can tell a dead engine from a slow one, and `kill` / `close`
leave none behind."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import torch

from dsrl.hardware import cpu_core_range, parse_core_list, usable_core_ids
from dsrl.tracking.progress import progress


@dataclass
class Completion:
    token_ids: list
    logprobs: list  # sampling log-prob of each token (after temperature: processed_logprobs)
    finish_reason: str
    text: str


def reload_and_retie(worker, weights_path: str) -> int:
    """Runs inside each vLLM worker (sent through collective_rpc): reload the whole model from a
    safetensors folder (`reload_weights` skips a tied `lm_head`, so re-tie it). The file-based push
    that the shared-memory sync replaced; bench/bench_sync.py measures against it."""
    from dsrl.rollout.engine_load import retie_head

    worker.reload_weights(weights_path=weights_path)
    return retie_head(worker.model_runner.get_model())


# collective_rpc may carry a function (reload_and_retie) only with this set.
_RPC_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def engine_env(kv_cache_gib: int, local_rank: int, local_world: int, *, multiprocess: bool, cores: str = "") -> dict:
    """Environment that vLLM reads when an engine starts: RPC serialization (always); on CPU the
    KV-cache size, this rank's cores (`cores`, rollout.engine_cores, else an even share of the usable
    ones) and whether the engine core runs in its own process."""
    env = dict(_RPC_ENV)
    if not torch.cuda.is_available():
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
            "VLLM_CPU_OMP_THREADS_BIND": engine_core_range(local_rank, local_world, cores),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
        })
    return env


def engine_core_range(local_rank, local_world, cores="") -> str:
    """The cores a rank's CPU engine runs on: `cores` (rollout.engine_cores), else the rank's even
    share of the usable ones."""
    return cores or cpu_core_range(usable_core_ids(), int(local_rank or 0), int(local_world or 1))


def bind_engine_process(local_rank=0, local_world=1, cores="") -> List[int]:
    """CPU, in the engine host's child only (dsrl.rollout.engine_host): this process, and every
    thread it starts, on the rank's cores (rollout.engine_cores, else its even share of the usable
    ones), torch's thread pool sized to them. vLLM reads VLLM_CPU_OMP_THREADS_BIND only when it
    spawns its own worker processes; an in-process engine inherits the parent's affinity and would
    run on the trainer's cores (measured: the default job's engine ran on core 0 beside a trainer
    pinned there, core 1 idle). Returns the cores (none on CUDA)."""
    if torch.cuda.is_available():
        return []
    ids = parse_core_list(engine_core_range(local_rank, local_world, cores))
    os.sched_setaffinity(0, ids)
    torch.set_num_threads(len(ids))
    return ids


def lora_engine_kwargs(lora_rank: int) -> dict:
    """LLM(...) arguments of an engine that serves the actor's LoRA adapter (actor.lora.rank > 0):
    one adapter at a time, max_lora_rank the smallest vLLM accepts that holds the rank."""
    if int(lora_rank) <= 0:
        return {}
    from dsrl.actor.lora import vllm_max_lora_rank

    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(int(lora_rank)), "max_loras": 1}


# KV-cache block of a CPU engine. Prefix caching shares only whole blocks, and the n samples of a
# group are scheduled in the same engine step: with vLLM-CPU's default of 128 tokens a prompt shorter
# than that is prefilled n times; with 32 (the smallest its attention takes) the children reuse the
# first child's blocks in that same step. Measured on the default job (bf16, 8 prompts x 8 samples,
# 43-token prompts): prefill 2.01 -> 0.74 s, whole rollout 3.40 -> 2.44 s (bench/bench_rollout.py).
CPU_BLOCK_SIZE = 32


def cpu_llm_kwargs() -> dict:
    """LLM(...) arguments of a CPU engine (on top of the common ones): chunked prefill stays off
    (per-request seeds, see VLLMWorker.__init__); small KV blocks so a group shares its prompt."""
    return {"enable_chunked_prefill": False, "block_size": CPU_BLOCK_SIZE}


def eager_sampler_ops() -> None:
    """Run the torch.compile-decorated helpers of vLLM's sampler eagerly in this (engine) process.
    `enforce_eager` keeps the model eager, but `batched_count_greater_than` (each returned token's
    rank among the log-probs: an integer count) is compiled with inductor on an engine's first
    generate: 4.2-4.7 s of every CPU engine start, against 0.28 s for the whole first generate
    eager (tiny model, 2-core Xeon). The counts, tokens and log-probs are the same bit for bit
    (tests/rollout/test_engine_host.py). The other compiled helper, `compiled_random_sample`, samples
    only batches of requests without a seed: the training rollouts are seeded per request
    (random_sample, untouched); a Tinker client's unseeded sample request now draws eagerly from the
    engine's generator, which may give other tokens than the compiled draw did (nothing claims
    those reproduce). dsrl compiles nothing itself, so the switch is for the whole process."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def import_vllm_and_freeze() -> None:
    """In a process that exists for its engine (the engine host's child, a Ray engine actor), before
    the engine starts: vLLM imported with the garbage collector off, then everything alive frozen
    out of its scans (dsrl/heap.py): vLLM's gc.collect() calls at the engine's start and close
    take milliseconds instead of ~2 s. The same tokens and log-probs: tests/rollout/test_engine_host.py."""
    from dsrl.heap import imports_uncollected

    with imports_uncollected():
        import vllm.entrypoints.llm  # noqa: F401 - the heavy imports, before the freeze


DEFAULT_BUCKET_BYTES = 256 << 20  # push_weights(state dict): bucket size (the trainer sets rollout.sync_bucket_mb)

def cuda_engine_kwargs(local_rank: int, colocated: bool) -> dict:
    """LLM(...) arguments of a CUDA engine colocated with trainer rank `local_rank`: its GPU
    (`device_ids=[local_rank]`, an index into CUDA_VISIBLE_DEVICES, which the deepspeed
    launcher gives every rank in full; without it every rank's engine lands on visible GPU 0) and sleep mode (its memory is freed during the train phase). Chosen over
    rewriting CUDA_VISIBLE_DEVICES before the engine starts: that changes this process's
    environment for every later child (a restarted engine included) after CUDA is initialised,
    while device_ids is vLLM's own switch for its uni/mp executors. Its limits: no effect under
    vLLM's Ray executor (Ray placement picks GPUs itself) and one device per engine (a colocated
    engine is TP 1; validation rejects more). Empty on CPU and for engines on GPUs of their own."""
    if not torch.cuda.is_available() or not colocated:
        return {}
    return {"device_ids": [int(local_rank)], "enable_sleep_mode": True}


def _generation_bar(iterable=None, **kwargs):
    """Passed to vLLM as `use_tqdm`: its "Processed prompts" pass becomes dsrl's single
    "generate" bar; its prompt-rendering pass (over `iterable`) gets none."""
    if iterable is not None:
        return iterable
    return progress(total=kwargs.get("total"), desc="generate", unit="sample", leave=False)


def per_prompt(count: int, max_tokens: Union[int, Sequence[int]],
               stop: Optional[Sequence[Sequence[str]]] = None) -> Tuple[List[int], List[List[str]]]:
    """`max_tokens` (one for all, or one per prompt) and `stop` (None, or stop strings per prompt)
    as one of each per prompt."""
    caps = [int(max_tokens)] * count if isinstance(max_tokens, int) else [int(m) for m in max_tokens]
    stops = [[] for _ in range(count)] if stop is None else [list(s or []) for s in stop]
    if len(caps) != count or len(stops) != count:
        raise ValueError(f"{len(caps)} max_tokens and {len(stops)} stop lists for {count} prompts")
    return caps, stops


class VLLMEngine:
    """The vLLM engine itself, in the process where its `vllm.LLM` lives: the engine host's
    child (dsrl.rollout.engine_host, CPU), a Ray actor, or the caller's process with vLLM's own
    engine-core process (`multiprocess=True`, CUDA). Callers use `VLLMWorker`, which picks one."""

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 512,
                 kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 local_rank: int = 0, local_world: int = 1, colocated: bool = False, lora_rank: int = 0,
                 multiprocess: bool = True, cores: str = ""):
        from vllm import LLM

        # Read by vLLM when the engine starts (in this process, or the engine-core process it spawns).
        os.environ.update(engine_env(kv_cache_gib, local_rank, local_world, multiprocess=multiprocess, cores=cores))
        # Per-request seeds (dsrl.rollout.seeds) on CPU: a prefill split across engine steps discards
        # the sampled token and rewinds the request's generator with set_offset, which CPU torch
        # generators do not support ("CPU Generator does not use offset"). Without chunked prefill a
        # prompt that does not fit the step's token budget waits for the next step instead.
        on_cpu = not torch.cuda.is_available()
        cpu_only = cpu_llm_kwargs() if on_cpu else {}
        if on_cpu:
            eager_sampler_ops()
        cuda_only = cuda_engine_kwargs(local_rank, colocated)  # this rank's GPU, sleep mode
        # actor.lora.rank > 0: the engine serves the trainer's adapter (load_adapter) on the base weights.
        self.lora_enabled = int(lora_rank) > 0
        self.lora_request = None  # the adapter every generate uses (None: the base model)
        lora_only = lora_engine_kwargs(lora_rank)
        t0 = time.time()
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                       disable_log_stats=True, use_tqdm_on_load=False, **cpu_only, **cuda_only, **lora_only)
        self.sleep_mode = bool(cuda_only.get("enable_sleep_mode"))
        self.start_seconds = time.time() - t0
        # The engine's own processes (multiprocess); none in-process: it lives and dies with this one.
        self._procs = engine_processes(self.llm) if multiprocess else []

    def facts(self) -> dict:
        """What the worker in front of this engine reports without asking it each time."""
        return {"start_seconds": self.start_seconds, "sleep_mode": self.sleep_mode}

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens: Union[int, Sequence[int]], show_progress: bool = False,
                 seeds: Optional[Sequence[int]] = None,
                 stop: Optional[Sequence[Sequence[str]]] = None) -> List[List[Completion]]:
        """n completions per prompt, each with its sampling log-probs. `seeds` (one per prompt)
        makes sampling independent of the engine's RNG state and batching order. `max_tokens`
        and `stop` (stop strings: the text ends before one, the token ids keep every sampled
        token, the one that completed the stop string included) may be given per prompt."""
        from vllm import SamplingParams

        greedy = temperature == 0.0
        caps, stops = per_prompt(len(prompt_ids), max_tokens, stop)
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        params = [SamplingParams(n=n, temperature=temperature, top_p=1.0 if greedy else top_p,
                                 max_tokens=caps[i], logprobs=None if greedy else 0, stop=list(stops[i]) or None,
                                 seed=None if seeds is None or greedy else int(seeds[i]))
                  for i in range(len(prompt_ids))]
        outs = self.run([{"prompt_token_ids": list(p)} for p in prompt_ids], params,
                        use_tqdm=_generation_bar if show_progress else False, lora_request=self.lora_request)
        result = []
        for out in outs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = []
                if c.logprobs is not None:
                    lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs)]
                group.append(Completion(ids, lps, str(c.finish_reason), c.text))
            result.append(group)
        return result

    def run(self, requests: list, params: list, *, use_tqdm=False, lora_request=None) -> list:
        """`LLM.generate` with a schedule that depends only on the requests (module docstring):
        the engine core is paused while they are added, then resumed; outputs in request order."""
        self.llm.sleep(level=0, mode="keep")  # adds are queued, no engine step
        try:
            self.llm.enqueue(requests, params, use_tqdm=False, lora_request=lora_request)
        finally:
            self.llm.wake_up(tags=["scheduling"])
        outs = self.llm.wait_for_completion(use_tqdm=use_tqdm)  # in the order added (vLLM sorts by its counter)
        if len(outs) != len(requests) or any(list(o.prompt_token_ids) != list(r["prompt_token_ids"])
                                             for o, r in zip(outs, requests)):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(requests)} requests, or not in their order")
        return outs

    # ------------------------------------------------------------------ weights
    def push_ipc(self, weights) -> float:
        """CUDA: new weights (a state dict or GPU Buckets) through CUDA IPC handles
        (dsrl.rollout.cuda_ipc); the engine's prefix cache is dropped. Returns seconds."""
        from dsrl.rollout.buckets import pack_buckets
        from dsrl.rollout.cuda_ipc import gpu_alloc, push_ipc_buckets

        t0 = time.perf_counter()
        if isinstance(weights, Mapping):
            weights = pack_buckets(weights.items(), DEFAULT_BUCKET_BYTES, alloc=gpu_alloc())
        push_ipc_buckets(self.llm, weights)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def load_shared_weights(self, refs) -> float:
        """Load staged buckets (dsrl.rollout.shm_transport.ShmBucketRef, in packing order): one
        RPC per bucket, all in one layerwise-reload session (dsrl.rollout.engine_load); then the
        prefix cache, computed with the old weights, is dropped. Returns seconds."""
        t0 = time.perf_counter()
        refs = list(refs)
        for i, ref in enumerate(refs):
            self.load_shared_bucket(ref, i == 0)
        if refs:
            self.finish_shared_load()
        return time.perf_counter() - t0

    def load_shared_bucket(self, ref, first: bool) -> float:
        """One staged bucket of a sync (`first` opens the reload session, which
        `finish_shared_load` closes after the last one). Returns seconds."""
        from dsrl.rollout.engine_load import load_shm_bucket

        t0 = time.perf_counter()
        self.llm.collective_rpc(load_shm_bucket, args=(ref.path, ref.rows, bool(first), False))
        return time.perf_counter() - t0

    def finish_shared_load(self) -> float:
        """Close a sync's reload session; the prefix cache is dropped. Returns seconds."""
        from dsrl.rollout.engine_load import finish_reload

        t0 = time.perf_counter()
        self.llm.collective_rpc(finish_reload)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def reload_folder(self, folder: str) -> None:
        """Reload every weight from an HF safetensors folder (the Tinker sampler's full-weight
        checkpoints); the prefix cache, computed with the old weights, is dropped."""
        self.llm.collective_rpc(reload_and_retie, args=(str(folder),))
        self.llm.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def load_adapter(self, path: str, adapter_id: int) -> float:
        """actor.lora: serve the PEFT adapter folder at `path` from now on (dsrl.rollout.lora_sync).
        `adapter_id` must be new for every sync: vLLM caches adapters by id and would keep serving
        the old weights under a reused one. The files are read here (add_lora), so the previous
        adapter's folder may be removed once this returns. An engine without LoRA is refused by
        VLLMWorker.load_adapter before it gets here. Returns seconds."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        request = LoRARequest(f"dsrl-adapter-{int(adapter_id)}", int(adapter_id), str(path))
        self.llm.llm_engine.add_lora(request)
        old, self.lora_request = self.lora_request, request
        if old is not None and old.lora_int_id != request.lora_int_id:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def adapter_id(self) -> Optional[int]:
        """The id of the LoRA adapter every generate uses (None: the base model)."""
        return None if self.lora_request is None else int(self.lora_request.lora_int_id)

    def probe_sampled(self, prompt_ids: Sequence[Sequence[int]], *, max_tokens: int,
                      seed: int) -> List[tuple]:
        """The sync check of a LoRA engine: (token ids, log-probs) of `max_tokens` tokens sampled
        at temperature 1 (its log-probs are the raw log_softmax) from each prompt with the current
        adapter, EOS ignored so every row has `max_tokens`. Used instead of `probe_logprobs`,
        whose prompt_logprobs fail on a LoRA-enabled vLLM-CPU 0.32 engine (module docstring of
        dsrl.rollout.lora_sync)."""
        from vllm import SamplingParams

        params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=int(max_tokens), logprobs=0,
                                 seed=int(seed) + i, ignore_eos=True, detokenize=False)
                  for i in range(len(prompt_ids))]
        outs = self.run([{"prompt_token_ids": list(p)} for p in prompt_ids], params, lora_request=self.lora_request)
        result = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            result.append((ids, [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs)]))
        return result

    def probe_logprobs(self, token_id_lists: Sequence[Sequence[int]]) -> List[List[float]]:
        """Prompt log-probs of fixed token sequences: for each sequence, the log-prob of token i
        given tokens < i (i >= 1; raw log_softmax of the logits, no temperature), from a greedy
        one-token request with `prompt_logprobs=0`. The weight sync's check (dsrl.rollout.weight_sync)."""
        from vllm import SamplingParams

        if self.lora_enabled:
            raise RuntimeError("probe_logprobs: prompt log-probs fail on a LoRA-enabled vLLM-CPU 0.32 engine; "
                               "its sync is checked with probe_sampled (dsrl.rollout.lora_sync)")
        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.run([{"prompt_token_ids": list(p)} for p in token_id_lists], params)
        result = []
        for ids, out in zip(token_id_lists, outs):
            steps = out.prompt_logprobs or []
            result.append([float(steps[i][int(tok)].logprob) for i, tok in enumerate(ids) if i >= 1])
        return result

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory for the train phase (vLLM sleep mode; level 1 keeps the
        weights in host memory, level 2 drops them: only when every push rewrites all weights).
        Nothing may be in flight: the trainer calls it between phases. Only
        with sleep mode on: VLLMWorker.sleep decides (a no-op on CPU and on GPUs of its own)."""
        self.llm.sleep(level=int(level))

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Give back the memory `sleep` freed: `["weights"]` before a weight load (loading into a
        sleeping engine writes to unmapped memory, P1), `["kv_cache"]` once the new weights are
        in (waking both at once while new weights are staged can run out of memory, P3). The
        engine schedules again once everything is awake. Only with sleep mode on (VLLMWorker.wake_up)."""
        self.llm.wake_up(None if tags is None else list(tags))

    def engine_alive(self) -> bool:
        """Every process the engine started at construction still runs (a zombie counts as dead)."""
        return self.llm is not None and all(_running(p) for p in self._procs)

    def kill(self) -> None:
        """Stop a dead or hung engine at once: SIGKILL its processes, wake any thread still
        waiting on it (vLLM's client would wait forever), release the client."""
        import psutil

        procs = _with_descendants(self._procs)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        llm = self.llm
        if llm is not None:
            _wake_waiters(getattr(llm.llm_engine, "engine_core", None))
        self.close()

    def close(self) -> None:
        """Shut the engine down (vLLM's own shutdown), then make sure none of its processes
        survives: whatever still runs after a grace period is killed."""
        llm = getattr(self, "llm", None)
        self.llm = None
        procs = _with_descendants(getattr(self, "_procs", []))
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                with contextlib.suppress(Exception):  # engine already gone
                    shutdown()
            del llm
        _reap(procs)


# ---------------------------------------------------------------------- engine processes
_GRACE_S = 10.0  # close(): how long the engine's processes get to exit before SIGKILL


def engine_processes(llm) -> list:
    """psutil handles of the engine's processes: vLLM's engine core(s) and everything they
    started (the model workers). A handle remembers its start time, so a recycled pid is never
    taken for the engine. Falls back to this process's children that vLLM named VLLM::*."""
    import psutil

    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(engine_core, "resources", None), "engine_manager", None)
    roots = []
    for proc in getattr(manager, "processes", None) or []:
        with contextlib.suppress(psutil.Error, ValueError, TypeError):
            roots.append(psutil.Process(proc.pid))
    if not roots:
        with contextlib.suppress(psutil.Error):
            roots = [p for p in psutil.Process().children() if _named_vllm(p)]
    return _with_descendants(roots)


def _named_vllm(p) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        return p.name().startswith("VLLM") or any(a.startswith("VLLM::") for a in p.cmdline()[:1])
    return False


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _with_descendants(procs: list) -> list:
    """`procs` plus their current descendants (each once)."""
    import psutil

    out, seen = [], set()
    for p in procs:
        kids = []
        with contextlib.suppress(psutil.Error):
            kids = p.children(recursive=True) if _running(p) else []
        for q in [p, *kids]:
            if q.pid not in seen:
                seen.add(q.pid)
                out.append(q)
    return out


def _reap(procs: list, grace_s: float = _GRACE_S) -> None:
    """Wait up to `grace_s` for `procs` to exit, then SIGKILL the rest. Polls instead of
    psutil.wait_procs: waitpid on vLLM's own children would steal their exit status from
    multiprocessing."""
    import psutil

    deadline = time.monotonic() + grace_s
    while any(_running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        if _running(p):
            with contextlib.suppress(psutil.Error):
                p.kill()


def _wake_waiters(engine_core) -> None:
    """vLLM's synchronous client blocks on its output queue (generate) or on a future
    (collective_rpc) without a timeout, and nothing answers once the engine is gone: hand both
    an error so a thread stuck in them returns."""
    if engine_core is None:
        return
    from vllm.v1.engine.exceptions import EngineDeadError

    outputs = getattr(engine_core, "outputs_queue", None)
    if outputs is not None:
        with contextlib.suppress(Exception):
            outputs.put_nowait(EngineDeadError())
    for future in list((getattr(engine_core, "utility_results", None) or {}).values()):
        with contextlib.suppress(Exception):
            future.set_exception(EngineDeadError())
