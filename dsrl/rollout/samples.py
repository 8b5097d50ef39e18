"""Turn prompts into scored rollout samples, and pack samples into training microbatches."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from dsrl.actor.batch import Sample, collate
from dsrl.rollout.rewards import RewardGuard


def generate_samples(worker, prompt_ids: Sequence[Sequence[int]], prompts: Sequence, verifier: Callable, *,
                     n: int, temperature: float, top_p: float, max_tokens: int, show_progress: bool,
                     index_offset: int = 0, seeds: Optional[Sequence[int]] = None) -> List[Sample]:
    """Sample `n` completions per prompt (request seeds: dsrl.rollout.seeds) and score each with
    the verifier (a dsrl.rollout.rewards.RewardGuard is told which sample it scores)."""
    groups = worker.generate(prompt_ids, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             show_progress=show_progress, seeds=seeds)
    samples = []
    for g, (pids, prompt, comps) in enumerate(zip(prompt_ids, prompts, groups)):
        for c in comps:
            if len(c.logprobs) != len(c.token_ids):
                raise RuntimeError(f"vLLM returned {len(c.logprobs)} log-probs for {len(c.token_ids)} tokens")
            index = index_offset + len(samples)
            if isinstance(verifier, RewardGuard):
                reward = verifier.score(c.text, prompt, where=f"prompt {g} (sample {index})")
            else:
                reward = float(verifier(c.text, prompt))
            samples.append(Sample(prompt_ids=list(pids), response_ids=c.token_ids, rollout_log_probs=c.logprobs,
                                  group=g, index=index, reward=reward, finish_reason=c.finish_reason, text=c.text))
    return samples


def pack_microbatches(samples: Sequence[Sample], micro_batch_size: int, pad_id: int,
                      token_fields: dict | None = None) -> List[dict]:
    """Consecutive chunks of `micro_batch_size` samples (a group's samples stay adjacent).

    token_fields: name -> list aligned with `samples` of per-response-token tensors."""
    out = []
    for i in range(0, len(samples), micro_batch_size):
        chunk = samples[i: i + micro_batch_size]
        fields = {k: v[i: i + micro_batch_size] for k, v in (token_fields or {}).items()}
        out.append(collate(chunk, pad_id, fields))
    return out
