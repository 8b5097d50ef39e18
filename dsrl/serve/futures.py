"""Futures ("promises") of the Tinker wire: every mutating call answers at once with a
``request_id``; the result is fetched with ``retrieve_future``, which long-polls.

Results are set from the compute threads and awaited from the HTTP event loop, so each future
is a `concurrent.futures.Future`. The SDK re-polls immediately after a ``try_again``, so the
server holds each poll until the result is ready or ``hold_seconds`` pass (kept well below the
SDK's 45 s read timeout)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Optional, Union

from dsrl.serve.errors import failure_body


@dataclass(frozen=True)
class JsonReply:
    body: dict


@dataclass(frozen=True)
class ProtoReply:
    body: bytes


Reply = Union[JsonReply, ProtoReply]


def reply_bytes(reply: Reply) -> int:
    """What a finished reply holds, in bytes (a JSON body: its serialized length)."""
    if isinstance(reply, ProtoReply):
        return len(reply.body)
    return len(json.dumps(reply.body, default=str))


class FutureStore:
    """request_id -> future of a Reply (a failure is a JsonReply with an ``error`` key). Finished
    futures are kept (an SDK retry of retrieve_future must find them again) up to ``keep``
    entries and ``max_bytes`` of replies (serve.max_future_bytes), the oldest finished ones
    dropped first (a reply nobody fetches must not hold the server's memory); an unknown or
    dropped id is answered 410 by the HTTP layer, `expired` tells the two apart."""

    def __init__(self, keep: int = 100_000, max_bytes: int = 1 << 30):
        self._futures: "OrderedDict[str, concurrent.futures.Future]" = OrderedDict()
        self._sizes: Dict[str, int] = {}  # finished request id -> reply bytes
        self._held = 0
        self._dropped: "OrderedDict[str, None]" = OrderedDict()  # the last ids dropped (for messages)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._keep = int(keep)
        self._max_bytes = int(max_bytes)

    @property
    def held_bytes(self) -> int:
        return self._held

    def create(self) -> str:
        rid = f"req-{next(self._ids)}"
        with self._lock:
            self._futures[rid] = concurrent.futures.Future()
            self._evict()
        return rid

    def _evict(self) -> None:
        """Drop the oldest finished futures while over either bound (caller holds the lock). The
        newest finished reply is kept even alone over ``max_bytes``: its client is polling for it."""
        while len(self._futures) > self._keep or (self._held > self._max_bytes and len(self._sizes) > 1):
            victim = next((rid for rid in self._futures if rid in self._sizes), None)
            if victim is None:
                return
            del self._futures[victim]
            self._held -= self._sizes.pop(victim)
            self._dropped[victim] = None
            while len(self._dropped) > 10_000:
                self._dropped.popitem(last=False)

    def expired(self, rid: str) -> bool:
        """True: ``rid`` finished and was dropped to keep within the bounds."""
        with self._lock:
            return rid in self._dropped

    def _get(self, rid: str) -> concurrent.futures.Future:
        with self._lock:
            return self._futures[rid]

    def resolve(self, rid: str, reply: Reply) -> None:
        fut = self._get(rid)
        if fut.done():
            return
        size = reply_bytes(reply)
        with self._lock:
            if rid in self._futures:
                self._sizes[rid] = size
                self._held += size
        fut.set_result(reply)
        with self._lock:
            self._evict()

    def fail(self, rid: str, exc: BaseException) -> None:
        self.resolve(rid, JsonReply(failure_body(exc)))

    def done(self, rid: str) -> bool:
        return self._get(rid).done()

    def result(self, rid: str, timeout: Optional[float] = None) -> Reply:
        """Blocking wait (tests, in-process callers)."""
        return self._get(rid).result(timeout)

    async def wait(self, rid: str, hold_seconds: float) -> Optional[Reply]:
        """The reply, or None if it is not ready within ``hold_seconds``. KeyError: unknown id."""
        fut = self._get(rid)
        if not fut.done():
            waiter = asyncio.wrap_future(fut)
            # asyncio.wait (not wait_for): a timeout must not cancel the underlying future.
            await asyncio.wait({waiter}, timeout=hold_seconds)
            if not fut.done():
                return None
        return fut.result()

