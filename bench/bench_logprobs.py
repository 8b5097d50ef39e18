"""Peak memory and time of token log-probs (+ entropy) fwd+bwd: naive full fp32 log-softmax vs
the chunked autograd Function in dsrl.actor.logprobs.

Each variant runs in its own subprocess: peak memory = the process's peak RSS (getrusage
ru_maxrss, a true high-water mark of touched memory) minus its RSS after the inputs are built,
i.e. the extra memory the fwd+bwd needs on top of the logits. Time = best of N fwd+bwd runs.
The subprocesses save log-probs, entropy and part of the logits gradient, and the parent prints
the max abs difference to the naive variant.

    python bench/bench_logprobs.py [--B 8 --T 256 --V 49152 --repeats 3]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(args) -> None:
    sys.path.insert(0, ROOT)
    import torch

    import dsrl.actor.logprobs as L

    fn = L.token_logprobs if args.variant == "chunked" else L.token_logprobs_naive
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    # Model output [B, T+1, V]; the trainer scores logits[:, :-1] (a non-contiguous view).
    full = (torch.randn(args.B, args.T + 1, args.V, generator=g) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, args.V, (args.B, args.T), generator=g)
    weights = torch.randn(args.B, args.T, generator=g)
    base = _rss_bytes()
    times = []
    for i in range(args.repeats):
        full.grad = None
        t0 = time.perf_counter()
        lp, ent = fn(full[:, :-1], targets, temperature=args.temperature, with_entropy=True)
        loss = (lp * weights).sum() + args.entropy_coef * ent.sum() if args.entropy_coef else (lp * weights).sum()
        loss.backward()
        times.append(time.perf_counter() - t0)
        if i == 0:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            torch.save({"lp": lp.detach(), "ent": ent.detach(), "grad0": full.grad[0].float().clone(),
                        "gradL": full.grad[-1].float().clone()}, args.out)
        del lp, ent, loss
    print(json.dumps({"peak_extra_mib": (peak - base) / 2 ** 20, "logits_mib": full.numel() * full.element_size() / 2 ** 20,
                      "best_s": min(times), "times": times}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--V", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--entropy-coef", type=float, default=0.0, dest="entropy_coef")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant")
    ap.add_argument("--dtype")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    import torch

    print(f"token_logprobs fwd+bwd (entropy computed, coef {args.entropy_coef}), B={args.B} T={args.T} "
          f"V={args.V}, temperature {args.temperature}, torch threads {torch.get_num_threads()}")
    print(f"{'dtype':5} {'variant':8} {'logits MiB':>10} {'peak extra MiB':>15} {'best s':>8} {'max|dlp|':>10} "
          f"{'max|dent|':>10} {'max|dgrad|':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            res = {}
            for variant in ("naive", "chunked"):
                out = os.path.join(tmp, f"{dtype}_{variant}.pt")
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant, "--dtype", dtype,
                       "--out", out, "--B", str(args.B), "--T", str(args.T), "--V", str(args.V),
                       "--repeats", str(args.repeats), "--temperature", str(args.temperature),
                       "--entropy-coef", str(args.entropy_coef)]
                r = subprocess.run(cmd, capture_output=True, text=True, check=True)
                res[variant] = json.loads(r.stdout.strip().splitlines()[-1])
                res[variant]["tensors"] = torch.load(out)
            ref = res["naive"]["tensors"]
            for variant in ("naive", "chunked"):
                t = res[variant]["tensors"]
                d_lp = (t["lp"] - ref["lp"]).abs().max().item()
                d_ent = (t["ent"] - ref["ent"]).abs().max().item()
                d_g = max((t[k] - ref[k]).abs().max().item() for k in ("grad0", "gradL"))
                r = res[variant]
                print(f"{dtype:5} {variant:8} {r['logits_mib']:10.0f} {r['peak_extra_mib']:15.0f} {r['best_s']:8.3f} "
                      f"{d_lp:10.2e} {d_ent:10.2e} {d_g:11.2e}")
            ratio = res["chunked"]["peak_extra_mib"] / max(res["naive"]["peak_extra_mib"], 1e-9)
            speed = res["naive"]["best_s"] / res["chunked"]["best_s"]
            print(f"{dtype:5} chunked/naive peak memory {ratio:.2f}x, speed-up {speed:.2f}x")


if __name__ == "__main__":
    main()
