"""Fault counters of one step, summed over ranks: engine restarts (dsrl.rollout.resilient) and
failed rewards (dsrl.rollout.rewards)."""
from __future__ import annotations

import torch

from dsrl.distributed.collectives import all_reduce_


def fault_metrics(*sources) -> dict:
    """Pop each source's counters (`pop_metrics()`; sources without one are ignored) and sum
    them over ranks. Collective: every rank passes sources of the same kinds."""
    local: dict = {}
    for source in sources:
        pop = getattr(source, "pop_metrics", None)
        if pop is not None:
            for name, value in pop().items():
                local[name] = local.get(name, 0.0) + float(value)
    names = sorted(local)
    if not names:
        return {}
    t = all_reduce_(torch.tensor([local[n] for n in names], dtype=torch.float64))
    return dict(zip(names, t.tolist()))
