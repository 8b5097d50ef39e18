"""Reward calls that cannot stop a run: a verifier that raises, returns something that is not a
finite number, or takes longer than `reward.timeout_s` gives that sample reward 0; the sample is
counted (`reward/errors`, `reward/timeouts`) and the first such sample of each step is logged
(prompt index, completion excerpt, cause). Training goes on.

Each call runs in its own daemon thread and is waited for at most `timeout_s`; `score_many` keeps up
to `reward.concurrency` calls in flight (a reward server, dsrl.reward.http, is slow per call but
serves many at once). Python cannot
kill a thread: a verifier that never returns keeps running in the background (using the GIL
while it computes), but nothing waits for it -- not the loop, not process exit (daemon thread,
never joined). A verifier that needs the main thread (signal.alarm-based timeouts, say) fails
here; each failure is then counted and logged like any other error."""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import Callable, List, Sequence, Tuple

log = logging.getLogger("dsrl")

_EXCERPT = 200  # characters of the completion shown in the log line


class RewardGuard:
    """Wraps `fn(completion_text, prompt) -> float`; callable like it."""

    def __init__(self, fn: Callable, timeout_s: float, concurrency: int = 1):
        if not timeout_s > 0 or concurrency < 1:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0 and reward.concurrency={concurrency} >= 1")
        self.fn, self.timeout_s, self.concurrency = fn, float(timeout_s), int(concurrency)
        self.errors = 0  # since the last pop_metrics()
        self.timeouts = 0

    @classmethod
    def wrap(cls, fn: Callable, timeout_s: float, concurrency: int = 1) -> "RewardGuard":
        """`fn` guarded (a guard is returned as it is)."""
        return fn if isinstance(fn, cls) else cls(fn, timeout_s, concurrency)

    def __call__(self, text: str, prompt) -> float:
        return self.score(text, prompt)

    def score(self, text: str, prompt, *, where: str = "") -> float:
        """The verifier's reward, or 0.0 when it fails; `where` names the sample in the log."""
        return self.score_many([(text, prompt, where)])[0]

    def score_many(self, items: Sequence[Tuple[str, object, str]]) -> List[float]:
        """Rewards of (completion_text, prompt, where) items, in order, with at most
        `concurrency` calls in flight (a reward server is called concurrently); each call gets
        its own `timeout_s` from the moment it starts."""
        results = [0.0] * len(items)
        finished: "queue.Queue[int]" = queue.Queue()
        inflight: dict = {}  # item index -> (deadline, result box)
        nxt = 0
        while nxt < len(items) or inflight:
            while nxt < len(items) and len(inflight) < self.concurrency:
                inflight[nxt] = (time.monotonic() + self.timeout_s, self._start(nxt, items[nxt], finished))
                nxt += 1
            wait = max(min(d for d, _ in inflight.values()) - time.monotonic(), 0.0)
            try:
                done = [finished.get(timeout=wait)]
            except queue.Empty:
                done = []
            now = time.monotonic()
            for i in done:
                if i in inflight:  # a call that outlived its deadline was already counted
                    results[i] = self._result(inflight.pop(i)[1], items[i])
            for i in [i for i, (d, _) in inflight.items() if d <= now]:
                del inflight[i]
                self.timeouts += 1
                self._report(items[i][2], items[i][0], f"no result within reward.timeout_s={self.timeout_s:g} s",
                             "reward/timeouts")
        return results

    def _start(self, i: int, item, finished: "queue.Queue[int]") -> dict:
        """Run the verifier on `item` in a daemon thread; its result lands in the returned box."""
        box: dict = {}
        text, prompt, _ = item

        def target():
            try:
                box["value"] = self.fn(text, prompt)
            except BaseException as e:  # reported by _result
                box["error"] = e
            finally:
                finished.put(i)

        threading.Thread(target=target, name="dsrl-reward", daemon=True).start()
        return box

    def _result(self, box: dict, item) -> float:
        """A finished call's reward, or 0.0 (counted, reported) when it failed."""
        error = box.get("error")
        if error is None:
            try:
                value = float(box["value"])
            except (TypeError, ValueError) as e:
                error = e
            else:
                if math.isfinite(value):
                    return value
                error = ValueError(f"non-finite reward {value}")
        self.errors += 1
        self._report(item[2], item[0], f"{type(error).__name__}: {error}", "reward/errors")
        return 0.0

    def pop_metrics(self) -> dict:
        """Failed samples since the last call (this rank); the trainer sums them over ranks."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        self.errors = self.timeouts = 0
        return out

    def _report(self, where: str, text: str, cause: str, counter: str) -> None:
        """Log the first failure since the last pop_metrics(); count the rest silently."""
        if self.errors + self.timeouts > 1:
            return
        excerpt = text if len(text) <= _EXCERPT else text[:_EXCERPT] + "..."
        log.warning("reward: the verifier failed on %s (completion %r): %s; the sample scores 0 "
                    "(counted in %s; later failures of this step are only counted)",
                    where or "a sample", excerpt, cause, counter)
