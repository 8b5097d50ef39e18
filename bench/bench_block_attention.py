"""Forward + backward of one GRPO group (SmolLM2, the machine's auto dtype, eager attention) in
three layouts, interleaved ABC CBA: dense (one row per sample), the shared-prompt row under its
4-D mask, and the shared-prompt row by blocks (dsrl.actor.block_attention). Random token ids,
prompt P, n responses of R tokens; prints medians and the ratios to dense.

    python bench/bench_block_attention.py                     # P=150, n=8, R=256, 3 rounds
    python bench/bench_block_attention.py P=43 R=16 rounds=5  # the default job's shape
"""
from __future__ import annotations

import statistics
import sys
import time


def main(argv) -> int:
    opts = {"P": 150, "n": 8, "R": 256, "rounds": 3}
    for a in argv:
        k, v = a.split("=", 1)
        if k not in opts:
            raise SystemExit(f"unknown option {k} (known: {', '.join(opts)})")
        opts[k] = int(v)
    import torch
    from transformers import AutoModelForCausalLM

    from dsrl import hardware
    from dsrl.actor.batch import Sample, collate
    from dsrl.actor.block_attention import BLOCKS_KEY, attention_by_blocks
    from dsrl.actor.shared_prompt import additive_mask, collate_shared_prompt
    from dsrl.setup_assets import smollm2_path

    dtype = torch.bfloat16 if hardware.cpu_has_native_bf16(hardware.probe(1)) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path()), dtype=dtype, attn_implementation="eager")
    model.train()
    g = torch.Generator().manual_seed(0)
    P, n, R = opts["P"], opts["n"], opts["R"]
    prompt = torch.randint(100, 40000, (P,), generator=g).tolist()
    samples = [Sample(prompt_ids=prompt, response_ids=torch.randint(100, 40000, (R,), generator=g).tolist(),
                      rollout_log_probs=[0.0] * R, group=0, index=i) for i in range(n)]
    dense = collate(samples, 0)
    shared = collate_shared_prompt(samples, 0)

    def run(layout):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if layout == "dense":
            out = model(input_ids=dense["input_ids"], attention_mask=dense["attention_mask"], use_cache=False,
                        logits_to_keep=R + 1).logits
        else:
            mask = additive_mask(shared["attention_mask"], dtype)
            with attention_by_blocks(model) if layout == "blocks" else _Off() as on:
                extra = {"dsrl_blocks": shared[BLOCKS_KEY]} if on else {}
                out = model(input_ids=shared["input_ids"], attention_mask=mask, position_ids=shared["position_ids"],
                            use_cache=False, logits_to_keep=n * R + 1, **extra).logits
        out.float().logsumexp(-1).sum().backward()
        return time.perf_counter() - t0

    layouts = ["dense", "masked row", "blocks"]
    times = {k: [] for k in layouts}
    for k in layouts:
        run(k)  # warm-up
    for r in range(opts["rounds"]):
        for k in (layouts if r % 2 == 0 else layouts[::-1]):
            times[k].append(run(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"one group fwd+bwd, P={P} n={n} R={R}, {dtype}, {torch.get_num_threads()} threads, "
          f"medians of {opts['rounds']}:")
    for k in layouts:
        print(f"  {k:11s} {med[k]:7.3f} s   {med[k] / med['dense']:.3f} of dense")
    print(f"blocks / masked row: {med['blocks'] / med['masked row']:.3f}")
    return 0


class _Off:
    def __enter__(self):
        return False

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
