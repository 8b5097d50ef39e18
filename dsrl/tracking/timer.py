"""Per-phase wall-clock timing within one RL step.

    timer = PhaseTimer(phases=("rollout", "old_logprobs", "ref_logprobs", "train", "weight_sync"))
    with timer.phase("rollout"):
        ...
    metrics.update(timer.pop())   # {"timing/rollout": 1.23, "timing/old_logprobs": 0.0, ...}

A phase entered several times in one step accumulates. Declared phases that
were never entered are reported as 0.0 (e.g. ``old_logprobs`` when log-prob
reuse skips that pass), so every step has the same keys.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, Optional

__all__ = ["PhaseTimer"]


class PhaseTimer:
    def __init__(
        self,
        phases: Iterable[str] = (),
        *,
        prefix: str = "timing/",
        clock: Callable[[], float] = time.perf_counter,
        sync: Optional[Callable[[], None]] = None,
    ) -> None:
        """``sync`` (e.g. ``torch.cuda.synchronize``) is called before each clock
        read so that asynchronous device work is charged to the right phase."""
        self._declared = tuple(phases)
        for name in self._declared:
            self._check_name(name)
        self._prefix = prefix
        self._clock = clock
        self._sync = sync
        self._totals: Dict[str, float] = {}
        self._active: set[str] = set()

    @staticmethod
    def _check_name(name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body and add it to ``name``'s total for this step."""
        self._check_name(name)
        if name in self._active:
            raise RuntimeError(f"phase {name!r} is already running (nested entry would double count)")
        self._active.add(name)
        start = self._now()
        try:
            yield
        finally:
            elapsed = self._now() - start
            self._active.discard(name)
            self._totals[name] = self._totals.get(name, 0.0) + elapsed

    def elapsed(self, name: str) -> float:
        """Seconds accumulated so far in this step for ``name`` (0.0 if none)."""
        return self._totals.get(name, 0.0)

    def pop(self) -> Dict[str, float]:
        """Return ``{prefix + phase: seconds}`` for this step and start a new one.

        Declared phases come first, in declaration order, then any other phase
        in first-entry order.
        """
        if self._active:
            raise RuntimeError(f"cannot pop while phases are running: {sorted(self._active)}")
        out: Dict[str, float] = {}
        for name in self._declared:
            out[self._prefix + name] = float(self._totals.get(name, 0.0))
        for name, secs in self._totals.items():
            out.setdefault(self._prefix + name, float(secs))
        self._totals = {}
        return out
