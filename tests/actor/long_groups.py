"""Samples whose shared-prompt rows attend by blocks (dsrl.actor.block_attention)."""
import torch

from dsrl.actor.batch import Sample


def long_group(generator: torch.Generator, prompt_len: int, group: int, first_index: int, n: int = 8,
               lengths=(24, 31), vocab=(5, 400)) -> list:
    """One group of `n` responses of 24-30 random tokens after a random prompt: its shared row is
    long enough (vs the blocks it needs) to attend by blocks."""
    prompt = torch.randint(*vocab, (prompt_len,), generator=generator).tolist()
    out = []
    for k in range(n):
        r = int(torch.randint(*lengths, (1,), generator=generator))
        out.append(Sample(prompt_ids=prompt, response_ids=torch.randint(*vocab, (r,), generator=generator).tolist(),
                          rollout_log_probs=[0.0] * r, group=group, index=first_index + k))
    return out
