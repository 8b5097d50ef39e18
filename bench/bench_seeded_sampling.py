"""What exact, seeded sampling costs: the default job's rollout (8 prompts x 8 samples, 16 new
tokens, SmolLM2) with per-request seeds and without chunked prefill (what dsrl does on CPU, see
dsrl.rollout.seeds) against vLLM's defaults (engine seed only, chunked prefill), two engines side by
side, alternated ABBA, medians printed with their ratio.

    make bench-seeds [ARGS="bench.rounds=6 rollout.dtype=float32"]
"""
from __future__ import annotations

import os
import statistics
import sys
import time


def main(argv):
    rounds, dtype = 6, "auto"
    for a in argv:
        if a.startswith("bench.rounds="):
            rounds = int(a.split("=", 1)[1])
        elif a.startswith("rollout.dtype="):
            dtype = a.split("=", 1)[1]
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from dsrl import hardware
    from dsrl.data.chat import apply_chat_template
    from dsrl.data.registry import make_source
    from dsrl.rollout.seeds import request_seeds
    from dsrl.setup_assets import smollm2_path

    if dtype == "auto":
        dtype = "bfloat16" if hardware.cpu_has_native_bf16(hardware.probe(1)) else "float32"
    path = str(smollm2_path())
    tok = AutoTokenizer.from_pretrained(path)
    import random

    prompts = make_source("arith").sample_train(8, random.Random(0))
    ids = [apply_chat_template(tok, p, "", True) for p in prompts]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    common = dict(model=path, dtype=dtype, seed=0, max_model_len=512, enforce_eager=True, disable_log_stats=True,
                  enable_prefix_caching=True, logprobs_mode="processed_logprobs")
    engines = {"default": LLM(**common), "seeded": LLM(**common, enable_chunked_prefill=False)}
    times = {"default": [], "seeded": []}
    for r in range(2 * rounds + 1):
        for name in (("default", "seeded") if (r // 2) % 2 == 0 else ("seeded", "default")):
            seeds = request_seeds(0, r, 0, len(ids)) if name == "seeded" else [None] * len(ids)
            params = [SamplingParams(n=8, temperature=1.0, max_tokens=16, logprobs=0, seed=s) for s in seeds]
            t0 = time.perf_counter()
            engines[name].generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
            if r:  # round 0 warms both engines up
                times[name].append(time.perf_counter() - t0)
    d, s = statistics.median(times["default"]), statistics.median(times["seeded"])
    print(f"rollout of 8x8 samples, 16 tokens, {dtype}: default {d:.2f} s, seeded/no chunked prefill {s:.2f} s "
          f"(medians of {len(times['default'])}); ratio seeded/default {s / d:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
