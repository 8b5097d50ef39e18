"""Fault counters of one step, summed over ranks: engine restarts (dsrl.rollout.resilient) and
failed rewards (dsrl.rollout.rewards); and the kill points tests use to kill a run inside a phase."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Dict, Iterator, Mapping, Optional, Protocol, runtime_checkable

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


# ---------------------------------------------------------------------------------------- kill points
# Tests kill a whole run at chosen moments (tests/e2e/test_kill_anywhere.py): DSRL_KILL_AT holds
# `phase@step:seconds` entries (comma-separated). Inside `kill_point(phase, step)` with a matching
# entry, the process group gets SIGKILL `seconds` after the phase began, or as the phase ends if it
# ends sooner: the kill always lands inside the phase. Unset (every real run): nothing happens.
KILL_ENV = "DSRL_KILL_AT"
KILL_PHASES = ("rollout", "scoring", "optimizer", "weight_push", "checkpoint")


def _kill_plan() -> Dict[tuple, float]:
    plan = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(KILL_ENV, "").split(","))):
        where, _, seconds = entry.partition(":")
        phase, _, step = where.partition("@")
        if phase not in KILL_PHASES or not step.isdigit():
            raise ValueError(f"{KILL_ENV}={os.environ[KILL_ENV]!r}: {entry!r} is not phase@step:seconds with phase "
                             f"one of {KILL_PHASES}")
        plan[(phase, int(step))] = float(seconds or 0.0)
    return plan


def _kill_group() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


@contextlib.contextmanager
def kill_point(phase: str, step: int) -> Iterator[None]:
    """The body is one phase of step `step` where DSRL_KILL_AT may kill the run (see above)."""
    seconds = _kill_plan().get((phase, step)) if os.environ.get(KILL_ENV) else None
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, _kill_group)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        _kill_group()  # the phase ended before the timer: killed at its end, still inside it
