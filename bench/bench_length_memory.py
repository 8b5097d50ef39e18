"""Trainer peak memory against response length: how long may rollout.max_new_tokens be?

For each length L, a fresh subprocess builds the actor (DeepSpeed engine, AdamW) exactly as the
given preset configures it (dtype, attention kernel, threads resolved by dsrl/hardware.py) and
trains one microbatch of actor.micro_batch_size samples whose responses ALL run to L tokens (the
worst case: one sample at the cap pads its whole microbatch to it) after a --prompt-token prompt,
then takes the optimizer step. Reported: the process's peak RSS (getrusage ru_maxrss, the kernel's
high-water mark) and the microbatch's forward+backward seconds. Tokens are random ids: memory and
time depend on the shape, not the text. Not counted: the vLLM engine processes (their memory is
fixed at start-up by rollout.kv_cache_gib and the weights, whatever the length; measure them
with bench/peak_rss.py around a real run).

    python bench/bench_length_memory.py --lengths 256,512,1024,2048 [--prompt 200] [--cap-gib 16] [-- +exp=gsm8k_reasoning ...]

--cap-gib: a length whose process passes this RSS is stopped there and reported as over the cap (on a
shared machine, so the measurement cannot push other people's processes out of memory).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from dsrl.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(ROOT, "conf")), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def measure(length: int, prompt_tokens: int, overrides) -> dict:
    """Subprocess body: one full-length training microbatch and optimizer step; peak RSS."""
    import torch

    from dsrl.actor.batch import Sample, collate
    from dsrl.actor.engine import ActorEngine
    from dsrl.config.schema import to_config
    from dsrl.loss.registry import get_objective
    from dsrl.loss.types import Reduction
    from dsrl.main import _resolve_hardware
    from dsrl.setup_assets import default_cache_dir, resolve_model_path

    node = _compose(list(overrides) + [f"rollout.max_new_tokens={length}"])
    cfg = to_config(node)
    _resolve_hardware(cfg, node)
    torch.set_num_threads(cfg.actor.num_threads)
    path = resolve_model_path(cfg.model.path, str(default_cache_dir()))
    ac = cfg.actor
    actor = ActorEngine(path, zero_stage=ac.zero_stage, dtype=cfg.model.dtype, lr=ac.lr,
                        micro_batch_size=ac.micro_batch_size, lora=ac.lora,
                        attn_implementation=cfg.model.attn_implementation,
                        temperature=cfg.rollout.temperature)
    after_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    g = torch.Generator().manual_seed(0)
    n = ac.micro_batch_size
    samples = []
    for i in range(n):
        ids = torch.randint(10, 1000, (prompt_tokens + length,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[:prompt_tokens], response_ids=ids[prompt_tokens:],
                              rollout_log_probs=[-1.0] * length, group=i // cfg.algo.n_samples_per_prompt, index=i))
    actor.weights_pushed()
    mb = collate(samples, pad_id=0)
    mb["advantages"] = torch.randn(mb["loss_mask"].shape, generator=g) * mb["loss_mask"]
    t0 = time.perf_counter()
    actor.forward_backward(mb, get_objective("ppo"), {}, Reduction("token-mean", global_tokens=float(n * length)),
                           reuse_training_logprobs=True, is_last=True)
    seconds = time.perf_counter() - t0
    actor.optimizer_step()
    return {"max_new_tokens": length, "prompt_tokens": prompt_tokens, "samples": n,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "after_build_mib": round(after_build), "fwd_bwd_s": round(seconds, 1),
            "dtype": cfg.model.dtype, "attn": cfg.model.attn_implementation}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens per sample (GSM8K + system prompt: ~150-250)")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="stop a length's process past this RSS (0: no cap)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", default=[])
    args = ap.parse_args()
    overrides = args.overrides or ["+exp=gsm8k_reasoning"]
    if args.one is not None:
        print("RESULT " + json.dumps(measure(args.one, args.prompt, overrides)), flush=True)
        return 0
    import psutil

    for length in (int(x) for x in args.lengths.split(",")):
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--one", str(length), "--prompt",
                                     str(args.prompt), *overrides], stdout=out, stderr=err, text=True)
            watched, peak = psutil.Process(proc.pid), 0
            while proc.poll() is None:
                try:
                    peak = max(peak, watched.memory_info().rss)
                except psutil.Error:
                    pass
                if args.cap_gib and peak > args.cap_gib * 2**30:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.1)
            if args.cap_gib and peak > args.cap_gib * 2**30:
                print(json.dumps({"max_new_tokens": length, "over_cap_gib": args.cap_gib,
                                  "stopped_at_rss_mib": round(peak / 2**20)}), flush=True)
                continue
            out.seek(0)
            err.seek(0)
            lines = [ln for ln in out.read().splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                tail = err.read().strip().splitlines()[-3:]
                print(json.dumps({"max_new_tokens": length, "rc": proc.returncode, "error": " | ".join(tail)[-400:]}),
                      flush=True)
                continue
            print(lines[-1][len("RESULT "):], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
