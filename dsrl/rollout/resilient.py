"""A rollout worker that survives its engine: the one place where engine deaths, hangs and
restarts are handled, so the trainer never sees them.

`ResilientWorker` has the rollout worker's interface (generate, push_weights, close). Each call
runs in a daemon thread and the caller waits with a deadline (`rollout.timeout_s`), checking the
engine's processes every `poll_s`: a dead engine is noticed within a poll, a hung one at the
deadline (vLLM's synchronous client itself would wait forever). Then the engine's processes are
killed, the worker is rebuilt with the same arguments, the last pushed weights are loaded back
(the trainer's current weights: the push file of dsrl.rollout.vllm_worker) and the call is
retried; after `max_restarts` failed attempts of one call, a `RolloutEngineError` names the
engine and the cause. Any other error of the call (a bad request, say) is raised unchanged.
Restarts are counted for the step metrics (`rollout/restarts`, see `pop_metrics`)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("dsrl")

_WAKE_S = 5.0  # after a kill: how long to wait for the abandoned call's thread to return


class RolloutEngineError(RuntimeError):
    """A rollout engine kept failing: restarts exhausted."""


class _EngineFailed(Exception):
    """One failed attempt: the engine died or hung (internal)."""


def _is_engine_death(exc: BaseException) -> bool:
    """vLLM's EngineDeadError (matched by name: its module moved between vLLM versions)."""
    return any(c.__name__ == "EngineDeadError" for c in type(exc).__mro__)


class ResilientWorker:
    """`make_worker()` builds the real worker (called again for each restart); `name` says which
    engine it is in errors and logs (e.g. "vLLM engine of rank 0 (/models/x)")."""

    def __init__(self, make_worker: Callable[[], object], *, name: str, max_restarts: int, timeout_s: float,
                 poll_s: float = 0.5):
        if max_restarts < 0 or timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"max_restarts={max_restarts} must be >= 0 and timeout_s={timeout_s}, "
                             f"poll_s={poll_s} > 0")
        self.make_worker, self.name = make_worker, name
        self.max_restarts, self.timeout_s, self.poll_s = int(max_restarts), float(timeout_s), float(poll_s)
        self.worker = make_worker()
        self.restarts = 0  # since the last pop_metrics()
        self.total_restarts = 0
        self._pushed = False  # a push happened: a rebuilt engine must get the pushed weights back

    # ------------------------------------------------------------------ the worker's interface
    def generate(self, *args, **kwargs):
        return self._call("generate", *args, **kwargs)

    def push_weights(self, state: dict, step: int) -> float:
        seconds = self._call("push_weights", state, step)
        self._pushed = True
        return seconds

    def close(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()

    def pop_metrics(self) -> dict:
        """Restarts since the last call (this rank); the trainer sums them over ranks."""
        out = {"rollout/restarts": float(self.restarts)}
        self.restarts = 0
        return out

    # ------------------------------------------------------------------ retry and restart
    def _call(self, method: str, *args, **kwargs):
        if self.worker is None:
            raise RuntimeError(f"{self.name}: used after close()")
        failures = 0
        while True:
            try:
                if failures:
                    self._restart()
                return self._attempt(getattr(self.worker, method), *args, **kwargs)
            except _EngineFailed as e:
                failures += 1
                if self.worker is not None:
                    self.worker.kill()
                if failures > self.max_restarts:
                    self.worker = None
                    raise RolloutEngineError(
                        f"{self.name}: {method} failed {failures} time(s) (rollout.max_restarts={self.max_restarts}); "
                        f"last cause: {e}") from e.__cause__
                log.warning("%s: %s failed (%s); restarting the engine (restart %d of at most %d)", self.name,
                            method, e, failures, self.max_restarts)

    def _restart(self) -> None:
        """A fresh engine with the same arguments and the trainer's current weights; a failure
        to start counts as a failed attempt."""
        t0 = time.perf_counter()
        self.worker = None
        try:
            self.worker = self.make_worker()
        except Exception as e:
            raise _EngineFailed(f"restart failed: {type(e).__name__}: {e}") from e
        self.restarts += 1
        self.total_restarts += 1
        if self._pushed:
            self._attempt(self.worker.reload_pushed_weights)
        log.warning("%s: restarted in %.1f s", self.name, time.perf_counter() - t0)

    def _attempt(self, fn, *args, **kwargs):
        """Run fn in a daemon thread; return its result or raise its error, or raise
        _EngineFailed when the engine dies or the call outlives rollout.timeout_s."""
        box: dict = {}
        done = threading.Event()

        def target():
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller below
                box["error"] = e
            finally:
                done.set()

        thread = threading.Thread(target=target, name=f"dsrl-rollout-{fn.__name__}", daemon=True)
        deadline = time.monotonic() + self.timeout_s
        thread.start()
        while not done.wait(self.poll_s):
            if not self.worker.engine_alive():
                self._abandon(thread, done)
                raise _EngineFailed("the engine's processes exited")
            if time.monotonic() > deadline:
                self._abandon(thread, done)
                raise _EngineFailed(f"no answer within rollout.timeout_s={self.timeout_s:g} s")
        error: Optional[BaseException] = box.get("error")
        if error is None:
            return box["value"]
        if _is_engine_death(error) or not self.worker.engine_alive():
            raise _EngineFailed(f"{type(error).__name__}: {error}") from error
        raise error

    def _abandon(self, thread: threading.Thread, done: threading.Event) -> None:
        """Kill the engine so the call's thread can return; a thread that still does not is
        left behind (daemon: it cannot keep the process alive) and said so."""
        self.worker.kill()
        if not done.wait(_WAKE_S):
            log.warning("%s: a call thread (%s) did not return after the engine was killed; left behind",
                        self.name, thread.name)
