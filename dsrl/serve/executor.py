"""The compute thread: runs the ops that the sequencer released, one batch at a time.

A batch is the first queued op plus every later queued op with the same ``merge_key`` that may
run with it without breaking any client's order: scanning the queue, an op is taken only if no
earlier op of its client stayed behind. So consecutive forward_backward chunks of one client
(the SDK sends the first chunk last, all of them at once) become one forward, and so do
requests of several LoRA slots, and several slots' optim_steps become one optimizer step (one
per slot: a client's second optim_step waits for the next batch)."""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Hashable, List, Optional

log = logging.getLogger("dsrl.serve")


@dataclass
class Op:
    kind: str  # create | fwdbwd | optim | save_state | load_state | save_sampler | release | fail
    lane: str  # the training client (model id) whose order the op belongs to
    request_id: str
    payload: Any = None
    merge_key: Optional[Hashable] = None  # ops with equal non-None keys may run as one batch
    size: int = 1  # datums (fwdbwd) for the batch cap
    extra: dict = field(default_factory=dict)
    # False: at most one op of this lane in a batch (two optim_steps of one client are two steps;
    # consecutive forward_backward chunks of one client do merge).
    merges_within_lane: bool = True


class Executor:
    def __init__(self, run_batch: Callable[[List[Op]], None], *, max_batch_size: int = 256, name: str = "compute"):
        self._run_batch = run_batch
        self._max = int(max_batch_size)
        self._queue: Deque[Op] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name=f"dsrl-serve-{name}", daemon=True)
        self._thread.start()

    def put(self, ops: List[Op]) -> None:
        with self._cond:
            self._queue.extend(ops)
            self._cond.notify()

    def _take(self) -> List[Op]:
        first = self._queue.popleft()
        batch = [first]
        if first.merge_key is None:
            return batch
        size = first.size
        blocked = set()
        lanes = {first.lane}
        keep: Deque[Op] = deque()
        for op in self._queue:
            if (op.lane not in blocked and op.merge_key == first.merge_key and size + op.size <= self._max
                    and (op.merges_within_lane or op.lane not in lanes)):
                batch.append(op)
                size += op.size
                lanes.add(op.lane)
            else:
                blocked.add(op.lane)
                keep.append(op)
        self._queue = keep
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch = self._take()
                self._busy = True
            try:
                self._run_batch(batch)
            except Exception:  # run_batch fails the futures itself; never let the thread die
                log.exception("serve: unexpected error running %s", [op.kind for op in batch])
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def queued(self) -> int:
        """Ops waiting to run (diagnostics, tests)."""
        with self._cond:
            return len(self._queue)

    def idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until nothing is queued or running (tests, shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout=timeout)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
