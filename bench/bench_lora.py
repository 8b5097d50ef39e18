"""LoRA (actor.lora.rank > 0) against full-parameter training on the same job: whole-step time
(and its phases), bytes per weight sync, and the trainer's peak memory, printed as LoRA / full
ratios measured in one run.

Time: two trainers in one process (each with its own vLLM engine), their steps interleaved ABBA
so machine noise hits both; the first round warms up and is not counted. Sync bytes: the
`rollout/sync_bytes` of each step (LoRA: the adapter alone into the LoRA-enabled engine; full: every
weight). Memory: peak RSS of the trainer side (actor engine + optimizer + training steps on
batches of the job's shape + one weight export), each mode in a fresh subprocess, so neither sees
the other's allocations (the vLLM engine, a separate process of similar size in both modes, is
not counted). Every group's rewards may be equal on the tiny random model, so
`algo.skip_zero_variance_groups=false` keeps the training forward in both modes.

    make bench-lora                              # tiny model, float32
    make bench-lora ARGS="bench.model=smollm2 bench.steps=3"   # SmolLM2-135M (>= 8 GiB free)
    make bench-lora ARGS="bench.rank=16 actor.lora.alpha=32"   # any Hydra override applies to both modes
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, HERE)
DEFAULTS = ["+exp=grpo_reuse", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_final=false",
            "trainer.save_every=0", "logger.progress=false", "logger.plot=false", "logger.tensorboard=false",
            "trainer.total_steps=1000000", "algo.skip_zero_variance_groups=false"]
MODELS = {"tiny": ["model.path=tiny", "model.dtype=float32", "rollout.dtype=float32"],
          "smollm2": ["model.path=smollm2"]}
PHASES = ("rollout", "old_logprobs", "train", "weight_sync")


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from dsrl.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(ROOT, "conf")), version_base=None):
        return compose(config_name="config", overrides=DEFAULTS + list(overrides))


def run_time(overrides, rank, steps):
    """Median step / phase times and sync bytes per mode, interleaved ABBA."""
    from dsrl.main import build

    trainers = {}
    try:
        for key, extra in (("full", []), ("lora", [f"actor.lora.rank={rank}"])):
            trainers[key] = build(_compose(list(overrides) + extra), tempfile.mkdtemp(prefix=f"bench_lora_{key}_"))
        rows = {k: [] for k in trainers}
        step = {k: 0 for k in trainers}
        order = ["full", "lora"]
        for k in range(steps + 1):  # round 0 warms both up
            for key in (order if k % 2 == 0 else order[::-1]):
                step[key] += 1
                m = trainers[key].step(step[key])
                row = {p: m.get(f"timing/{p}", 0.0) for p in PHASES}
                row["step"], row["bytes"] = m["timing/step"], m["rollout/sync_bytes"]
                row["transfer"] = m["timing/sync_seconds"]  # export + load, without the probe
                row["diff"] = m.get("rollout/sync_logprob_diff", float("nan"))
                if k:
                    rows[key].append(row)
                print(f"{key:<4} step {step[key]:2d} {'(warm-up) ' if not k else ''}"
                      + " ".join(f"{p}={row[p]:.2f}s" for p in ("step", *PHASES))
                      + f" transfer={row['transfer']:.3f}s sync_bytes={row['bytes']:.0f} sync_diff={row['diff']:.2g}",
                      flush=True)
    finally:
        for t in trainers.values():
            with contextlib.suppress(Exception):
                t.worker.close()
    dtype = next(iter(trainers.values())).cfg.model.dtype
    trainers.clear()
    gc.collect()
    return {k: {c: statistics.median(r[c] for r in rs) for c in ("step", "bytes", "transfer", *PHASES)}
            for k, rs in rows.items()}, dtype


def measure_memory(overrides, rank, mode) -> dict:
    """Subprocess body: the trainer side of one mode; prints its peak RSS as JSON."""
    import torch

    from dsrl.actor.batch import Sample, collate
    from dsrl.actor.engine import ActorEngine
    from dsrl.config.schema import to_config
    from dsrl.loss.registry import get_objective
    from dsrl.loss.types import Reduction
    from dsrl.setup_assets import default_cache_dir, resolve_model_path

    extra = [f"actor.lora.rank={rank}"] if mode == "lora" else []
    cfg = to_config(_compose(list(overrides) + extra))
    from dsrl.main import _resolve_hardware

    _resolve_hardware(cfg, _compose(list(overrides) + extra))
    path = resolve_model_path(cfg.model.path, str(default_cache_dir()))
    ac = cfg.actor
    actor = ActorEngine(path, zero_stage=ac.zero_stage, dtype=cfg.model.dtype, lr=ac.lr,
                        micro_batch_size=ac.micro_batch_size, lora=ac.lora,
                        attn_implementation=cfg.model.attn_implementation)
    g = torch.Generator().manual_seed(0)
    n = cfg.algo.rollout_batch_size * cfg.algo.n_samples_per_prompt
    samples = []
    for i in range(n):  # the job's shape: 40 prompt tokens (a chat-templated sum), max_new_tokens
        ids = torch.randint(10, 1000, (40 + cfg.rollout.max_new_tokens,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[:40], response_ids=ids[40:], rollout_log_probs=[-1.0] * (len(ids) - 40),
                              group=i // cfg.algo.n_samples_per_prompt, index=i))
    for _ in range(2):
        chunks = [samples[i:i + ac.micro_batch_size] for i in range(0, n, ac.micro_batch_size)]
        actor.weights_pushed()  # a new rollout from these weights (reuse refuses steps since the last push)
        for j, chunk in enumerate(chunks):
            mb = collate(chunk, pad_id=0)
            mb["advantages"] = torch.randn(mb["loss_mask"].shape, generator=g) * mb["loss_mask"]
            reduce = Reduction("token-mean", global_tokens=float(n * cfg.rollout.max_new_tokens))
            actor.forward_backward(mb, get_objective("ppo"), {}, reduce, reuse_training_logprobs=True,
                                   is_last=j == len(chunks) - 1)
        actor.optimizer_step()
    if mode == "lora":
        from dsrl.actor.lora import adapter_state

        exported = sum(t.numel() * t.element_size() for t in adapter_state(actor).values())
    else:
        exported = sum(t.numel() * t.element_size() for _, t in actor.export_named_tensors(copy=False))
    trainable = sum(p.numel() for p in actor.module.parameters() if p.requires_grad)
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "trainable": trainable,
            "exported_bytes": exported}


def run_memory(overrides, rank, rounds):
    out = {"full": [], "lora": []}
    for k in range(rounds):
        for mode in (("full", "lora") if k % 2 == 0 else ("lora", "full")):
            r = subprocess.run([sys.executable, __file__, f"bench.memory={mode}", f"bench.rank={rank}", *overrides],
                               capture_output=True, text=True, cwd=ROOT)
            line = [x for x in r.stdout.splitlines() if x.startswith("MEMORY ")]
            if r.returncode != 0 or not line:
                raise RuntimeError(f"memory run ({mode}) failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
            out[mode].append(json.loads(line[-1][len("MEMORY "):]))
            print(f"{mode:<4} memory run {k + 1}: peak RSS {out[mode][-1]['peak_rss_mib']:.0f} MiB", flush=True)
    return {m: {"peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs), "trainable": rs[0]["trainable"],
                "exported_bytes": rs[0]["exported_bytes"]} for m, rs in out.items()}


def main(argv) -> int:
    opts = {"steps": 4, "rank": 8, "model": "tiny", "memory": "", "memory_rounds": 2}
    overrides = []
    for a in argv:
        key, _, value = a.partition("=")
        if key.startswith("bench."):
            if key[6:] not in opts:
                raise SystemExit(f"unknown option {key} (known: {', '.join('bench.' + k for k in opts)})")
            opts[key[6:]] = type(opts[key[6:]])(value)
        else:
            overrides.append(a)
    if opts["memory"]:  # subprocess of run_memory
        print("MEMORY " + json.dumps(measure_memory(overrides, opts["rank"], opts["memory"])), flush=True)
        return 0
    if opts["model"] not in MODELS:
        raise SystemExit(f"bench.model={opts['model']} is not one of {list(MODELS)}")
    overrides = MODELS[opts["model"]] + overrides
    from bench_rollout import machine_line

    print(machine_line(), flush=True)
    mem = run_memory(overrides, opts["rank"], opts["memory_rounds"])
    med, dtype = run_time(overrides, opts["rank"], opts["steps"])
    f, lo = med["full"], med["lora"]
    print(f"\n== LoRA rank {opts['rank']} vs full, {opts['model']} ({dtype}), medians of {opts['steps']} steps per "
          f"mode, interleaved ==")
    for key in ("full", "lora"):
        m = med[key]
        print(f"{key:<4} step {m['step']:.2f}s (" + ", ".join(f"{p} {m[p]:.2f}s" for p in PHASES)
              + f") sync {m['bytes'] / 2**20:.2f} MiB in {m['transfer']:.3f}s + probe, trainer peak RSS {mem[key]['peak_rss_mib']:.0f} MiB, "
              f"trainable params {mem[key]['trainable']}")
    print(f"ratio LoRA / full: step time {lo['step'] / f['step']:.3f}, train phase {lo['train'] / f['train']:.3f}, "
          f"weight_sync phase {lo['weight_sync'] / f['weight_sync']:.3f} (transfer alone "
          f"{lo['transfer'] / f['transfer']:.3f}), sync bytes {lo['bytes'] / f['bytes']:.4f}, "
          f"trainer peak RSS {mem['lora']['peak_rss_mib'] / mem['full']['peak_rss_mib']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
