"""Which samples go into which training microbatch: by count (today's default) or by a token budget.

A *row* is what one line of the padded input holds: one sample (dense layout) or a run of
consecutive samples sharing their prompt (shared-prompt layout: the prompt once plus every
response). Under a token budget, rows are sorted by length (longest first, stable) and filled
greedily into microbatches whose *padded* size (rows x longest row) stays within the budget, so
rows of similar length share a microbatch and little padding is left; a shared-prompt row longer
than the budget is split into parts (each with the prompt) that fit. The plan is a pure function
of the samples, so every caller that plans the same samples gets the same microbatches."""
from __future__ import annotations

from typing import List, Sequence, Tuple

from dsrl.actor.batch import Sample
from dsrl.actor.shared_prompt import prompt_runs, row_length


def _rows(samples: Sequence[Sample], shared_prompt: bool, max_tokens: int) -> List[List[int]]:
    """Rows (lists of sample indices), in sample order; shared-prompt rows split to the budget."""
    if not shared_prompt:
        return [[i] for i in range(len(samples))]
    rows: List[List[int]] = []
    for run in prompt_runs(samples):
        part: List[int] = []
        for i in run:
            if part and row_length(samples, part + [i]) > max_tokens:
                rows.append(part)
                part = []
            part.append(i)
        rows.append(part)
    return rows


def _length(samples: Sequence[Sample], row: Sequence[int]) -> int:
    return row_length(samples, row)


def plan_microbatches(samples: Sequence[Sample], *, micro_batch_size: int, max_tokens: int = 0,
                      shared_prompt: bool = False) -> List[List[int]]:
    """Sample indices of each microbatch. max_tokens = 0: consecutive chunks of
    `micro_batch_size` samples. max_tokens > 0: token-budget bins (see the module docstring); a
    single row longer than the budget gets a microbatch of its own."""
    n = len(samples)
    if n == 0:
        return []
    if max_tokens <= 0:
        return [list(range(i, min(n, i + micro_batch_size))) for i in range(0, n, micro_batch_size)]
    rows = _rows(samples, shared_prompt, max_tokens)
    lengths = [_length(samples, r) for r in rows]
    order = sorted(range(len(rows)), key=lambda j: -lengths[j])  # stable: ties keep sample order
    bins: List[List[int]] = []
    longest = 0
    count = 0
    for j in order:
        if bins and (count + 1) * longest <= max_tokens:
            bins[-1].extend(rows[j])
            count += 1
        else:
            bins.append(list(rows[j]))
            longest, count = lengths[j], 1
    return bins


def padded_tokens(mb: dict) -> Tuple[int, int]:
    """(padded, total) token positions of a microbatch's input rows."""
    ids = mb["input_ids"]
    total = int(ids.numel())
    if "token_count" in mb:
        real = int(mb["token_count"])
    else:
        real = int(mb["attention_mask"].sum())
    return total - real, total
