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
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Union

from dsrl.serve.errors import failure_body


@dataclass(frozen=True)
class JsonReply:
    body: dict


@dataclass(frozen=True)
class ProtoReply:
    body: bytes


Reply = Union[JsonReply, ProtoReply]


class FutureStore:
    """request_id -> future of a Reply (a failure is a JsonReply with an ``error`` key). Finished
    futures are kept (an SDK retry of retrieve_future must find them again) up to ``keep``
    entries, oldest dropped first; an unknown id is answered 410 by the HTTP layer."""

    def __init__(self, keep: int = 100_000):
        self._futures: "OrderedDict[str, concurrent.futures.Future]" = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._keep = int(keep)

    def create(self) -> str:
        rid = f"req-{next(self._ids)}"
        with self._lock:
            self._futures[rid] = concurrent.futures.Future()
            while len(self._futures) > self._keep:
                oldest, fut = next(iter(self._futures.items()))
                if not fut.done():
                    break
                del self._futures[oldest]
        return rid

    def _get(self, rid: str) -> concurrent.futures.Future:
        with self._lock:
            return self._futures[rid]

    def resolve(self, rid: str, reply: Reply) -> None:
        fut = self._get(rid)
        if not fut.done():
            fut.set_result(reply)

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

