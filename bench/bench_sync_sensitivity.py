"""How strongly each weight-sync check reads one stale decoder layer, in plain torch (any dtype,
bf16 included on a CPU without native bf16, where no vLLM bf16 engine runs).

A "trainer" model and an "engine" copy of SmolLM2-135M (or `bench.model=tiny`) in `bench.dtype`.
The engine copy holds the trainer's weights except one decoder layer (`bench.layer`), which the
trainer has moved by `rel` times each tensor's spread (`bench.stale`, comma-separated; 0 = a
correct sync). The engine computes differently from the trainer, as a vLLM engine does: eager
attention instead of SDPA, and its sampling log-probs come from KV-cached decoding while the
trainer scores the whole sequence in one forward. Per staleness, the two statistics the weight
sync checks read (dsrl.rollout.weight_sync):
- probe: the mean |trainer - engine| log-prob over the greedy probe's tokens (the trainer's
  greedy continuation of the fixed random prefixes, `trainer_greedy_probe`; the engine scores the
  same sequences in one forward);
- samples: the train step's check (`check_samples`) on the default job's batch: 8 arith prompts in
  the chat template, 8 samples each at temperature 1, up to 16 tokens, sampled by the engine, the
  mean |trainer - engine| log-prob over the sampled tokens;
against `default_tolerance(dtype)`. The floor (stale 0) here is what the two implementations'
rounding gives, not vLLM's.

    .venv/bin/python bench/bench_sync_sensitivity.py [bench.model=smollm2 bench.dtype=bfloat16
        bench.stale=0,0.01,0.05,0.2 bench.layer=15 bench.seeds=1]
"""
from __future__ import annotations

import copy
import sys
import time
from types import SimpleNamespace

import torch

SAMPLES, MAX_TOKENS = 8, 16


@torch.no_grad()
def engine_samples(engine, prompt, eos: set, seed: int):
    """SAMPLES completions of `prompt` at temperature 1 by KV-cached decoding (a batch of the
    same prompt); each token's log-prob is the engine's log_softmax at the step that drew it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * SAMPLES)
    out = engine(input_ids=ids, use_cache=True)
    tokens, logps, done = [[] for _ in range(SAMPLES)], [[] for _ in range(SAMPLES)], [False] * SAMPLES
    for _ in range(MAX_TOKENS):
        lp = torch.log_softmax(out.logits[:, -1].float(), -1)
        nxt = torch.multinomial(lp.exp(), 1, generator=g)
        for k in range(SAMPLES):
            if not done[k]:
                t = int(nxt[k, 0])
                tokens[k].append(t)
                logps[k].append(float(lp[k, t]))
                done[k] = t in eos
        if all(done):
            break
        out = engine(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return tokens, logps


def sample_check(trainer_actor, engine, prompts, eos, seed: int) -> tuple:
    """Sum of |trainer - engine| log-prob over the engine's sampled tokens, and their count."""
    from dsrl.rollout.weight_sync import trainer_probe_logprobs

    total, count = 0.0, 0
    for i, prompt in enumerate(prompts):
        tokens, logps = engine_samples(engine, prompt, eos, seed * 1000 + i)
        for toks, lps in zip(tokens, logps):
            mine = trainer_probe_logprobs(trainer_actor, [list(prompt) + toks])[0, len(prompt) - 1:]
            total += float((mine - torch.tensor(lps)).abs().sum())
            count += len(toks)
    return total, count


def measure(model_path: str, dtype: str, stales, layer: int, seed: int) -> list:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrl.rollout.weight_sync import PROBE_PREFIX, probe_tokens, trainer_greedy_probe, trainer_probe_logprobs
    from dsrl.testing import default_job_prompts, perturb_weights

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, attn_implementation="sdpa").eval()
    layers = base.config.num_hidden_layers
    layer = min(layer, layers - 1)
    perturb_weights(base.parameters(), 0.01, seed)  # a trained policy: the state the engine was last synced to
    stale_engine = copy.deepcopy(base)
    stale_engine.set_attn_implementation("eager")
    prompts = default_job_prompts(tok)
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    prefixes = [p[:PROBE_PREFIX] for p in probe_tokens(base.config.vocab_size)]
    rows = []
    for rel in stales:
        trainer = copy.deepcopy(base)  # the trainer moved one layer since; the engine did not get it
        perturb_weights(trainer.model.layers[layer].parameters(), rel, seed + 1)
        actor = SimpleNamespace(module=trainer, engine=trainer, hf_config=trainer.config)
        t0 = time.perf_counter()
        seqs = trainer_greedy_probe(actor, prefixes)
        mine = trainer_probe_logprobs(actor, seqs)[:, PROBE_PREFIX - 1:]
        with torch.no_grad():
            ids = torch.tensor(seqs)
            lp = torch.log_softmax(stale_engine(input_ids=ids).logits[:, :-1].float(), -1)
        engine_lp = lp.gather(-1, ids[:, 1:, None])[..., 0][:, PROBE_PREFIX - 1:]
        probe = float((engine_lp - mine).abs().mean())
        total, count = sample_check(actor, stale_engine, prompts, eos, seed)
        rows.append({"stale": rel, "probe": probe, "samples": total / max(count, 1), "tokens": count,
                     "probe_tokens": int(mine.numel()), "seconds": time.perf_counter() - t0})
        del trainer, actor
    return rows


def main(argv) -> int:
    from dsrl.setup_assets import smollm2_path
    from dsrl.testing import ensure_tiny_model
    from dsrl.rollout.weight_sync import default_tolerance

    from bench_sync import parse_options

    opts = parse_options(argv, {"bench.model": "smollm2", "bench.dtype": "bfloat16", "bench.stale": "0,0.01,0.05,0.2",
                                "bench.layer": "15", "bench.seeds": "1"})
    model = str(smollm2_path() if opts["bench.model"] == "smollm2" else ensure_tiny_model())
    dtype = opts["bench.dtype"]
    tol = default_tolerance(dtype)
    stales = [float(x) for x in opts["bench.stale"].split(",")]
    print(f"model {model}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads; stale layer "
          f"{opts['bench.layer']}; tolerance {tol:g}")
    for s in range(int(opts["bench.seeds"])):
        for r in measure(model, dtype, stales, int(opts["bench.layer"]), 1 + 10 * s):
            verdict = lambda x: "caught" if x > tol else "passes"  # noqa: E731
            print(f"seed {s} stale {r['stale']:g}: probe {r['probe']:.4f} ({verdict(r['probe'])}, "
                  f"{r['probe_tokens']} tokens); samples {r['samples']:.4f} ({verdict(r['samples'])}, "
                  f"{r['tokens']} tokens); samples/probe {r['samples'] / max(r['probe'], 1e-12):.2f}  "
                  f"[{r['seconds']:.1f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
