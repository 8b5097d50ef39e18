"""A rollout worker that survives its engine: the one place where engine deaths, hangs and
restarts are handled, so the trainer never sees them.

`ResilientWorker` has the rollout worker's interface (generate, push_weights, close). Each call
runs in a daemon thread and the caller waits with a deadline (`rollout.timeout_s`), checking the
engine's processes every `poll_s`: a dead engine is noticed within a poll, a hung one at the
deadline (vLLM's synchronous client itself would wait forever). Then the engine's processes are
killed, the worker is rebuilt with the same arguments, the last pushed weights are loaded back
(the trainer's current weights: the shared-memory segments this wrapper staged them in,
dsrl.rollout.shm_transport) and the call is
retried; after `max_restarts` failed attempts of one call, a `RolloutEngineError` names the
engine and the cause. Any other error of the call (a bad request, say) is raised unchanged.
Restarts are counted for the step metrics (`rollout/restarts`, see `pop_metrics`)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Optional

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
        self._staging = None  # shared-memory segments of the last push (dsrl.rollout.shm_transport)
        self._adapter = None  # actor.lora: (folder, id) of the last adapter loaded (dsrl.rollout.lora_sync)

    # ------------------------------------------------------------------ the worker's interface
    def generate(self, *args, **kwargs):
        return self._call("generate", *args, **kwargs)

    def push_weights(self, weights, step: int) -> float:
        """Weights (a state dict or Buckets, dsrl.rollout.buckets) into the engine. A worker that
        loads from shared memory (`shared_memory_sync`) gets them staged here, in segments this
        wrapper owns, then loaded (`_push_shared`): they outlive a rebuilt engine, which loads
        them back (no disk write), and a retried load reads the same bytes. Other workers get the
        call as is."""
        if self._shm_worker():
            seconds = self._push_shared(weights)
        else:
            # A streamed push (CUDA IPC: a one-pass iterator of GPU buckets) cannot be replayed
            # into a rebuilt engine: a failure there stops the run instead of retrying with a
            # half-consumed stream.
            replayable = isinstance(weights, (Mapping, list, tuple))
            seconds = self._call("push_weights", weights, step, _replayable=replayable)
        self._pushed = True
        return seconds

    def _push_shared(self, weights) -> float:
        """The shared-memory push (dsrl.rollout.shm_transport.stage_then_load: staged to the end,
        then loaded), each engine call under this wrapper's deadline and liveness checks. An
        engine that dies or hangs mid-load is rebuilt and loads the whole staged sync. Any error
        that leaves this call (another error of a load, restarts exhausted, the export's own)
        removes the staged files: the run stops on it, and no later rebuild may load a sync that
        never reached the engine whole."""
        from dsrl.rollout.buckets import pack_buckets
        from dsrl.rollout.shm_transport import BucketLoadError, stage_then_load
        from dsrl.rollout.vllm_engine import DEFAULT_BUCKET_BYTES

        t0 = time.perf_counter()
        staging = self._shm_staging()
        if isinstance(weights, Mapping):
            weights = pack_buckets(weights.items(), DEFAULT_BUCKET_BYTES, alloc=staging.alloc)
        try:
            try:
                stage_then_load(staging, weights, lambda ref, first: self._attempt(self.worker.load_shared_bucket,
                                                                                   ref, first),
                                lambda: self._attempt(self.worker.finish_shared_load), name=self.name)
            except BucketLoadError as e:
                if not isinstance(e.__cause__, _EngineFailed):
                    raise
                self._failed("load_shared_bucket", e.__cause__, 1, True)
                self._call("load_shared_weights", staging.refs, _failures=1)
        except BaseException:
            staging.discard()
            raise
        return time.perf_counter() - t0

    def bucket_allocator(self):
        """Where the weight sync packs buckets: this wrapper's shared-memory segments (no copy
        when staging), or None when the engine does not load from shared memory."""
        return self._shm_staging().alloc if self._shm_worker() else None

    def probe_logprobs(self, token_id_lists):
        return self._call("probe_logprobs", token_id_lists)

    @property
    def lora_enabled(self) -> bool:
        """The engine serves LoRA adapters (actor.lora; dsrl.rollout.lora_sync syncs the adapter only)."""
        return bool(getattr(self.worker, "lora_enabled", False))

    def load_adapter(self, path: str, adapter_id: int) -> float:
        """The trainer's adapter folder into the engine; a rebuilt engine gets it back."""
        seconds = self._call("load_adapter", path, adapter_id)
        self._adapter = (path, adapter_id)
        return seconds

    def probe_sampled(self, prompt_ids, **kwargs):
        return self._call("probe_sampled", prompt_ids, **kwargs)

    def sleep(self, level: int = 1) -> None:
        """The engine frees its memory for the train phase (dsrl.rollout.memory)."""
        self._call("sleep", level)

    def wake_up(self, tags=None) -> None:
        self._call("wake_up", tags)

    def close(self) -> None:
        worker, self.worker = self.worker, None
        staging, self._staging = self._staging, None
        try:
            if worker is not None:
                worker.close()
        finally:
            if staging is not None:
                staging.close()

    def _shm_worker(self) -> bool:
        return bool(getattr(self.worker, "shared_memory_sync", False))

    def _shm_staging(self):
        if self._staging is None:
            from dsrl.rollout.shm_transport import ShmStaging

            self._staging = ShmStaging()
        return self._staging

    def pop_metrics(self) -> dict:
        """Restarts since the last call (this rank); the trainer sums them over ranks."""
        out = {"rollout/restarts": float(self.restarts)}
        self.restarts = 0
        return out

    # ------------------------------------------------------------------ retry and restart
    def _call(self, method: str, *args, _replayable: bool = True, _failures: int = 0, **kwargs):
        """`method` of the worker, retried on a rebuilt engine; `_failures`: attempts that already
        failed (the first try then rebuilds the engine)."""
        if self.worker is None:
            raise RuntimeError(f"{self.name}: used after close()")
        failures = int(_failures)
        while True:
            try:
                if failures:
                    self._restart()
                return self._attempt(getattr(self.worker, method), *args, **kwargs)
            except _EngineFailed as e:
                failures += 1
                self._failed(method, e, failures, _replayable)

    def _failed(self, method: str, e: _EngineFailed, failures: int, replayable: bool) -> None:
        """Attempt number `failures` of `method` failed: the engine is killed; raises
        RolloutEngineError when no restart is left (or the call cannot be replayed)."""
        if self.worker is not None:
            self.worker.kill()
        if failures > self.max_restarts or not replayable:
            self.worker = None
            why = ("" if replayable else " (a streamed weight push cannot be replayed into a rebuilt engine; "
                   "resume from the last checkpoint)")
            raise RolloutEngineError(
                f"{self.name}: {method} failed {failures} time(s) (rollout.max_restarts={self.max_restarts}); "
                f"last cause: {e}{why}") from e.__cause__
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
        if self._pushed and self._staging is not None and self._staging.refs:
            self._attempt(self.worker.load_shared_weights, self._staging.refs)
        elif self._pushed and not self._attempt(self.worker.reload_pushed_weights):
            # The pushed weights did not survive the old engine (a CUDA IPC push lives in the dead
            # engine's memory): the new one would serve the initial weights, and its samples would
            # be trained on as on-policy. Stop, naming the engine, instead.
            self.worker.kill()
            self.worker = None
            raise RolloutEngineError(
                f"{self.name}: the engine was rebuilt but cannot load the trainer's last pushed weights "
                "again (pushed through CUDA IPC, which a new engine cannot re-read); stopping rather than "
                "sampling from its initial weights. Resume from the last checkpoint.")
        if self._adapter is not None:
            self._attempt(self.worker.load_adapter, *self._adapter)
        log.warning("%s: restarted in %.1f s", self.name, time.perf_counter() - t0)

    def _attempt(self, fn, *args, **kwargs):
        """Run fn in a daemon thread; return its result or raise its error, or raise
        _EngineFailed when the engine dies or the call outlives rollout.timeout_s."""
        import torch

        box: dict = {}
        done = threading.Event()
        # The CUDA device is per thread: the call (a streamed push packs GPU buckets, ZeRO-3 gathers
        # included) must run on the caller's, not on cuda:0.
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def target():
            try:
                if device is not None:
                    torch.cuda.set_device(device)
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
