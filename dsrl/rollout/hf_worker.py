"""`rollout.backend=hf`: a rollout worker on plain transformers, in the trainer's process.

For machines where vLLM cannot be installed (a GPU box with only torch), and for a loop without
engine processes. Same interface as dsrl.rollout.vllm_worker.VLLMWorker: `generate` returns, per
prompt, n Completions with per-token sampling log-probs, finish reason and text.

Sampling is a plain loop with a KV cache (exact log-probs matter more than speed): one prompt at
a time, its n samples as a batch (identical prompts, so no padding and no position bookkeeping).
Each token's log-prob is log_softmax of the processed logits, exactly as vLLM's
`processed_logprobs` (what VLLMWorker asks for): logits / temperature, and under top_p < 1 the
tokens outside the nucleus set to -inf (so the log-prob is over the renormalized nucleus). Sample
k of a prompt with seed s draws from its own generator seeded s + k (vLLM's convention), so a
draw does not depend on batching. Greedy (temperature 0) returns no log-probs, like VLLMWorker.

Weights: `module=` shares a live model (the actor's module under ZeRO 0-2: no copy, the push is
a no-op); without it the worker loads its own copy of `model_path` (needed under ZeRO-3, where
the actor's parameters are partitioned) and `push_weights` copies the trainer's full weights in."""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch

from dsrl.rollout.vllm_engine import Completion, per_prompt
from dsrl.tracking.progress import progress

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def nucleus_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` [B, V] with every token outside the top-p nucleus set to -inf. The nucleus is the
    smallest set of most likely tokens whose probability reaches top_p (the most likely token
    always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class HFWorker:
    """A rollout worker on a transformers causal LM (see module docstring)."""

    def __init__(self, model_path: str, *, module: Optional[torch.nn.Module] = None, dtype: str = "float32",
                 device=None, seed: int = 0, max_model_len: int = 512, tokenizer=None,
                 eos_token_ids: Optional[Sequence[int]] = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.time()
        self.shared = module is not None
        if module is None:
            if dtype not in _DTYPES:
                raise ValueError(f"rollout.dtype={dtype!r}: the hf backend takes one of {sorted(_DTYPES)}")
            if device is None:
                from deepspeed.accelerator import get_accelerator

                device = get_accelerator().current_device_name()  # cuda:LOCAL_RANK on CUDA
            module = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(device)
            module.eval()
            for p in module.parameters():
                p.requires_grad_(False)
        self.module = module
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
        self.max_model_len = int(max_model_len)
        self.eos_token_ids = set(int(t) for t in (eos_token_ids if eos_token_ids is not None
                                                  else _eos_ids(module, self.tokenizer)))
        self._generator_seed = int(seed)
        self._calls = 0
        self.start_seconds = time.time() - t0

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens, show_progress: bool = False,
                 seeds: Optional[Sequence[int]] = None, stop=None) -> List[List[Completion]]:
        """n completions per prompt, each with its sampling log-probs (see module docstring);
        `max_tokens` one for all or one per prompt. Stop strings are not supported here."""
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        if stop is not None and any(stop):
            raise ValueError("stop strings: rollout.backend=hf has none (use a vLLM backend)")
        caps, _ = per_prompt(len(prompt_ids), max_tokens)
        if n < 1 or min(caps, default=1) < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"n={n}, max_tokens={max_tokens} must be >= 1, temperature={temperature} >= 0, "
                             f"top_p={top_p} in (0, 1]")
        self._calls += 1
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                out = []
                bar = progress(total=len(prompt_ids), desc="generate", unit="prompt", enabled=show_progress)
                with bar:
                    for i, ids in enumerate(prompt_ids):
                        base = None if seeds is None else int(seeds[i])
                        out.append(self._sample_group(list(ids), i, n, temperature, top_p, caps[i], base))
                        bar.update(1)
                return out
        finally:
            self.module.train(was_training)

    def _generators(self, n: int, base: Optional[int], prompt_index: int) -> List[torch.Generator]:
        """One generator per sample: seed base + k (vLLM's per-request convention); without a
        request seed, one derived from the worker seed, the call count and the prompt index."""
        if base is None:
            base = (self._generator_seed * 1_000_003 + self._calls * 10_007 + prompt_index) * 65_536
        gens = []
        for k in range(n):
            g = torch.Generator(device=self.device)
            g.manual_seed((base + k) % (1 << 63))
            gens.append(g)
        return gens

    def _sample_group(self, ids: list, prompt_index: int, n: int, temperature: float, top_p: float,
                      max_tokens: int, base_seed: Optional[int]) -> List[Completion]:
        if len(ids) == 0:
            raise ValueError(f"prompt {prompt_index} is empty")
        budget = min(max_tokens, self.max_model_len - len(ids))
        if budget < 1:
            raise ValueError(f"prompt {prompt_index} has {len(ids)} tokens: no room under max_model_len="
                             f"{self.max_model_len}")
        greedy = temperature == 0.0
        gens = None if greedy else self._generators(n, base_seed, prompt_index)
        dev = self.device
        tokens = [[] for _ in range(n)]
        logps = [[] for _ in range(n)]
        done = [None] * n  # finish reason once finished
        step_input = torch.tensor([ids] * n, dtype=torch.long, device=dev)
        cache = None
        for _ in range(budget):
            out = self.module(input_ids=step_input, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            if greedy:
                nxt = logits.argmax(dim=-1)
                lp = None
            else:
                processed = nucleus_logits(logits / temperature, top_p)
                logp_all = torch.log_softmax(processed, dim=-1)
                probs = logp_all.exp()
                nxt = torch.stack([torch.multinomial(probs[k], 1, generator=gens[k])[0] for k in range(n)])
                lp = logp_all.gather(-1, nxt[:, None])[:, 0]
            nxt_host = nxt.tolist()
            lp_host = None if lp is None else lp.tolist()
            for k in range(n):
                if done[k] is not None:
                    continue
                tokens[k].append(int(nxt_host[k]))
                if lp_host is not None:
                    logps[k].append(float(lp_host[k]))
                if int(nxt_host[k]) in self.eos_token_ids:
                    done[k] = "stop"
            if all(d is not None for d in done):
                break
            step_input = nxt[:, None]  # finished rows keep decoding; their tokens are dropped
        return [Completion(tokens[k], logps[k], done[k] or "length",
                           self.tokenizer.decode(tokens[k], skip_special_tokens=True)) for k in range(n)]

    # ------------------------------------------------------------------ weights and lifetime
    def push_weights(self, weights, step: int) -> float:
        """Shared module: nothing to do (the rollout already uses the trainer's live weights).
        Own copy: copy the trainer's full HF-named weights in, given as a state dict or as
        weight buckets (dsrl.rollout.buckets, what dsrl.rollout.weight_sync sends). Every weight
        must arrive (a tied lm_head follows its embedding): a partial push is an error."""
        t0 = time.time()
        if self.shared:
            return time.time() - t0
        if isinstance(weights, dict):
            named = weights.items()
        else:
            from dsrl.rollout.buckets import unpack

            named = (item for bucket in weights for item in unpack(bucket))
        targets = dict(self.module.named_parameters())
        targets.update((n, b) for n, b in self.module.named_buffers() if n not in targets)
        seen, unknown = set(), []
        with torch.no_grad():
            for name, tensor in named:
                target = targets.get(name)
                if target is None:
                    unknown.append(name)
                    continue
                target.copy_(tensor.to(device=target.device, dtype=target.dtype).view(target.shape))
                seen.add(name)
        tied = bool(getattr(self.module.config, "tie_word_embeddings", False))
        missing = [n for n, _ in self.module.named_parameters() if n not in seen and not (tied and n == "lm_head.weight")]
        if missing or unknown:
            raise RuntimeError(f"hf rollout worker: pushed weights of step {step} do not match the model "
                               f"(missing {missing[:5]}, unexpected {unknown[:5]})")
        return time.time() - t0

    def probe_logprobs(self, token_id_lists) -> list:
        """Per sequence, the log-prob of each token after the first given the ones before (raw
        log_softmax in float32, no temperature): the weight-sync check of dsrl.rollout.weight_sync."""
        out = []
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for seq in token_id_lists:
                    ids = torch.tensor([list(seq)], dtype=torch.long, device=self.device)
                    logits = self.module(input_ids=ids, use_cache=False).logits[0, :-1].float()
                    out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist())
        finally:
            self.module.train(was_training)
        return out

    def reload_pushed_weights(self) -> bool:
        """The worker lives in the trainer's process: it never restarts with stale weights."""
        return False

    def engine_alive(self) -> bool:
        return self.module is not None

    def sleep(self, level: int = 1) -> None:
        """No engine memory of its own to release (in-process model)."""

    def wake_up(self, tags=None) -> None:
        """See sleep."""

    def kill(self) -> None:
        self.close()

    def close(self) -> None:
        self.module = None


def _eos_ids(module, tokenizer) -> list:
    """End-of-sequence ids as vLLM takes them: the generation config's (one id or a list), the
    model config's, and the tokenizer's."""
    out = []
    for src in (getattr(module, "generation_config", None), getattr(module, "config", None), tokenizer):
        value = getattr(src, "eos_token_id", None)
        if value is None:
            continue
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    if not out:
        raise ValueError("hf rollout worker: the model and tokenizer name no eos_token_id")
    return out
