"""The detach boundaries for fixed training inputs.

Old-policy, rollout, reference and teacher log-probs, OPD reverse KL and advantages are scores
produced *before* the policy update: they are data, not functions of the parameters being
trained. A custom or fused scorer can still hand back a tensor that carries a graph; if it reached
a PPO ratio it would keep that graph alive and, worse, send gradient into a score. So they are cut
twice: persistently where the rollout batch is stored (`detach_fixed_scores`, called first by
`compute_advantages`) and defensively where an objective consumes them (`fixed`).
"""
from __future__ import annotations

from typing import Any, MutableMapping

import torch

FIXED_KEYS = ("old_log_probs", "rollout_log_probs", "ref_log_probs", "teacher_log_probs",
              "opd_reverse_kl", "advantages", "returns")


def fixed(x: Any) -> Any:
    """Detached view of a fixed input: tensors are detached, lists/tuples element-wise, None and
    non-tensors pass through unchanged."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (list, tuple)):
        return [fixed(t) for t in x]
    return x


def detach_fixed_scores(rollout_data: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Detach every fixed score in `rollout_data` and write it back in place, so later readers
    (advantages, logging, the loss) can only ever see graph-free tensors. Returns the mapping."""
    for key in FIXED_KEYS:
        value = rollout_data.get(key)
        if value is not None:
            rollout_data[key] = fixed(value)
    return rollout_data
