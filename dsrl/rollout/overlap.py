"""One-step-off-policy overlap: the next step's rollout runs in a background thread while the
current step trains (`algo.off_policy_steps=1`).

The trainer keeps at most one rollout in flight and follows three rules, which this class
enforces or makes easy:
- the thread only touches the rollout worker, the verifier and the prompt stream; the main
  thread does not touch those while a rollout is in flight (it draws no prompts, pushes no
  weights, runs no eval), so the prompt stream is drawn in the same order as the synchronous
  loop's and a run is reproducible;
- nothing collective happens in the thread (the trainer reduces the rollout's counts in the main
  thread), so it can never interleave with the training step's collectives;
- an error in the thread is raised in the main thread, at the next `wait` or `take`.
The thread is a daemon: a run that fails while a rollout is in flight does not wait for it
(closing the engine ends it)."""
from __future__ import annotations

import threading
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class BackgroundRollout(Generic[T]):
    """Holds the rollout of one future step: running in a thread, or finished (or preloaded
    from a checkpoint) and waiting to be taken."""

    def __init__(self) -> None:
        self.step: Optional[int] = None  # the step the held rollout is for
        self._thread: Optional[threading.Thread] = None
        self._box: dict = {}

    # ------------------------------------------------------------------ starting and holding
    def start(self, step: int, fn: Callable[[], T]) -> None:
        """Run `fn()` (the rollout of `step`) in a daemon thread."""
        if self.step is not None:
            raise RuntimeError(f"a rollout (of step {self.step}) is already held; take it before starting "
                               f"the rollout of step {step}")
        box: dict = {}

        def target():
            try:
                box["value"] = fn()
            except BaseException as e:  # raised in the main thread by wait()/take()
                box["error"] = e

        self.step, self._box = step, box
        self._thread = threading.Thread(target=target, name=f"dsrl-rollout-step-{step}", daemon=True)
        self._thread.start()

    def preload(self, step: int, value: T) -> None:
        """Hold an already finished rollout (restored from a checkpoint)."""
        if self.step is not None:
            raise RuntimeError(f"a rollout (of step {self.step}) is already held")
        self.step, self._thread, self._box = step, None, {"value": value}

    def holds(self, step: int) -> bool:
        return self.step == step

    @property
    def running(self) -> bool:
        """A rollout thread has not finished yet."""
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ joining
    def wait(self) -> None:
        """Block until the held rollout (if any) has finished; raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error = self._box.get("error")
        if error is not None:
            step = self.step
            self.step, self._box = None, {}
            error.add_note(f"(raised in the background rollout of step {step}, algo.off_policy_steps=1)")
            raise error

    def take(self, step: int) -> T:
        """The finished rollout of `step` (waits for it); the holder is empty afterwards."""
        if self.step != step:
            raise RuntimeError(f"the held rollout is for step {self.step}, not step {step}")
        self.wait()
        value = self._box["value"]
        self.step, self._box = None, {}
        return value

    def finished_value(self) -> Optional[T]:
        """The held rollout if it finished without error (waits for a running one), else None;
        it stays held (a failed one raises at the next wait/take). For checkpoints."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._box.get("value")
