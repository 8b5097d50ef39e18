"""TRL's GRPOTrainer on the default job's work, timed per optimizer step; run by bench/bench_step.py
in its own virtual environment (TRL must not change dsrl's packages), so it imports nothing from
dsrl. Input: a JSON file {"model", "dtype", "steps", "prompts": [{"messages", "answer"}], ...};
output: one JSON line {"step_seconds": [...], "trl": version} on stdout.
With "lockstep": true each optimizer step first waits for a line on stdin and reports
{"step_seconds": t} when it ends, so the caller can interleave TRL's steps with its own (both
processes then see the same machine load).

Same work as the dsrl job it is compared with (the spec carries it: the default job is SmolLM2,
8 prompts x 8 samples per step, 16 new tokens, temperature 1; gsm8k_reasoning the same with 256
tokens on GSM8K), one optimizer step per generation (microbatches of the job's size), no reference
model (beta=0), the job's lr, plain transformers `generate` (TRL's path without a vLLM server).
Rewards as dsrl's verifiers score them: arith the first number of the completion, gsm8k the last."""
from __future__ import annotations

import json
import re
import sys
import time


def main(spec_path: str) -> int:
    spec = json.load(open(spec_path))
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(spec.get("threads", 2)))
    dtype = getattr(torch, spec["dtype"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="eager")
    rows = [{"prompt": p["messages"], "answer": p["answer"]} for p in spec["prompts"]]
    data = Dataset.from_list(rows)

    last = spec.get("reward", "arith") == "gsm8k"  # gsm8k: the last number counts; arith: the first

    def number(text):
        found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        if not found:
            return None
        value = found[-1 if last else 0].replace(",", "")
        return value[:-2] if value.endswith(".0") else value

    def reward(completions, answer, **_):
        out = []
        for c, a in zip(completions, answer):
            text = c[0]["content"] if isinstance(c, list) else c
            out.append(1.0 if number(text) == str(a).replace(",", "") else 0.0)
        return out

    times = []

    lockstep = bool(spec.get("lockstep"))

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if lockstep and not sys.stdin.readline():  # the caller went away: stop
                raise SystemExit(0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            if lockstep:
                print(json.dumps({"step_seconds": times[-1]}), flush=True)

    n = int(spec["n_samples"])
    args = GRPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=int(spec["micro_batch_size"]),
        gradient_accumulation_steps=int(spec["prompts_per_step"]) * n // int(spec["micro_batch_size"]),
        num_generations=n, max_completion_length=int(spec["max_tokens"]),
        temperature=float(spec.get("temperature", 1.0)), top_p=1.0, learning_rate=float(spec.get("lr", 1e-5)), beta=0.0, num_iterations=1, max_steps=int(spec["steps"]), logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, bf16=spec["dtype"] == "bfloat16",
        shuffle_dataset=False, seed=0, disable_dropout=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, args=args, train_dataset=data,
                          callbacks=[StepTimer()])
    trainer.train()
    print(json.dumps({"step_seconds": times, "trl": trl.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
