"""A colocated CUDA engine gives its GPU memory to the trainer during the train phase.

One step's order (vLLM sleep mode; docs/guides/gpu.md):
  rollout       engine fully awake (weights + KV cache), generating
  train         engine asleep: its weights (level 1: offloaded to host; level 2: dropped) and
                KV cache are off the GPU, so the DeepSpeed engine has the memory
  weight sync   weights awake, KV cache still asleep: the new weights are written into resident
                memory (never into a sleeping engine, P1) without the KV cache also allocated (P3)
  next rollout  KV cache awake; the engine schedules again

`EngineMemory(worker, enabled)` keeps that order in one place: `with memory.for_training():`
around the train phase (sleeps on entry, wakes the weights on exit, ready for the push) and
`with memory.for_rollout():` around generation (wakes whatever still sleeps). Disabled (CPU,
engines on GPUs of their own, the hf backend, generation overlapping training) it does nothing."""
from __future__ import annotations

import contextlib

AWAKE, ASLEEP, WEIGHTS_ONLY = "awake", "asleep", "weights"


class EngineMemory:
    """Sleep/wake bookkeeping of one rollout worker (anything with sleep(level) / wake_up(tags))."""

    def __init__(self, worker, enabled: bool, level: int = 1):
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: 1 (weights offloaded to host) or 2 (weights dropped; "
                             f"only when every push rewrites all weights)")
        self.worker, self.enabled, self.level = worker, bool(enabled), int(level)
        self.state = AWAKE

    @contextlib.contextmanager
    def for_training(self):
        """The train phase: the engine sleeps inside; on exit its weights are resident again
        (the push that follows writes into them), its KV cache still asleep."""
        if self.enabled and self.state == AWAKE:
            self.worker.sleep(self.level)
            self.state = ASLEEP
        try:
            yield self
        finally:
            self.wake_weights()

    def wake_weights(self) -> None:
        """Weights resident (before any weight load)."""
        if self.enabled and self.state == ASLEEP:
            self.worker.wake_up(["weights"])
            self.state = WEIGHTS_ONLY

    @contextlib.contextmanager
    def for_rollout(self):
        """Generation (or an engine-side probe): everything awake, weights first."""
        self.wake_weights()
        if self.enabled and self.state == WEIGHTS_ONLY:
            self.worker.wake_up(["kv_cache"])
            self.state = AWAKE
        yield self


def sleep_mode_wanted(cfg) -> bool:
    """Whether the run's rollout engine should sleep during training: a vLLM engine colocated
    on this rank's GPU, with generation never overlapping training."""
    import torch

    r = cfg.rollout
    overlap = int(getattr(cfg.algo, "off_policy_steps", 0) or 0) > 0
    return (torch.cuda.is_available() and r.backend == "vllm" and getattr(r, "placement", "colocated") == "colocated"
            and not overlap)
