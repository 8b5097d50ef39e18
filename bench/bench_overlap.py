"""One-step-off-policy overlap, measured side by side: one set of engines runs the default job
(SmolLM2, 8 prompts x 8 samples, 16 tokens) in alternating blocks of synchronous steps and of
overlapped steps (algo.off_policy_steps=1: step k+1 generates while step k trains) and prints the
ratio of median step times. The first step of each block is a transition (it inherits or
starts a background rollout) and is not counted. Both modes use the rollout log-probs as the old
policy, so they do the same work per step.

On a CPU the overlapped generation competes with training for the same cores: the ratio is what
this machine gives, not what a GPU with separate engines would.

    make bench-overlap                                  # default job, 4 blocks of 3 steps
    python bench/bench_overlap.py model.path=tiny bench.block=2 bench.blocks=2      # quick
    python bench/bench_overlap.py bench.overlap_threads=1   # trainer threads while overlapping
    make bench-overlap-learn        # the full 30-step default job with overlap: learns? (last5 - first5 >= 0.4)
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OVERLAP = ["algo.off_policy_steps=1", "algo.use_rollout_logprobs=true"]
DEFAULTS = ["+exp=grpo_reuse", *OVERLAP, "trainer.eval_before=false", "trainer.eval_after=false",
            "trainer.save_final=false", "logger.progress=false", "logger.plot=false", "logger.tensorboard=false"]
LEARN_MARGIN = 0.4  # last-5 mean reward at least this much above the first 5


def ratio_run(block: int, blocks: int, overlap_threads: int, overrides: list) -> int:
    import torch
    from hydra import compose, initialize_config_dir

    from dsrl.main import build

    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(ROOT, "conf")), version_base=None):
        node = compose(config_name="config", overrides=DEFAULTS + overrides)
    trainer = build(node, tempfile.mkdtemp(prefix="bench_overlap_"))
    modes = {off: dataclasses.replace(trainer.cfg, algo=dataclasses.replace(trainer.cfg.algo, off_policy_steps=off),
                                      trainer=dataclasses.replace(trainer.cfg.trainer, total_steps=10 ** 6))
             for off in (0, 1)}
    threads = {0: torch.get_num_threads(), 1: overlap_threads or torch.get_num_threads()}
    rows = {0: [], 1: []}
    step = 0
    try:
        trainer.cfg = modes[0]
        step += 1
        trainer.step(step)  # warm-up (allocator, kernels, engine caches); not counted
        for b in range(blocks):
            off = (0, 1)[b % 2] if (b // 2) % 2 == 0 else (1, 0)[b % 2]  # ABBA order of blocks
            trainer.cfg = modes[off]
            torch.set_num_threads(threads[off])
            for i in range(block):
                step += 1
                m = trainer.step(step)
                counted = i > 0
                if counted:
                    rows[off].append((m["timing/step"], m["timing/rollout"], m["timing/train"],
                                      m["timing/generation"], m["reward/mean"], m["timing/weight_sync"]))
                print(f"step {step:2d} off_policy_steps={off} {'' if counted else '(transition) '}"
                      f"step={m['timing/step']:.2f}s blocked-on-rollout={m['timing/rollout']:.2f}s "
                      f"train={m['timing/train']:.2f}s generation={m['timing/generation']:.2f}s "
                      f"staleness={m['rollout/staleness']:.0f} reward={m['reward/mean']:.3f}", flush=True)
        trainer.state.next_rollout.wait()
    finally:
        trainer.worker.close()

    def med(off, i):
        return statistics.median(r[i] for r in rows[off])

    n = len(rows[0])
    print(f"\n== one-step-off-policy overlap (medians over {n} steps per mode; torch threads "
          f"sync={threads[0]}, overlap={threads[1]}) ==")
    for off, name in ((0, "synchronous   "), (1, "overlap (1 off)")):
        print(f"{name}: step {med(off, 0):.2f}s (blocked on rollout {med(off, 1):.2f}s, train {med(off, 2):.2f}s, "
              f"generation {med(off, 3):.2f}s)")
    measured = med(1, 0) / med(0, 0)
    print(f"ratio step time, overlap/synchronous: {measured:.3f}")
    # The timeline simulator's one-step model (bench/async_timeline.py) fed with the synchronous
    # steps' measured phases: what it predicts on separate devices (contention 1) and on shared cores
    # with both sides compute-bound (contention 2), beside the measured ratio.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from async_timeline import _overlapped

    gen, train, push = med(0, 3), med(0, 2), med(0, 5)
    rest = max(med(0, 0) - gen - train - push, 0.0)  # scoring, rewards, metrics: serial in both modes
    for c in (1.0, 2.0):
        predicted = (_overlapped(gen, train, c) + push + rest) / (gen + train + push + rest)
        print(f"async_timeline one_step, contention {c:g}: predicted ratio {predicted:.3f} (measured {measured:.3f}; "
              f"generation {gen:.2f}s, train {train:.2f}s, push {push:.2f}s, other {rest:.2f}s)")
    return 0


def learn_run(overrides: list) -> int:
    """The default job with overlap, start to end, through the entry point."""
    run_dir = os.path.join(ROOT, "outputs", "bench-overlap-learn-" + time.strftime("%Y%m%d-%H%M%S"))
    cmd = [sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", *OVERLAP, f"hydra.run.dir={run_dir}", *overrides]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    first, last = summary["reward/first5"], summary["reward/last5"]
    ok = last - first >= LEARN_MARGIN
    print(f"\n== overlap learns the default job: reward first5 {first:.3f} -> last5 {last:.3f} "
          f"(+{last - first:.3f}; needs +{LEARN_MARGIN}): {'PASS' if ok else 'FAIL'} "
          f"({(time.perf_counter() - t0) / 60:.1f} min; {run_dir})")
    return 0 if ok else 1


def main(argv) -> int:
    opts = {"block": 3, "blocks": 4, "overlap_threads": 0, "learn": 0}
    overrides = []
    for a in argv:
        key, _, value = a.partition("=")
        if key.startswith("bench."):
            if key[6:] not in opts:
                raise SystemExit(f"unknown option {key} (known: {', '.join('bench.' + k for k in opts)})")
            opts[key[6:]] = int(value)
        else:
            overrides.append(a)
    if opts["learn"]:
        return learn_run(overrides)
    if opts["block"] < 2 or opts["blocks"] < 2:
        raise SystemExit("bench.block and bench.blocks must be >= 2 (the first step of a block is not counted)")
    return ratio_run(opts["block"], opts["blocks"], opts["overlap_threads"], overrides)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
