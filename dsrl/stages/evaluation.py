"""Evaluation: greedy accuracy on the held-out prompts (split across ranks), overall and per
prompt split (e.g. held-out problems vs unseen phrasings)."""
from __future__ import annotations

from dsrl.distributed.collectives import all_reduce_sum
from dsrl.distributed.ranks import global_rank, is_main_rank, world_size


def evaluate(cfg, *, source, worker, verifier, prompt_ids_fn, memory) -> dict:
    """Collective: every rank generates for its share and the counts are summed."""
    prompts = source.eval_set(cfg.data.num_eval)
    splits = sorted({str(p.meta.get("split", "eval")) for p in prompts})
    mine = prompts[global_rank()::world_size()]
    ids = [prompt_ids_fn(p) for p in mine]
    with memory.for_rollout():
        groups = worker.generate(ids, n=1, temperature=0.0, top_p=1.0, max_tokens=cfg.rollout.max_new_tokens,
                                 show_progress=cfg.logger.progress and is_main_rank())
    counts = [0.0] * (2 * len(splits) + 2)
    for g, p in zip(groups, mine):
        ok = float(verifier(g[0].text, p))
        j = splits.index(str(p.meta.get("split", "eval")))
        counts[0] += ok
        counts[1] += 1
        counts[2 + 2 * j] += ok
        counts[3 + 2 * j] += 1
    totals = all_reduce_sum(counts)
    out = {"eval/accuracy": totals[0] / max(totals[1], 1), "eval/num_prompts": totals[1]}
    if len(splits) > 1:
        for j, name in enumerate(splits):
            out[f"eval/accuracy[{name}]"] = totals[2 + 2 * j] / max(totals[3 + 2 * j], 1)
    return out
