"""Asynchronous rollouts side by side: the default job (SmolLM2, 8 prompts x 8
samples, 16 tokens) as one CLI job per mode, the trainer pinned to one set of cores and the engine
to another (`rollout.engine_cores`, `actor.num_threads`), and the median step time of each mode over
its counted steps, printed as ratios to the synchronous loop. Every mode uses the rollout log-probs
as the old policy (`algo.use_rollout_logprobs=true`, reuse on: no old-policy pass), so each does the
same work per step and only the schedule differs.

    python bench/bench_async.py                          # k = 0, 1 (overlap), 1 (clock), 2 (clock), 2 (deterministic)
    python bench/bench_async.py --steps 6 --rounds 2     # ABC.. then ..CBA, medians over both
    python bench/bench_async.py --learn                  # the 30-step default job under k = 2 (clock): learns?
    python bench/bench_async.py --learn --modes "sync (k=0),clock k=1"   # learning curves of other schedules
    python bench/bench_async.py --trainer-cores 0 --engine-cores 1 -- model.path=tiny   # extra overrides

A learning run passes when last-5 minus first-5 mean reward is at least 0.4."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COMMON = ["+exp=grpo_reuse", "algo.use_rollout_logprobs=true", "trainer.eval_before=false",
          "trainer.eval_after=false", "trainer.save_final=false", "trainer.save_every=0", "logger.progress=false",
          "logger.plot=false", "logger.tensorboard=false"]
MODES = {
    "sync (k=0)": ["algo.off_policy_steps=0"],
    "overlap (k=1)": ["algo.off_policy_steps=1", "algo.async_schedule=overlap"],
    "clock k=1": ["algo.off_policy_steps=1", "algo.async_schedule=clock"],
    "clock k=2": ["algo.off_policy_steps=2", "algo.async_schedule=clock"],
    "deterministic k=2": ["algo.off_policy_steps=2", "algo.async_schedule=deterministic"],
}
LEARN_MARGIN = 0.4


def run_job(overrides: list, trainer_cores: str, engine_cores: str) -> list:
    """One CLI job, the trainer's process pinned to `trainer_cores` (its engine binds to
    `engine_cores`); returns its metrics rows."""
    run_dir = tempfile.mkdtemp(prefix="bench_async_")
    cores = {int(c) for part in trainer_cores.split(",") for c in
             (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
    cmd = [sys.executable, "-m", "dsrl.main", *COMMON, f"rollout.engine_cores={engine_cores}",
           f"actor.num_threads={len(cores)}", *overrides, f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", DS_ACCELERATOR="cpu")
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                       preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if r.returncode != 0:
        sys.exit(f"job failed ({' '.join(overrides)}):\n{r.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    print(f"  {' '.join(overrides)}: {len(rows)} steps in {time.time() - t0:.0f} s ({run_dir})", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="steps per job (the first 2 are not counted)")
    p.add_argument("--rounds", type=int, default=1, help="jobs per mode; round 2 runs the modes in reverse order")
    p.add_argument("--trainer-cores", default="0")
    p.add_argument("--engine-cores", default="1")
    p.add_argument("--modes", default=None, help="comma list of: " + ", ".join(MODES) + " (default: all; "
                   "--learn: clock k=2)")
    p.add_argument("--learn", action="store_true", help="the 30-step default job under each mode: learns?")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores; trainer on cores {args.trainer_cores}, engine on {args.engine_cores}")
    modes = [m.strip() for m in (args.modes or ("clock k=2" if args.learn else ",".join(MODES))).split(",")]
    if args.learn:
        for mode in modes:
            rows = run_job([*MODES[mode], *args.overrides], args.trainer_cores, args.engine_cores)
            rewards = [r["reward/mean"] for r in rows]
            first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
            steps = statistics.median(r["timing/step"] for r in rows[2:])
            stale = statistics.mean(r.get("async/staleness_mean", r["rollout/staleness"]) for r in rows)
            print(f"{mode}, {len(rows)} steps: reward first5 {first:.3f} -> last5 {last:.3f} (+{last - first:.3f}; "
                  f"goal >= {LEARN_MARGIN}: {'PASS' if last - first >= LEARN_MARGIN else 'FAIL'}); median step "
                  f"{steps:.2f} s; mean staleness {stale:.2f}; dropped groups "
                  f"{sum(r.get('async/dropped_groups', 0.0) for r in rows):.0f}; rewards "
                  f"{' '.join(f'{x:.2f}' for x in rewards)}", flush=True)
        return
    times = {m: [] for m in modes}
    extra = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            rows = run_job([*MODES[mode], f"trainer.total_steps={args.steps}", *args.overrides],
                           args.trainer_cores, args.engine_cores)
            counted = rows[2:]
            times[mode] += [r["timing/step"] for r in counted]
            extra[mode] += counted
    base = statistics.median(times[modes[0]])
    print(f"\n== step time by schedule (median over {len(times[modes[0]])} counted steps per mode) ==")
    for mode in modes:
        med = statistics.median(times[mode])
        rows = extra[mode]
        stale = statistics.mean(r.get("async/staleness_mean", r["rollout/staleness"]) for r in rows)
        train = statistics.median(r["timing/train"] for r in rows)
        wait = statistics.median(r["timing/rollout"] for r in rows)
        print(f"{mode:18s} step {med:6.2f} s  ratio to {modes[0]}: {med / base:.2f}  (train {train:.2f} s, waiting "
              f"for the rollout {wait:.2f} s, mean staleness {stale:.2f}, reward {statistics.mean(r['reward/mean'] for r in rows):.3f})")


if __name__ == "__main__":
    main()
