"""The engine's idle time per step spent snapshotting the asynchronous buffer, before and after it
was taken only where a checkpoint needs it (dsrl/rollout/async_buffer.py).

Before: at every push, a deep copy of the whole buffer (closed batches, finished and in-flight
groups) under the engine lock, whatever trainer.save_every was. After: `deterministic` snapshots at
every push, copying only the groups in flight (none at a push: a batch just closed) and sharing the
finished ones; `clock` snapshots only when a checkpoint is written. The buffer is filled as the
schedule leaves it at a push (k closed batches waiting for the trainer, a batch's worth of groups in
flight half-way; k = 2) for the default job's shape and two longer ones; no model is loaded (the
copy does not depend on it).

    python bench/bench_async_snapshot.py
    python bench/bench_async_snapshot.py --shape 64x8x1024 --save-every 10
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

from dsrl.rollout.async_buffer import AsyncBuffer

SHAPES = ("8x8x16", "32x8x256", "64x8x1024")  # prompts x samples x tokens per response


def filled(groups: int, n: int, tokens: int, k: int, in_flight: bool) -> AsyncBuffer:
    rng = random.Random(0)
    buf = AsyncBuffer(groups_per_batch=groups, n=n, k=k, total_batches=1000)

    def group(length):
        g = buf.admit(None, [rng.randrange(1000) for _ in range(64)])
        for t in g.trajectories:
            ids = [rng.randrange(1000) for _ in range(length)]
            buf.extend(t, ids, [-rng.random() for _ in ids], "length" if length < tokens else "stop", tokens)
        return g
    for _ in range(k):  # closed batches waiting for the trainer
        for _ in range(groups):
            g = group(tokens)
            g.rewards, g.texts = [1.0] * n, [""] * n
            buf.complete(g)
    if in_flight:  # clock: a batch's worth half-way
        for _ in range(groups):
            group(tokens // 2)
    return buf


def before(buf: AsyncBuffer) -> None:
    """The former snapshot: everything deep-copied."""
    buf.saved = copy.deepcopy({name: getattr(buf, name) for name in buf._STATE})


def seconds(fn, buf, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", help="prompts x samples x tokens, e.g. 8x8x16 (repeatable)")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=10, help="trainer.save_every (the default job's: 10)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"engine held per step by the buffer snapshot (median of {args.repeats}; k={args.k}, "
          f"trainer.save_every={args.save_every})")
    print(f"{'shape':>12} {'schedule':>14} {'before ms':>10} {'after ms':>10}")
    for shape in args.shape or SHAPES:
        groups, n, tokens = (int(x) for x in shape.split("x"))
        # deterministic: at a push nothing is in flight; before and after both copy at every push
        det = filled(groups, n, tokens, args.k, in_flight=False)
        b = seconds(before, det, args.repeats)
        a = seconds(lambda buf: buf.snapshot(None), det, args.repeats)
        print(f"{shape:>12} {'deterministic':>14} {b * 1e3:>10.3f} {a * 1e3:>10.3f}")
        # clock: before at every push; after once per checkpoint (per step: / save_every)
        clk = filled(groups, n, tokens, args.k, in_flight=True)
        b = seconds(before, clk, args.repeats)
        a = seconds(lambda buf: buf.snapshot(None), clk, args.repeats) / max(args.save_every, 1)
        print(f"{shape:>12} {'clock':>14} {b * 1e3:>10.3f} {a * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
