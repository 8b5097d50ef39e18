"""Run a few multi-turn episodes with a real model on the real vLLM worker and print what
happened: reward, turns, tool calls, finish reasons, and some transcripts.

    python -m dsrl.agent.demo --env calculator --episodes 32           # SmolLM2, 2-digit sums, calculator tool
    python -m dsrl.agent.demo --env guess_the_number --episodes 16 --max-turns 6

Uses the converted SmolLM2 folder from `make setup` unless --model is given."""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="HF folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--env", default="calculator", help="registered environment or dotted path")
    p.add_argument("--env-kwargs", default="{}", help="JSON kwargs for the environment")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--digits", type=int, default=2, help="calculator: operand digits of the arith questions")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-turn-tokens", type=int, default=48)
    p.add_argument("--max-episode-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=3, help="transcripts to print")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from dsrl.agent.environments import make_env
    from dsrl.agent.episodes import episode_metrics, run_episodes
    from dsrl.rollout.seeds import request_seeds
    from dsrl.rollout.vllm_worker import VLLMWorker
    from dsrl.setup_assets import default_cache_dir, smollm2_path

    model = args.model or str(smollm2_path(default_cache_dir()))
    tok = AutoTokenizer.from_pretrained(model)
    kwargs = json.loads(args.env_kwargs)
    envs = [make_env(args.env, kwargs) for _ in range(args.episodes)]
    prompts = None
    if args.env in ("calculator", "dsrl.agent.envs.calculator.CalculatorEnv"):
        import random

        from dsrl.data.arith import ArithSource

        prompts = ArithSource(digits=args.digits).sample_train(args.episodes, random.Random(args.seed))
    t0 = time.perf_counter()
    worker = VLLMWorker(model, dtype=args.dtype, seed=args.seed, max_model_len=1024, kv_cache_gib=1)
    start = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        trajs = run_episodes(worker, tok, envs, prompts, max_turns=args.max_turns,
                             max_episode_tokens=args.max_episode_tokens, max_turn_tokens=args.max_turn_tokens,
                             temperature=args.temperature, seeds=request_seeds(args.seed, 0, 0, args.episodes),
                             max_context=1024)
        seconds = time.perf_counter() - t0
    finally:
        worker.close()
    m = episode_metrics(trajs)
    m.update({"episodes": len(trajs), "engine_start_s": round(start, 1), "episodes_s": round(seconds, 1),
              "with_tool_call": sum(any(i.get("tool_calls", 0) for i in t.infos) for t in trajs),
              "correct": sum(i.get("correct", 0.0) for t in trajs for i in t.infos),
              "wins": sum(t.reward > 0 for t in trajs)})
    # turns the engine ended with a stop token: that token is in the sampled ids (the renderer relies on it)
    stops = [(t, b) for t in trajs for (a, b), f in zip(t.turn_spans, t.turn_finish) if f == "stop"]
    m["stop_turns"] = len(stops)
    m["stop_turns_ending_in_eos"] = sum(b > 0 and t.response_ids[b - 1] == tok.eos_token_id for t, b in stops)
    for t in trajs[: args.show]:
        print("-" * 60)
        print(f"reward={t.reward} turns={t.turns} finish={t.finish_reason} model_tokens={t.model_tokens} "
              f"env_tokens={len(t.response_ids) - t.model_tokens}")
        for msg in t.messages[1:]:
            print(f"  [{msg['role']}] {msg['content'][:300]!r}")
    print("-" * 60)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in m.items()}, indent=1))
    return m


if __name__ == "__main__":
    main()
