"""What the Tinker wire costs, and what the merged multi-LoRA optimizer step saves.

1. forward_backward tokens/s through the real SDK (HTTP + protobuf + futures, a full-parameter
   client on the service) against the same work through the in-process work units
   (`TrainingSession` on an `ActorEngine`): ratio = SDK / in-process (1.0 = no overhead).
2. An optimizer step for K LoRA slots: one merged step (`LoraPool.step` with K slots, each
   clipped on its own) against K single-slot steps, for K = 1, 2, 4 (ratio = K single / merged).
3. K LoRA clients of the SDK training at once (their forward_backward requests merge into one
   forward, their optim_steps into one step) against the same K clients served one at a time
   (each round of each client waits for the previous one), for K = 2, 4, 8 (ratio = one at a
   time / at once).

Both measured in one run, same process, same model, same data; median of --reps timed runs after
one warm-up, the variants timed in alternation. The service runs in a thread of this process
(its compute thread does the work).

    python bench/bench_serve.py [--model tiny|smollm2|<folder>] [--datums 8] [--tokens 64] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(n, length, vocab, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(3, vocab, length).tolist()
        out.append((toks, rng.integers(3, vocab, length).tolist(), (np.ones(length) / length).tolist()))
    return out


def _interleaved(fns, reps):
    """Median seconds of each function, timed in alternation (the machine's load drifts)."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def bench_protocol(model_path, args):
    import tinker
    from tinker import types

    from dsrl.actor.engine import ActorEngine
    from dsrl.actor.work_units import Datum, TrainingSession
    from dsrl.serve.server import ServerThread, build_service
    from dsrl.serve.service import ServiceOptions

    raw = _data(args.datums, args.tokens, args.vocab)
    tokens = args.datums * args.tokens
    engine = ActorEngine(model_path, zero_stage=0, dtype=args.dtype, grad_clip=0.0, micro_batch_size=args.micro_batch)
    sess = TrainingSession(engine, args.micro_batch)
    local = [Datum(t, {"target_tokens": y, "weights": w}) for t, y, w in raw]
    opts = ServiceOptions(model_path=model_path, model_name="bench", dtype=args.dtype,
                          checkpoint_dir=tempfile.mkdtemp(prefix="bench_serve_"), micro_batch_size=args.micro_batch)
    srv = ServerThread(build_service(opts), ["tml-bench-key"]).start()
    try:
        os.environ.setdefault("TINKER_TELEMETRY", "0")
        sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-bench-key")
        tc = sc.create_lora_training_client("bench", rank=0).result()
        remote = [types.Datum(model_input=types.ModelInput.from_ints(t),
                              loss_fn_inputs={"target_tokens": y, "weights": w}) for t, y, w in raw]
        t_local, t_sdk = _interleaved([lambda: sess.forward_backward(local, "cross_entropy"),
                                       lambda: tc.forward_backward(remote, "cross_entropy").result()], args.reps)
        sc.close("success").result()
    finally:
        srv.stop()
    return {"tokens": tokens, "in_process_tok_s": tokens / t_local, "sdk_tok_s": tokens / t_sdk,
            "sdk_over_in_process": t_local / t_sdk, "in_process_s": t_local, "sdk_s": t_sdk}


def _slot_steps(model_path, args, k):
    """Seconds of one merged step of k slots and of k single-slot steps (gradient fill excluded)."""
    import torch

    from dsrl.actor.work_units import AdamParams
    from dsrl.serve.lora import LoraPool, LoraSpec

    pool = LoraPool(model_path, dtype=getattr(torch, args.dtype), attn_implementation="eager",
                    micro_batch_size=args.micro_batch, pad_id=0)
    names = [f"s{i}" for i in range(k)]
    for i, n in enumerate(names):
        pool.add_slot(n, LoraSpec(rank=args.rank, alpha=32.0, seed=i))
    adam = {n: AdamParams(learning_rate=1e-4, grad_clip_norm=1.0) for n in names}

    def fill():
        for n in names:
            for p in pool.slot_parameters(n).values():
                p.grad = torch.full_like(p, 1e-3)

    def merged():
        fill()
        pool.step(adam)

    def singles():
        fill()
        for n in names:
            pool.step({n: adam[n]})

    fill_t, t_merged, t_single = _interleaved([fill, merged, singles], args.reps)
    n_params = sum(p.numel() for n in names for p in pool.slot_parameters(n).values())
    return t_merged - fill_t, t_single - fill_t, n_params


def bench_slots(model_path, args):
    out = {}
    for k in (1, 2, 4):
        t_merged, t_single, n_params = _slot_steps(model_path, args, k)
        out[k] = {"merged_s": t_merged, "k_single_s": t_single, "k_single_over_merged": t_single / max(t_merged, 1e-9),
                  "adapter_params": n_params}
    return out


def _round(client, data, adam) -> None:
    client.forward_backward(data, "cross_entropy").result()
    client.optim_step(adam).result()


def bench_clients(model_path, args):
    """Seconds of one round (forward_backward + optim_step) of K SDK LoRA clients, sent at once
    (futures first, results after) and one client after another."""
    import tinker
    from tinker import types

    from dsrl.serve.server import ServerThread, build_service
    from dsrl.serve.service import ServiceOptions

    raw = _data(args.datums, args.tokens, args.vocab, seed=1)
    data = [types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs={"target_tokens": y, "weights": w})
            for t, y, w in raw]
    adam = types.AdamParams(learning_rate=1e-5)
    out = {}
    for k in (2, 4, 8):
        opts = ServiceOptions(model_path=model_path, model_name="bench", dtype=args.dtype, allow_full_parameter=False,
                              checkpoint_dir=tempfile.mkdtemp(prefix="bench_serve_"), micro_batch_size=args.micro_batch,
                              max_merged_datums=max(256, k * args.datums))
        srv = ServerThread(build_service(opts), ["tml-bench-key"]).start()
        try:
            sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-bench-key")
            clients = [sc.create_lora_training_client("bench", rank=args.rank, seed=i).result() for i in range(k)]

            def at_once():
                fbs = [c.forward_backward(data, "cross_entropy") for c in clients]
                steps = [c.optim_step(adam) for c in clients]
                for f in fbs + steps:
                    f.result()

            def one_at_a_time():
                for c in clients:
                    _round(c, data, adam)
            t_once, t_seq = _interleaved([at_once, one_at_a_time], args.reps)
            sc.close("success").result()
        finally:
            srv.stop()
        out[k] = {"at_once_s": t_once, "one_at_a_time_s": t_seq, "one_at_a_time_over_at_once": t_seq / t_once}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | an HF folder")
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per datum")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of every slot")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dsrl.setup_assets import default_cache_dir, make_tiny_model, resolve_model_path
    from dsrl.testing import configure_test_env

    configure_test_env(default_cache_dir())
    if args.model == "tiny":
        make_tiny_model()
    model_path = resolve_model_path(args.model)
    from transformers import AutoConfig

    args.vocab = int(AutoConfig.from_pretrained(model_path).vocab_size)

    proto = bench_protocol(model_path, args)
    print(f"[bench-serve] model={args.model} dtype={args.dtype}: "
          f"forward_backward of {args.datums} x {args.tokens} tokens")
    print(f"  in-process work units : {proto['in_process_tok_s']:9.0f} tok/s ({proto['in_process_s'] * 1e3:.1f} ms)")
    print(f"  tinker SDK over HTTP  : {proto['sdk_tok_s']:9.0f} tok/s ({proto['sdk_s'] * 1e3:.1f} ms)")
    print(f"  ratio SDK / in-process: {proto['sdk_over_in_process']:.3f}")
    slots = bench_slots(model_path, args)
    print(f"[bench-serve] optimizer step of K LoRA slots (rank {args.rank}): K single-slot steps vs one merged step")
    for k, r in slots.items():
        print(f"  K={k}: merged {r['merged_s'] * 1e3:7.2f} ms | {k} single {r['k_single_s'] * 1e3:7.2f} ms | "
              f"ratio {r['k_single_over_merged']:.2f} ({r['adapter_params']} adapter params)")
    clients = bench_clients(model_path, args)
    print(f"[bench-serve] K SDK LoRA clients, one round (forward_backward of {args.datums} x {args.tokens} + optim_step):"
          f" all at once (merged) vs one at a time")
    for k, r in clients.items():
        print(f"  K={k}: at once {r['at_once_s'] * 1e3:8.1f} ms | one at a time {r['one_at_a_time_s'] * 1e3:8.1f} ms | "
              f"ratio {r['one_at_a_time_over_at_once']:.2f}")
    print(json.dumps({"protocol": proto, "slots": slots, "clients": clients}))


if __name__ == "__main__":
    main()
