"""Sampling as a function of the seed alone.

Each prompt's request gets its own seed derived from (run seed, step, global prompt index); vLLM
gives the k-th sample of a request the seed s + k. The engine's own RNG and the order in which it
batches requests then no longer matter: a run with the same seed draws the same completions, and
a resumed run draws, at step t, exactly what the uninterrupted run drew at step t."""
from __future__ import annotations

import hashlib
from typing import List

# Seeds are spaced by this much so the per-sample seeds s + k of two prompts never overlap.
_STRIDE = 1 << 16
_MAX = (1 << 62) // _STRIDE


def request_seed(seed: int, step: int, prompt_index: int, sampling_round: int = 0) -> int:
    """A 62-bit seed for one prompt's request, unique per (seed, step, round, prompt_index).
    Round 0 is a step's first generation (the key has no round field: seeds of runs without
    dynamic sampling are unchanged); rounds >= 1 are dynamic sampling's extra generations."""
    key = f"{seed}:{step}:{prompt_index}" if sampling_round == 0 else f"{seed}:{step}:r{sampling_round}:{prompt_index}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") % _MAX) * _STRIDE


def request_seeds(seed: int, step: int, first_prompt: int, count: int, sampling_round: int = 0) -> List[int]:
    """Seeds of `count` consecutive prompts starting at global index `first_prompt`."""
    return [request_seed(seed, step, first_prompt + i, sampling_round) for i in range(count)]
