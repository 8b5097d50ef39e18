"""Fault counters of one step, summed over ranks: engine restarts (dsrl.rollout.resilient) and
failed rewards (dsrl.rollout.rewards)."""
from __future__ import annotations

import torch

from dsrl.distributed.collectives import all_reduce_


def fault_metrics(*sources) -> dict:
    """Sum each source's counters over ranks: a dict of counts taken earlier, or an object whose
    `pop_metrics()` gives them now (objects without one are ignored). Collective: every rank
    passes sources of the same kinds."""
    local: dict = {}
    for source in sources:
        if isinstance(source, dict):
            counts = source
        else:
            pop = getattr(source, "pop_metrics", None)
            counts = pop() if pop is not None else {}
        for name, value in counts.items():
            local[name] = local.get(name, 0.0) + float(value)
    names = sorted(local)
    if not names:
        return {}
    t = all_reduce_(torch.tensor([local[n] for n in names], dtype=torch.float64))
    return dict(zip(names, t.tolist()))
