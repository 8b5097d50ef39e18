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
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")


def _config(overrides):
    from hydra import compose, initialize_config_dir

    from dsrl.config.schema import register_configs, to_config
    from dsrl.main import _resolve_hardware

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(ROOT, "conf")), version_base=None):
        node = compose(config_name="config", overrides=["+exp=gsm8k_reasoning", *overrides])
    cfg = to_config(node)
    _resolve_hardware(cfg, node)
    return cfg


def evaluate_model(path: str, cfg, num: int, samples: int) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from dsrl.data.chat import apply_chat_template
    from dsrl.data.registry import build_source
    from dsrl.reward.verifiers import gsm8k_format, gsm8k_last_number, states_final_answer
    from dsrl.rollout.vllm_engine import engine_env
    from dsrl.setup_assets import default_cache_dir, resolve_model_path

    os.environ.update(engine_env(cfg.rollout.kv_cache_gib, 0, 1, multiprocess=True))  # vllm.LLM here, its core apart
    path = resolve_model_path(path, str(default_cache_dir()))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = build_source(cfg.data).eval_set(num)
    ids = [{"prompt_token_ids": apply_chat_template(tok, p, cfg.data.system_prompt, cfg.data.chat_template)}
           for p in prompts]
    llm = LLM(model=path, tokenizer=path, dtype=cfg.rollout.dtype, max_model_len=cfg.rollout.max_model_len,
              enforce_eager=True, seed=cfg.rollout.seed)
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
    import subprocess

    for m in args.models:  # one process per model: a vLLM engine per process, freed on exit
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", m, "--num", str(args.num),
                            "--samples", str(args.samples), m], capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            print(f"{m}: failed (rc {r.returncode}): {(r.stderr or '').strip().splitlines()[-3:]}", flush=True)
            continue
        for mode, v in json.loads(lines[-1][len("RESULT "):]).items():
            print(f"{m} | {mode:10s} | n {v['n']} | accuracy {v['accuracy']:.3f} | ends 'answer is N' "
                  f"{v['states_answer']:.3f} | stopped {v['stopped']:.3f} | gsm8k_format reward "
                  f"{v['reward_gsm8k_format']:.4f} | mean tokens {v['mean_tokens']:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
