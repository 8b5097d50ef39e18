"""Turn prompts into scored rollout samples, and pack samples into training microbatches."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from dsrl.actor.batch import Sample, collate
from dsrl.actor.packing import plan_microbatches
from dsrl.actor.shared_prompt import collate_shared_prompt
from dsrl.rollout.rewards import RewardGuard


def generate_samples(worker, prompt_ids: Sequence[Sequence[int]], prompts: Sequence, verifier: Callable, *,
                     n: int, temperature: float, top_p: float, max_tokens: int, show_progress: bool,
                     index_offset: int = 0, seeds: Optional[Sequence[int]] = None) -> List[Sample]:
    """Sample `n` completions per prompt (request seeds: dsrl.rollout.seeds) and score each with
    the verifier (a dsrl.rollout.rewards.RewardGuard is told which sample it scores)."""
    groups = worker.generate(prompt_ids, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             show_progress=show_progress, seeds=seeds)
    samples, calls = [], []
    for g, (pids, prompt, comps) in enumerate(zip(prompt_ids, prompts, groups)):
        for c in comps:
            if len(c.logprobs) != len(c.token_ids):
                raise RuntimeError(f"vLLM returned {len(c.logprobs)} log-probs for {len(c.token_ids)} tokens")
            index = index_offset + len(samples)
            calls.append((c.text, prompt, f"prompt {g} (sample {index})"))
            samples.append(Sample(prompt_ids=list(pids), response_ids=c.token_ids, rollout_log_probs=c.logprobs,
                                  group=g, index=index, finish_reason=c.finish_reason, text=c.text))
    for s, r in zip(samples, score_calls(verifier, calls)):
        s.reward = r
    return samples


def score_calls(verifier: Callable, calls: Sequence[tuple]) -> List[float]:
    """Rewards of (text, prompt, label) calls, all at once: a RewardGuard keeps reward.concurrency
    calls in flight (and names the label of a call that fails)."""
    if isinstance(verifier, RewardGuard):
        return verifier.score_many(calls)
    return [float(verifier(text, prompt)) for text, prompt, _ in calls]


def pack_microbatches(samples: Sequence[Sample], micro_batch_size: int, pad_id: int,
                      token_fields: dict | None = None, *, max_tokens: int = 0,
                      shared_prompt: bool = False) -> List[dict]:
    """Training/scoring microbatches of `samples` (plan: dsrl.actor.packing.plan_microbatches).

    max_tokens = 0: consecutive chunks of `micro_batch_size` samples (a group's samples stay
    adjacent); > 0: token-budget bins of rows of similar length. shared_prompt: each run of
    samples sharing a prompt is one packed row (dsrl.actor.shared_prompt), per-token fields are
    response-aligned; otherwise the dense right-padded layout (dsrl.actor.batch.collate).
    token_fields: name -> list aligned with `samples` of per-response-token tensors."""
    plan = plan_microbatches(samples, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                             shared_prompt=shared_prompt)
    return collate_plan(samples, plan, pad_id, token_fields, shared_prompt=shared_prompt)


def collate_plan(samples: Sequence[Sample], plan: Sequence[Sequence[int]], pad_id: int,
                 token_fields: dict | None = None, *, shared_prompt: bool = False) -> List[dict]:
    """One microbatch per entry of `plan` (indices into `samples`, as plan_microbatches gives
    them), in the layout `shared_prompt` names. A token-budget plan reorders the samples: a
    caller that reads per-sample outputs back maps microbatch row j of plan entry k to sample
    plan[k][j] (dsrl.stages.critic.CriticUpdate.values)."""
    build = collate_shared_prompt if shared_prompt else collate
    out = []
    for idx in plan:
        fields = {k: [v[i] for i in idx] for k, v in (token_fields or {}).items()}
        out.append(build([samples[i] for i in idx], pad_id, fields))
    return out
