"""Per-client request order (tinker-protocol §2.6): each training client numbers its requests
seq_id = 1, 2, 3, ... and the server must run them in exactly that order, whatever order they
arrive in (the SDK sends a forward_backward's first chunk last), and must answer a retried
request (same model, same seq_id) with the original request id instead of running it twice.

`Sequencer.submit` is called once per arriving request; it returns the request id (new or the
original one) and hands the ops that became runnable, in order, to ``dispatch``."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple


@dataclass
class _Lane:
    next_seq: int
    pending: Dict[int, Any] = field(default_factory=dict)  # seq_id -> op that arrived early
    seen: Dict[int, str] = field(default_factory=dict)  # seq_id -> request id (de-duplication)


class Sequencer:
    def __init__(self, dispatch: Callable[[List[Any]], None], *, max_pending: int = 256):
        """``max_pending``: most requests of one lane that may wait for an earlier seq_id
        (serve.max_pending_requests); each holds its decoded payload until it runs."""
        self._lanes: Dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._dispatch = dispatch
        self._max_pending = int(max_pending)

    def open(self, key: str, first_seq: int = 1) -> None:
        """Start a lane (a new training client); its first request must carry ``first_seq``."""
        with self._lock:
            self._lanes.setdefault(key, _Lane(next_seq=int(first_seq)))

    def close(self, key: str) -> List[Tuple[int, Any]]:
        """End lane ``key``; returns the (seq_id, op) that arrived early and will now never run, in
        seq order (their futures must be answered: nobody else will)."""
        with self._lock:
            lane = self._lanes.pop(key, None)
        return sorted(lane.pending.items(), key=lambda kv: kv[0]) if lane else []

    def is_open(self, key: str) -> bool:
        with self._lock:
            return key in self._lanes

    def submit(self, key: str, seq_id: int, new_request_id: Callable[[], str],
               make_op: Callable[[str], Any]) -> Tuple[str, bool]:
        """Register request ``seq_id`` of lane ``key``. Returns (request_id, is_new). A duplicate
        gets the original id and nothing runs. ``make_op(request_id)`` builds the op; ops run in
        seq order, each as soon as all earlier ones were dispatched. KeyError: unknown lane;
        ValueError: a seq_id below the lane's next one that was never seen (cannot be run in order),
        or one that would wait while ``max_pending`` requests of the lane wait already (nothing
        of it is kept: the client may send it again once the gap before it is filled)."""
        ready: List[Any] = []
        with self._lock:
            lane = self._lanes[key]
            if seq_id in lane.seen:
                return lane.seen[seq_id], False
            if seq_id < lane.next_seq:
                raise ValueError(f"seq_id {seq_id} is below the next expected seq_id {lane.next_seq} "
                                 f"of {key!r} and was never received")
            if seq_id != lane.next_seq and len(lane.pending) >= self._max_pending:
                raise ValueError(f"seq_id {seq_id} would wait behind seq_id {lane.next_seq} (not received yet) "
                                 f"with {len(lane.pending)} requests of {key!r} waiting already, the most "
                                 f"serve.max_pending_requests={self._max_pending} allows")
            rid = new_request_id()
            lane.seen[seq_id] = rid
            lane.pending[seq_id] = make_op(rid)
            while lane.next_seq in lane.pending:
                ready.append(lane.pending.pop(lane.next_seq))
                lane.next_seq += 1
            if ready:
                # Under the lock: two threads releasing ops of one lane must not interleave.
                self._dispatch(ready)
        return rid, True

    def waiting(self, key: str) -> List[int]:
        """seq_ids that arrived early and wait for a gap to fill (diagnostics)."""
        with self._lock:
            lane = self._lanes.get(key)
            return sorted(lane.pending) if lane else []
