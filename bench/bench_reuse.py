"""Training log-prob reuse, measured side by side: the same job alternates steps with reuse off
and on (one set of engines, interleaved so machine noise hits both alike) and prints the ratios
of (old_logprobs + train) time and of the whole step time. Physical limit of the first ratio:
fwd+bwd / (fwd + fwd+bwd) ~ 0.75 when backward costs twice a forward.

    make bench-reuse                       # SmolLM2, 8 prompts x 8 samples, 6 steps per mode
    python bench/bench_reuse.py model.path=tiny bench.steps=2   # quick
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile

DEFAULTS = ["+exp=grpo_reuse", "algo.reuse_logprobs=auto", "algo.skip_zero_variance_groups=false",
            "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_final=false",
            "logger.progress=false", "logger.plot=false", "logger.tensorboard=false"]


def main(argv) -> int:
    steps = 6
    overrides = []
    for a in argv:
        if a.startswith("bench.steps="):
            steps = int(a.split("=", 1)[1])
        else:
            overrides.append(a)
    from hydra import compose, initialize_config_dir

    from dsrl.main import build
    from dsrl.validation.reuse import decide_reuse

    conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(conf), version_base=None):
        node = compose(config_name="config", overrides=DEFAULTS + overrides)
    run_dir = tempfile.mkdtemp(prefix="bench_reuse_")
    trainer = build(node, run_dir)
    # "on" is the decision build() made, model checks included; "off" only flips the mode.
    off = dataclasses.replace(trainer.cfg, algo=dataclasses.replace(trainer.cfg.algo, reuse_logprobs="off"))
    modes = {"on": trainer.decision, "off": decide_reuse(off)}
    if not modes["on"].reuse:
        raise SystemExit(f"bench config must allow reuse: {modes['on'].reason}")
    rows = {"off": [], "on": []}
    try:
        trainer.decision = modes["off"]
        trainer.step(0)  # warm-up (allocator, kernels); not counted
        for k in range(2 * steps):
            mode = ("off", "on")[k % 2] if (k // 2) % 2 == 0 else ("on", "off")[k % 2]  # ABBA order
            trainer.decision = modes[mode]
            m = trainer.step(k + 1)
            rows[mode].append((m["timing/old_logprobs"] + m["timing/train"], m["timing/step"],
                               m["timing/old_logprobs"], m["timing/train"]))
            print(f"step {k + 1:2d} reuse={mode:3s} old_logprobs={m['timing/old_logprobs']:.2f}s "
                  f"train={m['timing/train']:.2f}s step={m['timing/step']:.2f}s", flush=True)
    finally:
        trainer.worker.close()

    def med(mode, i):
        return statistics.median(r[i] for r in rows[mode])

    print("\n== training log-prob reuse (medians over %d steps per mode) ==" % steps)
    print(f"off: old_logprobs {med('off', 2):.2f}s + train {med('off', 3):.2f}s = {med('off', 0):.2f}s; step {med('off', 1):.2f}s")
    print(f"on : old_logprobs {med('on', 2):.2f}s + train {med('on', 3):.2f}s = {med('on', 0):.2f}s; step {med('on', 1):.2f}s")
    print(f"ratio (old_logprobs + train), on/off: {med('on', 0) / med('off', 0):.3f}   (physical limit ~0.75)")
    print(f"ratio step time, on/off:              {med('on', 1) / med('off', 1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
