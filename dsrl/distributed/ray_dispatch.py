"""Spreading one call's work over several engines: least outstanding work first, results back
in the order of the work. Knows nothing about Ray or vLLM (the caller passes `submit`, `wait`,
`fetch`), so the policy is tested with fake engines and used with Ray actors
(dsrl.rollout.ray_engines).

Each trainer rank dispatches its own prompts. A rank knows only its own in-flight work, so ranks
break ties from different engines (`first`); every engine runs its calls one at a time in
arrival order, which evens out what the ranks send together."""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple


class DispatchTimeout(Exception):
    """No chunk finished before the deadline; `engines` are the ones that still held work."""

    def __init__(self, engines: Sequence[int], timeout_s: float):
        super().__init__(f"no answer within {timeout_s:g} s from engine(s) {sorted(set(engines))}")
        self.engines, self.timeout_s = sorted(set(engines)), timeout_s


def split_even(n_items: int, n_chunks: int) -> List[Tuple[int, int]]:
    """[start, stop) ranges covering 0..n_items in at most `n_chunks` contiguous, non-empty
    pieces whose sizes differ by at most one."""
    if n_items < 0 or n_chunks < 1:
        raise ValueError(f"n_items={n_items} must be >= 0 and n_chunks={n_chunks} >= 1")
    n_chunks = min(n_chunks, n_items)
    out, start = [], 0
    for k in range(n_chunks):
        size = n_items // n_chunks + (1 if k < n_items % n_chunks else 0)
        out.append((start, start + size))
        start += size
    return out


class LeastOutstanding:
    """Engine choice: the one with the least outstanding work (sum of the costs of its chunks in
    flight), among those below `max_inflight` chunks; ties go to the first such engine counting
    from `first` (a rotation, so ranks that start at different engines do not pile up)."""

    def __init__(self, n_engines: int, *, max_inflight: int, first: int = 0):
        if n_engines < 1 or max_inflight < 1:
            raise ValueError(f"n_engines={n_engines} and max_inflight={max_inflight} must be >= 1")
        self.n, self.max_inflight, self.first = n_engines, max_inflight, first % n_engines
        self.load = [0.0] * n_engines
        self.inflight = [0] * n_engines

    def pick(self) -> Optional[int]:
        """An engine that can take a chunk now, or None when every engine is full."""
        best = None
        for k in range(self.n):
            e = (self.first + k) % self.n
            if self.inflight[e] < self.max_inflight and (best is None or self.load[e] < self.load[best]):
                best = e
        return best

    def started(self, engine: int, cost: float) -> None:
        self.load[engine] += cost
        self.inflight[engine] += 1

    def finished(self, engine: int, cost: float) -> None:
        self.load[engine] -= cost
        self.inflight[engine] -= 1


def dispatch_in_order(chunks: Sequence, n_engines: int, *, submit: Callable[[int, object], object],
                      wait: Callable[[list, float], list], fetch: Callable[[int, object], object],
                      cost: Callable[[object], float] = lambda c: 1.0, max_inflight: int = 2, first: int = 0,
                      timeout_s: float = float("inf"), on_done: Optional[Callable[[int, object], None]] = None) -> list:
    """Run every chunk on some engine and return their results in the order of `chunks`.

    submit(engine, chunk) -> handle starts a chunk; wait(handles, seconds) -> the handles that are
    done (possibly none) after at most `seconds`; fetch(engine, handle) -> the chunk's result (it
    raises the engine's error, which propagates at once). A new chunk goes out whenever an engine
    has room (`LeastOutstanding`). `timeout_s` bounds the whole call: when it passes with work
    still out, DispatchTimeout names the engines that held it."""
    policy = LeastOutstanding(n_engines, max_inflight=max_inflight, first=first)
    results: List[object] = [None] * len(chunks)
    pending: Dict[object, Tuple[int, int, float]] = {}  # handle -> (chunk index, engine, cost)
    deadline = time.monotonic() + timeout_s
    next_chunk = 0
    while next_chunk < len(chunks) or pending:
        while next_chunk < len(chunks):
            engine = policy.pick()
            if engine is None:
                break
            c = cost(chunks[next_chunk])
            handle = submit(engine, chunks[next_chunk])
            policy.started(engine, c)
            pending[handle] = (next_chunk, engine, c)
            next_chunk += 1
        left = deadline - time.monotonic()
        done = wait(list(pending), max(left, 0.0))
        if not done:
            if time.monotonic() >= deadline:
                raise DispatchTimeout([e for _, e, _ in pending.values()], timeout_s)
            continue
        for handle in done:
            index, engine, c = pending.pop(handle)
            results[index] = fetch(engine, handle)
            policy.finished(engine, c)
            if on_done is not None:
                on_done(engine, chunks[index])
    return results
