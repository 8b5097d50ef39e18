"""vLLM rollout worker: the engine core runs in its own process (vLLM's multiprocessing mode),
so its thread pinning never touches the trainer. One worker per trainer rank; each generates
its rank's share of the prompts.

Weight push: the trainer writes its full weights to one safetensors file and the engine reloads
them in place (`reload_weights`; plain `load_weights` fails on CPU because weights are repacked).
One file per push, not one RPC per parameter; the file stays, so a rebuilt engine gets the last
pushed weights back with `reload_pushed_weights` (dsrl.rollout.resilient).

Process hygiene: the worker records its engine's processes (psutil handles) when it starts, so
`engine_alive` can tell a dead engine from a slow one, and `kill` / `close` leave none behind."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from dsrl.hardware import cpu_core_range
from dsrl.tracking.progress import progress


@dataclass
class Completion:
    token_ids: list
    logprobs: list  # sampling log-prob of each token (after temperature: processed_logprobs)
    finish_reason: str
    text: str


def reload_and_retie(worker, weights_path: str) -> int:
    """Runs inside each vLLM worker (sent through collective_rpc). `reload_weights` reloads the
    input embedding but skips a tied `lm_head` (the checkpoint has no such tensor), and on CPU
    the head computes logits from a copy prepacked at load time; so copy the new embedding into
    the head and re-run its post-load processing (which repacks it). Returns 1 if re-tied."""
    worker.reload_weights(weights_path=weights_path)
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if head is None or not tied:
        return 0
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        if head.weight is not emb:
            head.weight.data.copy_(emb.data)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
    return 1


def _cpu_env(kv_cache_gib: int, local_rank: int, local_world: int) -> dict:
    """vLLM-CPU settings read by the engine process at start-up."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_core_range(os.cpu_count() or 1, local_rank, local_world),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }


# collective_rpc may carry a function (reload_and_retie) only with this set.
_RPC_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _generation_bar(iterable=None, **kwargs):
    """Passed to vLLM as `use_tqdm`: its "Processed prompts" pass becomes dsrl's single
    "generate" bar; its prompt-rendering pass (over `iterable`) gets none."""
    if iterable is not None:
        return iterable
    return progress(total=kwargs.get("total"), desc="generate", unit="sample", leave=False)


class VLLMWorker:
    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 512,
                 kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 local_rank: int = 0, local_world: int = 1, weights_dir: Optional[str] = None):
        from vllm import LLM

        # Read once by the spawned engine process; set before it starts.
        os.environ.update(_RPC_ENV)
        if not torch.cuda.is_available():
            os.environ.update(_cpu_env(kv_cache_gib, local_rank, local_world))
        self.weights_dir = weights_dir
        # Per-request seeds (dsrl.rollout.seeds) on CPU: a prefill split across engine steps discards
        # the sampled token and rewinds the request's generator with set_offset, which CPU torch
        # generators do not support ("CPU Generator does not use offset"). Without chunked prefill a
        # prompt that does not fit the step's token budget waits for the next step instead.
        cpu_only = {} if torch.cuda.is_available() else {"enable_chunked_prefill": False}
        t0 = time.time()
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                       disable_log_stats=True, use_tqdm_on_load=False, **cpu_only)
        self.start_seconds = time.time() - t0
        self._procs = engine_processes(self.llm)

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens: int, show_progress: bool = False,
                 seeds: Optional[Sequence[int]] = None) -> List[List[Completion]]:
        """n completions per prompt, each with its sampling log-probs. `seeds` (one per prompt)
        makes sampling independent of the engine's RNG state and batching order."""
        from vllm import SamplingParams

        greedy = temperature == 0.0
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        params = [SamplingParams(n=n, temperature=temperature, top_p=1.0 if greedy else top_p,
                                 max_tokens=max_tokens, logprobs=None if greedy else 0,
                                 seed=None if seeds is None or greedy else int(seeds[i]))
                  for i in range(len(prompt_ids))]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params,
                                 use_tqdm=_generation_bar if show_progress else False)
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

    def push_weights(self, state: dict, step: int) -> float:
        """Reload the engine's weights from the trainer's full state dict; returns seconds."""
        from safetensors.torch import save_file

        t0 = time.time()
        os.makedirs(self.weights_dir, exist_ok=True)
        path = os.path.join(self.weights_dir, "model.safetensors")
        tmp = path + ".tmp"
        save_file(state, tmp, metadata={"format": "pt", "step": str(step)})
        os.replace(tmp, path)
        self.llm.collective_rpc(reload_and_retie, args=(self.weights_dir,))
        # Cached prefix KV was computed with the old weights: drop it.
        self.llm.reset_prefix_cache()
        return time.time() - t0

    def reload_pushed_weights(self) -> bool:
        """Load the last pushed weights file into the engine (a rebuilt engine starts from the
        model folder's weights); False when nothing was pushed yet."""
        if self.weights_dir is None or not os.path.isfile(os.path.join(self.weights_dir, "model.safetensors")):
            return False
        self.llm.collective_rpc(reload_and_retie, args=(self.weights_dir,))
        self.llm.reset_prefix_cache()
        return True

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
