"""The critic's train step against the actor's on the same samples, side by side: the critic in
the dense layout (before: how it trained until critic.shared_prompt) and in the shared-prompt
layout (after: the actor's layout, the default where exact), the actor in its shared-prompt
layout. Interleaved ABC CBA so machine noise hits all alike; one warm-up round not counted.

Samples are shaped like the default job's rollout (8 prompts x 8 samples, 43-token prompts,
2-16 response tokens; random token ids, no generation: only the train step is timed). The
critic's step is the product's (dsrl.stages.critic.CriticUpdate.step: pack, value loss,
backward, optimizer step); the actor's is the same work for the policy (the layout
dsrl.stages.policy packs, PPO forward/backward per microbatch against old log-probs scored once
before, optimizer step).

    python bench/bench_critic.py                        # SmolLM2 if converted, else the tiny model
    python bench/bench_critic.py --model tiny --rounds 1 --dtype float32
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time


def _samples(groups, per_group, prompt_len, lo, hi, vocab, seed=0):
    import torch

    from dsrl.actor.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(groups):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(per_group):
            r = int(torch.randint(lo, hi + 1, (1,), generator=g))
            out.append(Sample(prompt_ids=prompt, response_ids=torch.randint(10, vocab, (r,), generator=g).tolist(),
                              rollout_log_probs=[0.0] * r, group=gi, index=len(out), reward=float(len(out) % 2)))
    return out


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="auto",
                    help="auto (SmolLM2 if converted, else tiny), smollm2, tiny, or a folder")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    args = ap.parse_args(argv)

    import torch

    from dsrl.actor.batch import masked_rows
    from dsrl.actor.critic import CriticEngine
    from dsrl.actor.engine import ActorEngine
    from dsrl.actor.nonfinite import SkipCounter
    from dsrl.config.schema import Config
    from dsrl.loss.registry import get_objective
    from dsrl.loss.types import Reduction
    from dsrl.rollout.samples import pack_microbatches
    from dsrl.setup_assets import default_cache_dir, resolve_model_path, smollm2_path
    from dsrl.stages.critic import CriticUpdate

    model = args.model
    if model == "auto":
        model = "smollm2" if smollm2_path(default_cache_dir()).exists() else "tiny"
    path = resolve_model_path(model, default_cache_dir())
    mbs = args.micro_batch_size
    common = dict(zero_stage=0, dtype=args.dtype, attn_implementation="eager", lr=1e-6, micro_batch_size=mbs)
    actor = ActorEngine(path, trainable=True, **common)
    critic = CriticEngine(path, **common)
    vocab = min(int(actor.hf_config.vocab_size), 49152)
    samples = _samples(8, 8, 43, 2, 16, vocab)
    tokens = float(sum(len(s.response_ids) for s in samples))
    g = torch.Generator().manual_seed(1)
    advantages = [torch.randn(len(s.response_ids), generator=g) for s in samples]
    fields = {"returns": [torch.rand(len(s.response_ids), generator=g) for s in samples],
              "old_values": [torch.zeros(len(s.response_ids)) for s in samples]}
    ppo = get_objective("ppo")

    scored = pack_microbatches(samples, mbs, 0, shared_prompt=True)
    old_lp = [row for mb, lp in zip(scored, actor.score(scored)) for row in masked_rows(lp, mb["response_mask"])]

    def actor_step():
        batch = pack_microbatches(samples, mbs, 0, {"advantages": advantages, "old_log_probs": old_lp},
                                  shared_prompt=True)
        for i, mb in enumerate(batch):
            actor.forward_backward(mb, ppo, {}, Reduction("token-mean", global_tokens=tokens),
                                   is_last=i == len(batch) - 1)
        actor.optimizer_step()
        return len(batch)

    def critic_step(shared):
        cfg = Config()
        cfg.algo = dataclasses.replace(cfg.algo, advantage_estimator="gae", policy_loss="ppo")
        cfg.critic = dataclasses.replace(cfg.critic, shared_prompt="on" if shared else "off")
        cfg.logger = dataclasses.replace(cfg.logger, progress=False)
        critic.__dict__.pop("_shared_prompt_decision", None)
        update = CriticUpdate(cfg, critic, pad_id=0, algo=dataclasses.asdict(cfg.algo), skips=SkipCounter(3))
        update.step(samples, fields, step=1)
        return len(update.pack(samples)[0])

    modes = [("actor/shared", actor_step), ("critic/dense", lambda: critic_step(False)),
             ("critic/shared", lambda: critic_step(True))]
    resp = [len(s.response_ids) for s in samples]
    print(f"{model} ({path}), {args.dtype}, {len(samples)} samples (8 groups x 8), prompt 43, responses "
          f"{min(resp)}-{max(resp)} tokens, micro_batch_size {mbs}, torch threads {torch.get_num_threads()}",
          flush=True)
    for name, fn in modes:  # warm-up: allocator, kernels, the optimizers' first step
        t0 = time.perf_counter()
        fn()
        print(f"warm-up {name:13s} {time.perf_counter() - t0:6.2f}s", flush=True)
    times = {name: [] for name, _ in modes}
    for r in range(args.rounds):
        for name, fn in (modes if r % 2 == 0 else modes[::-1]):
            t0 = time.perf_counter()
            n = fn()
            times[name].append(time.perf_counter() - t0)
            print(f"round {r + 1} {name:13s} {times[name][-1]:6.2f}s  microbatches {n}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n== train step, medians over {args.rounds} round(s) ==")
    for k, v in med.items():
        print(f"{k:13s} {v:6.2f}s")
    print(f"critic/actor before (critic dense):   {med['critic/dense'] / med['actor/shared']:.2f}x")
    print(f"critic/actor after (critic shared):   {med['critic/shared'] / med['actor/shared']:.2f}x")
    print(f"critic shared / dense:                {med['critic/shared'] / med['critic/dense']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
