"""Before/after figures of the reasoning_gym preset on its held-out questions, for one or more model
folders (e.g. the base model and a run's final_model):

    python bench/eval_reasoning_gym.py smollm2 outputs/<run>/final_model [--num 240] [overrides ...]

For each model, one vLLM engine (the preset's dtype and context) answers the preset's first --num
held-out questions (data.num_eval's set, shared over the tasks) greedily with the preset's token limit,
and prints per task:
  strict    the trained and reported measure: the task's own scorer on the <answer> tag or the whole
            completion, partial credit counted 0 (the run's eval/accuracy[task]);
  lenient   the same scorer with its partial credit;
  correct   the arithmetic alone, whatever the wording: the first number of the completion after an
            echoed "a - b =" equals the answer (the `arith` verifier), e.g. "The answer is 6." counts;
  bare      the share of completions that are the answer alone (a number, nothing else);
  tokens    mean completion length.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

_BARE = re.compile(r"^\s*-?\d+\s*$")


def _config(overrides):
    from eval_kit import preset_config

    return preset_config("reasoning_gym", overrides)


def evaluate_model(path: str, cfg, num: int) -> dict:
    from vllm import SamplingParams

    from dsrl.reward.registry import get_verifier, strict
    from dsrl.reward.verifiers import arith_exact
    from eval_kit import engine_and_prompts

    llm, prompts, ids = engine_and_prompts(path, cfg, num)
    outs = llm.generate(ids, SamplingParams(n=1, temperature=0.0, max_tokens=cfg.rollout.max_new_tokens),
                        use_tqdm=False)
    lenient = get_verifier("reasoning_gym")
    exact = strict(lenient)
    table: dict = {}
    for o, p in zip(outs, prompts):
        c = o.outputs[0]
        row = table.setdefault(p.meta["task"], {"n": 0, "strict": 0.0, "lenient": 0.0, "correct": 0.0,
                                                "bare": 0.0, "tokens": 0.0})
        row["n"] += 1
        row["strict"] += exact(c.text, p)
        row["lenient"] += lenient(c.text, p)
        row["correct"] += arith_exact(c.text, p)
        row["bare"] += bool(_BARE.match(c.text))
        row["tokens"] += len(c.token_ids)
    return {t: {k: (v if k == "n" else v / row["n"]) for k, v in row.items()} for t, row in table.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="model folders (or smollm2); then Hydra overrides as key=value")
    ap.add_argument("--num", type=int, default=240, help="held-out questions (at most the preset's data.num_eval)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    models = [m for m in args.models if "=" not in m]
    overrides = [m for m in args.models if "=" in m]
    if args.one is not None:
        print("RESULT " + json.dumps(evaluate_model(args.one, _config(overrides), args.num)), flush=True)
        return 0
    from eval_kit import result_of_model

    for m in models:  # one process per model: a vLLM engine per process, freed on exit
        for task, v in (result_of_model(__file__, m, ["--num", str(args.num), m, *overrides]) or {}).items():
            print(f"{m} | {task:16s} | n {v['n']} | strict {v['strict']:.3f} | lenient {v['lenient']:.3f} | "
                  f"correct {v['correct']:.3f} | bare {v['bare']:.3f} | tokens {v['tokens']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
