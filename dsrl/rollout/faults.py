"""Fault counters of one step, summed over ranks: engine restarts (dsrl.rollout.resilient) and
failed rewards (dsrl.rollout.rewards)."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Protocol, runtime_checkable

import torch

from dsrl.distributed.collectives import all_reduce_


@runtime_checkable
class FaultCounter(Protocol):
    """What counts faults between steps (a resilient rollout worker, Ray's engines, the reward
    guard): `pop_metrics` gives the counts since its last call and starts them again."""

    def pop_metrics(self) -> Dict[str, float]: ...


def pop_counts(*sources: FaultCounter, taken: Optional[Mapping[str, float]] = None) -> Dict[str, float]:
    """The counters of `sources`, popped now and summed by name, added to `taken` (counts popped
    earlier). This rank's own: nothing is reduced."""
    counts = dict(taken or {})
    for source in sources:
        for name, value in source.pop_metrics().items():
            counts[name] = counts.get(name, 0.0) + float(value)
    return counts


def fault_metrics(taken: Mapping[str, float], *sources: FaultCounter) -> dict:
    """`taken` (counts popped earlier) and the counters of `sources` popped now (`pop_counts`),
    summed over ranks. Collective: every rank passes sources of the same kinds."""
    local = pop_counts(*sources, taken=taken)
    names = sorted(local)
    if not names:
        return {}
    t = all_reduce_(torch.tensor([local[n] for n in names], dtype=torch.float64))
    return dict(zip(names, t.tolist()))
