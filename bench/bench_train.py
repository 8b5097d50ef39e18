"""Train-phase time, measured side by side on the default job's data: shared-prompt vs dense
forward, and token-budget vs fixed-count microbatches.

One real rollout of the default job (SmolLM2, 8 prompts x 8 samples, 16 new tokens, the
machine's auto dtype) is generated once by the real vLLM worker, which is then closed so it
does not compete for the cores; the same samples are then trained on in four layouts,
interleaved in ABCD DCBA order so machine noise hits all alike (each train phase is one real
optimizer step on the same engine). Also prints the dense-vs-shared log-prob agreement on these
samples (max |delta log p| of the standalone scoring pass) and the pad fraction of each layout.

    make bench-train                                          # SmolLM2, 2 rounds
    python bench/bench_train.py bench.rounds=1 model.path=tiny    # quick
    python bench/bench_train.py bench.max_tokens=2048 model.dtype=float32
    python bench/bench_train.py bench.samples=/tmp/rollout.pkl   # keep the rollout; a re-run reuses it
    python bench/bench_train.py bench.split=0                    # without the matmul / rest split

The split (bench.split=1, the default) explains the ratio from this machine's own costs: each
layout's train phase is recorded once (every matrix multiply, backward included, as in
`bench_ceiling.py`), the multiplies are replayed alone, and the phase's median time is divided into
the multiplies (the replay), the optimizer step (timed inside the phase; the same work in every
layout) and the rest (attention's softmax and masks, norms, casts, log-softmax, packing, Python).
Then it projects shared/dense onto a machine whose multiplies run s times faster with the rest
unchanged (an AMX core against AVX-512 BF16: the multiplies are what AMX speeds up):
(m_shared / s + rest_shared) / (m_dense / s + rest_dense).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import statistics
import sys
import tempfile
import time

DEFAULTS = ["+exp=grpo_reuse", "algo.skip_zero_variance_groups=false", "trainer.eval_before=false",
            "trainer.eval_after=false", "trainer.save_final=false", "logger.progress=false", "logger.plot=false",
            "logger.tensorboard=false"]


def modes_of(budgets):
    """(name, shared prompt, token budget or 0 for micro_batch_size samples): both layouts with
    fixed-count microbatches and with the first budget, the shared layout with each further one."""
    first = budgets[0]
    out = [("dense/count", False, 0), ("shared/count", True, 0), ("dense/budget", False, first),
           ("shared/budget", True, first)]
    return out + [(f"shared/budget{b}", True, b) for b in budgets[1:]]


def _parse(argv):
    opts = {"rounds": 2, "max_tokens": [1024], "split": 1}
    overrides = []
    for a in argv:
        if a.startswith("bench."):
            k, v = a[len("bench."):].split("=", 1)
            opts[k] = v if k == "samples" else [int(b) for b in v.split(",")] if k == "max_tokens" else int(v)
        else:
            overrides.append(a)
    return opts, overrides


def _agreement(trainer, samples):
    """max |log p_shared - log p_dense| over every response token (standalone scoring pass)."""
    from dsrl.actor.shared_prompt import SharedPromptDecision

    actor = trainer.actor
    out = {}
    for on in (False, True):
        actor._shared_prompt_decision = SharedPromptDecision(on, "bench")
        out[on] = trainer.scoring.score(actor, samples, "bench")
    return max(float((a - b).abs().max()) for a, b in zip(out[True], out[False]))


class StepClock:
    """Seconds spent in the actor's optimizer step, per train phase (wraps the bound method)."""

    def __init__(self, actor):
        self.seconds = 0.0
        step = actor.optimizer_step

        def timed():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                self.seconds += time.perf_counter() - t0
        actor.optimizer_step = timed

    def pop(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


def split_table(med, opt, matmul, flops) -> list:
    """Rows (name, measured, multiplies, optimizer, rest) of each layout, from median phase time,
    median optimizer-step time and the replayed multiplies' time."""
    return [(n, med[n], matmul[n], opt[n], med[n] - matmul[n] - opt[n], flops[n]) for n in med if n in matmul]


def projected_ratio(shared, dense, speedup: float) -> float:
    """shared/dense if the multiplies ran `speedup` times faster and the rest did not; rows as
    split_table's (name, measured, multiplies, optimizer, rest, flops)."""
    def t(row):
        return row[2] / speedup + row[3] + row[4]
    return t(shared) / t(dense)


def main(argv) -> int:
    opts, overrides = _parse(argv)
    from hydra import compose, initialize_config_dir

    from dsrl.actor.shared_prompt import SharedPromptDecision, engine_uses_shared_prompt
    from dsrl.main import build

    conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(conf), version_base=None):
        node = compose(config_name="config", overrides=DEFAULTS + overrides)
    trainer = build(node, tempfile.mkdtemp(prefix="bench_train_"))
    engine_uses_shared_prompt(trainer.cfg, trainer.actor)
    auto = trainer.actor._shared_prompt_decision  # what actor.shared_prompt decided for this model
    path = opts.get("samples")
    try:
        if path and os.path.exists(path):  # the rollout of an earlier run (same job): skip generation
            samples = pickle.load(open(path, "rb"))
        else:
            samples = trainer.rollout._rollout(1, weights_step=0, show_progress=False).samples
            if path:
                pickle.dump(samples, open(path, "wb"))
    finally:
        trainer.worker.close()
    cfg0 = trainer.cfg
    prompt_lens = sorted({len(s.prompt_ids) for s in samples})
    resp = [len(s.response_ids) for s in samples]
    print(f"data: {len(samples)} samples, prompt lengths {prompt_lens[0]}-{prompt_lens[-1]}, response lengths "
          f"{min(resp)}-{max(resp)} (mean {sum(resp) / len(resp):.1f}); dtype {cfg0.model.dtype}, "
          f"attention {cfg0.model.attn_implementation}, micro_batch_size {cfg0.actor.micro_batch_size}, "
          f"budget {opts['max_tokens']} tokens", flush=True)
    print(f"log-prob agreement, shared vs dense scoring pass ({cfg0.model.dtype}): max |dlogp| = "
          f"{_agreement(trainer, samples):.2e}", flush=True)
    modes = modes_of(opts["max_tokens"])

    def run(name, shared, budget, step):
        # The policy update packs by its own config; the layout decision is cached on the engine.
        trainer.policy.cfg = dataclasses.replace(cfg0, actor=dataclasses.replace(cfg0.actor,
                                                                                 max_tokens_per_microbatch=budget))
        trainer.actor._shared_prompt_decision = SharedPromptDecision(shared, "bench")
        trainer.timer.pop()
        trainer.actor.weights_pushed()  # the engine is closed: mark the push each step of the job makes
        m = trainer.train_on(samples, step + 1)
        t = trainer.timer.pop()["timing/train"]
        print(f"round {step:2d} {name:13s} train={t:6.2f}s microbatches={m['train/microbatches']:.0f} "
              f"pad_fraction={m['train/pad_fraction']:.3f} loss={m['train/loss']:+.4f}", flush=True)
        return t, m

    clock = StepClock(trainer.actor)
    run(*modes[0], 0)  # warm-up (allocator, kernels, DeepSpeed's first step); not counted
    clock.pop()
    times = {name: [] for name, _, _ in modes}
    opt_times = {name: [] for name, _, _ in modes}
    pads = {}
    for r in range(opts["rounds"]):
        order = modes if r % 2 == 0 else modes[::-1]  # ABCD, DCBA, ...
        for name, shared, budget in order:
            t, m = run(name, shared, budget, r + 1)
            times[name].append(t)
            opt_times[name].append(clock.pop())
            pads[name] = m["train/pad_fraction"]
    med = {k: statistics.median(v) for k, v in times.items()}
    opt_med = {k: statistics.median(v) for k, v in opt_times.items()}
    print(f"\n== train phase, medians over {opts['rounds']} round(s) ==")
    for name in med:
        print(f"{name:13s} {med[name]:6.2f}s  pad_fraction {pads[name]:.3f}")
    print(f"shared-prompt / dense (count-based microbatches):  {med['shared/count'] / med['dense/count']:.3f}"
          "   (target <= 0.5 at n=8)")
    print(f"token-budget / fixed-count (dense):                {med['dense/budget'] / med['dense/count']:.3f}")
    print(f"token-budget / fixed-count (shared-prompt):        {med['shared/budget'] / med['shared/count']:.3f}")
    print(f"shared+budget / dense+count:                       {med['shared/budget'] / med['dense/count']:.3f}")
    for b in opts["max_tokens"][1:]:
        print(f"shared+budget {b} / shared+budget {opts['max_tokens'][0]}:{' ' * 18}"
              f"{med[f'shared/budget{b}'] / med['shared/budget']:.3f}")
    print(f"actor.shared_prompt={cfg0.actor.shared_prompt} decided: {auto.reason}")
    if opts["split"]:
        _print_split(modes, run, med, opt_med, opts["rounds"] + 1)
    return 0


def _print_split(modes, run, med, opt_med, step) -> None:
    from bench_ceiling import ceiling, recorded

    matmul, flops = {}, {}
    print("\nrecording each layout's multiplies: one more pass each, slowed by the recorder, not counted")
    for name, shared, budget in modes[:4]:
        _, counts, _ = recorded(lambda: run(name, shared, budget, step))
        flops[name], matmul[name] = ceiling(counts)
        step += 1
    rows = split_table(med, opt_med, matmul, flops)
    print(f"\n== where each layout's train phase goes (medians; multiplies replayed alone) ==")
    print(f"{'layout':13s} {'measured':>9s} {'multiplies':>11s} {'optimizer':>10s} {'rest':>7s} {'TFLOP':>7s}")
    for name, t, m, o, rest, f in rows:
        print(f"{name:13s} {t:8.2f}s {m:10.2f}s {o:9.2f}s {rest:6.2f}s {f / 1e12:7.3f}")
    by = {r[0]: r for r in rows}
    for kind in ("count", "budget"):
        d, sh = by[f"dense/{kind}"], by[f"shared/{kind}"]
        print(f"\nshared/dense, {kind} microbatches ({d[0]} {sh[0]}), by part: multiplies {sh[2] / d[2]:.3f}, "
              f"optimizer {sh[3] / d[3]:.3f}, rest {sh[4] / d[4]:.3f}, matmul FLOPs {sh[5] / d[5]:.3f}; all {sh[1] / d[1]:.3f}")
        print("  projected where the multiplies run s x faster and the rest does not: "
              + "   ".join(f"s={s:g}: {projected_ratio(sh, d, s):.3f}" for s in (1, 2, 3, 4, 6)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
