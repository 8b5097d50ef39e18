"""bf16 vs float32 for the trainer on this machine: one training microbatch of the default job
(SmolLM2-135M, 8 samples x ~56 tokens, forward + backward + AdamW step) and one scoring forward,
alternated ABBA in one process, medians and the bf16/fp32 ratio printed. This is the evidence
behind dsrl.hardware's dtype choice for a CPU kind.

    make bench-dtype [ARGS="bench.rounds=6"]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch


def main(argv):
    rounds = 6
    for a in argv:
        if a.startswith("bench.rounds="):
            rounds = int(a.split("=", 1)[1])
    from transformers import AutoModelForCausalLM

    from dsrl import hardware
    from dsrl.setup_assets import smollm2_path

    machine = hardware.probe(1)
    torch.set_num_threads(machine.cpu_count)
    torch.manual_seed(0)
    x = torch.randint(0, 49152, (8, 56))
    models = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        m = AutoModelForCausalLM.from_pretrained(str(smollm2_path()), dtype=dt, attn_implementation="eager")
        m.train()
        models[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-6))
    train = {n: [] for n in models}
    fwd = {n: [] for n in models}
    for r in range(2 * rounds + 1):
        for name in (("float32", "bfloat16") if (r // 2) % 2 == 0 else ("bfloat16", "float32")):
            m, opt = models[name]
            t0 = time.perf_counter()
            logits = m(input_ids=x).logits.float()
            logits.log_softmax(-1).gather(-1, x[:, :, None]).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            with torch.no_grad():
                m(input_ids=x)
            t2 = time.perf_counter()
            if r:  # round 0 warms up both
                train[name].append(t1 - t0)
                fwd[name].append(t2 - t1)
    print(hardware.describe(machine))
    for kind, d in (("train microbatch (fwd+bwd+AdamW)", train), ("scoring forward", fwd)):
        f, b = statistics.median(d["float32"]), statistics.median(d["bfloat16"])
        print(f"{kind}: float32 {f:.2f} s, bfloat16 {b:.2f} s (medians of {len(d['float32'])}); "
              f"ratio bf16/fp32 {b / f:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
