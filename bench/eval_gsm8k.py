"""Before/after figures of the gsm8k_reasoning preset on held-out GSM8K test problems, for one or
more model folders (e.g. the base model and a run's final_model):

    python bench/eval_gsm8k.py smollm2 outputs/<date>/<time>-gsm8k_reasoning/final_model [--num 100 --samples 4]

For each model, one vLLM engine (the preset's dtype, context and system prompt) answers the first
--num test problems greedily and --samples times at the preset's temperature, 256 new tokens, and
prints per mode: accuracy (the `gsm8k` verifier: last number = reference), the share of completions
that end with "The answer is N" (dsrl.reward.verifiers.states_final_answer), the share that stopped
before the token limit, the mean trained reward (`gsm8k_format`), and the mean length in tokens.
"""
from __future__ import annotations

import argparse
import json
import sys


def _config(overrides):
    from eval_kit import preset_config

    return preset_config("gsm8k_reasoning", overrides)


def evaluate_model(path: str, cfg, num: int, samples: int) -> dict:
    from vllm import SamplingParams

    from dsrl.reward.verifiers import gsm8k_format, gsm8k_last_number, states_final_answer
    from eval_kit import engine_and_prompts

    llm, prompts, ids = engine_and_prompts(path, cfg, num)
    out = {}
    for mode, params in (("greedy", SamplingParams(n=1, temperature=0.0, max_tokens=cfg.rollout.max_new_tokens)),
                         (f"T={cfg.rollout.temperature} x{samples}",
                          SamplingParams(n=samples, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                         max_tokens=cfg.rollout.max_new_tokens))):
        rows = [(c, p) for o, p in zip(llm.generate(ids, params, use_tqdm=False), prompts) for c in o.outputs]
        n = len(rows)
        out[mode] = {"n": n,
                     "accuracy": sum(gsm8k_last_number(c.text, p) for c, p in rows) / n,
                     "states_answer": sum(states_final_answer(c.text) for c, _ in rows) / n,
                     "stopped": sum(c.finish_reason == "stop" for c, _ in rows) / n,
                     "reward_gsm8k_format": sum(gsm8k_format(c.text, p) for c, p in rows) / n,
                     "mean_tokens": sum(len(c.token_ids) for c, _ in rows) / n}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--num", type=int, default=100, help="test problems (the first N, as the trainer's eval)")
    ap.add_argument("--samples", type=int, default=4, help="samples per problem at the preset's temperature")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfg = _config([])
    if args.one is not None:
        print("RESULT " + json.dumps(evaluate_model(args.one, cfg, args.num, args.samples)), flush=True)
        return 0
    from eval_kit import result_of_model

    for m in args.models:  # one process per model: a vLLM engine per process, freed on exit
        result = result_of_model(__file__, m, ["--num", str(args.num), "--samples", str(args.samples), m])
        for mode, v in (result or {}).items():
            print(f"{m} | {mode:10s} | n {v['n']} | accuracy {v['accuracy']:.3f} | ends 'answer is N' "
                  f"{v['states_answer']:.3f} | stopped {v['stopped']:.3f} | gsm8k_format reward "
                  f"{v['reward_gsm8k_format']:.4f} | mean tokens {v['mean_tokens']:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
