"""Reward calls that cannot stop a run: a verifier that raises, returns something that is not a
finite number, or takes longer than `reward.timeout_s` gives that sample reward 0; the sample is
counted (`reward/errors`, `reward/timeouts`) and the first such sample of each step is logged
(prompt index, completion excerpt, cause). Training goes on.

Each call runs in its own daemon thread and is waited for at most `timeout_s`. Python cannot
kill a thread: a verifier that never returns keeps running in the background (using the GIL
while it computes), but nothing waits for it -- not the loop, not process exit (daemon thread,
never joined). A verifier that needs the main thread (signal.alarm-based timeouts, say) fails
here; each failure is then counted and logged like any other error."""
from __future__ import annotations

import logging
import math
import threading
from typing import Callable

log = logging.getLogger("dsrl")

_EXCERPT = 200  # characters of the completion shown in the log line


class RewardGuard:
    """Wraps `fn(completion_text, prompt) -> float`; callable like it."""

    def __init__(self, fn: Callable, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        self.fn, self.timeout_s = fn, float(timeout_s)
        self.errors = 0  # since the last pop_metrics()
        self.timeouts = 0

    @classmethod
    def wrap(cls, fn: Callable, timeout_s: float) -> "RewardGuard":
        """`fn` guarded (a guard is returned as it is)."""
        return fn if isinstance(fn, cls) else cls(fn, timeout_s)

    def __call__(self, text: str, prompt) -> float:
        return self.score(text, prompt)

    def score(self, text: str, prompt, *, where: str = "") -> float:
        """The verifier's reward, or 0.0 when it fails; `where` names the sample in the log."""
        box: dict = {}
        done = threading.Event()

        def target():
            try:
                box["value"] = self.fn(text, prompt)
            except BaseException as e:  # reported below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=target, name="dsrl-reward", daemon=True).start()
        if not done.wait(self.timeout_s):
            self.timeouts += 1
            self._report(where, text, f"no result within reward.timeout_s={self.timeout_s:g} s", "reward/timeouts")
            return 0.0
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
        self._report(where, text, f"{type(error).__name__}: {error}", "reward/errors")
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
