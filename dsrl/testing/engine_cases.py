"""The engine cases every device check runs: each objective of the loss hub with the inputs it
reads, in each microbatch layout. The simulated accelerator's tests (tests/actor/
test_simulated_device.py, in CI) and the GPU smoke (tests/gpu/trainer_smoke.py, on CUDA) run
this one list, so what CI proves on the simulated device is what a GPU runs."""
from __future__ import annotations

from typing import List, Mapping, Tuple

import torch

from dsrl.actor.batch import Sample
from dsrl.loss.registry import ObjectiveSpec, get_objective
from dsrl.loss.types import Reduction

# name -> (objective, objective config (None: a Tinker loss, its defaults), reuse, aggregation)
CASES = {
    "grpo-reuse": ("ppo", {}, True, "token-mean"),
    "ppo-old-pass": ("ppo", {}, False, "token-mean"),
    "gspo": ("gspo", {}, False, "seq-mean-token-mean"),
    "cispo": ("cispo", {}, True, "seq-mean-token-sum-norm"),
    "sft": ("sft", {}, False, "token-mean"),
    "tis": ("ppo", {"use_tis": True}, True, "token-mean"),
    "kl-loss": ("ppo", {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"}, True, "token-mean"),
    "entropy": ("ppo", {"entropy_coef": 0.01}, True, "seq-mean-token-sum"),
    "tinker-ce": ("cross_entropy", None, False, "sum"),
    "tinker-is": ("importance_sampling", None, False, "sum"),
    "tinker-ppo": ("ppo", None, False, "sum"),
    "tinker-cispo": ("cispo", None, False, "sum"),
    "tinker-dro": ("dro", None, False, "sum"),
}
LAYOUTS = ("dense", "shared", "dense-budget", "shared-budget")
FIELDS = ("advantages", "old_log_probs", "ref_log_probs", "opd_reverse_kl", "loss_weights", "sampling_logprobs")


def samples(seed: int = 0, shape=((6, (4, 2, 5)), (4, (3, 6, 1)))) -> List[Sample]:
    """Groups of samples sharing a prompt: (prompt length, response lengths) per group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, (p, rs) in enumerate(shape):
        prompt = torch.randint(10, 1000, (p,), generator=g).tolist()
        for r in rs:
            out.append(Sample(prompt_ids=prompt, response_ids=torch.randint(10, 1000, (r,), generator=g).tolist(),
                              rollout_log_probs=(-torch.rand(r, generator=g)).tolist(), group=group,
                              index=len(out), reward=float(len(out) % 2)))
    return out


def fields(batch: List[Sample], seed: int = 1, *, old: bool = False) -> dict:
    """Per-token fields of every kind the objectives read; old_log_probs only with `old` (reuse
    refuses a batch that carries them)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in FIELDS if old else [f for f in FIELDS if f != "old_log_probs"]:
        rows = []
        for s in batch:
            r = len(s.response_ids)
            if name == "advantages":
                rows.append(torch.randn(r, generator=g))
            elif name == "loss_weights":
                rows.append((torch.rand(r, generator=g) > 0.3).float())
            elif name == "opd_reverse_kl":
                rows.append(torch.rand(r, generator=g))
            else:  # log-probs near the rollout's
                rows.append(torch.tensor(s.rollout_log_probs) + 0.05 * torch.randn(r, generator=g))
        out[name] = rows
    return out


def microbatches(layout: str, batch: List[Sample], token_fields: Mapping) -> list:
    """Host microbatches of `batch` in `layout` (LAYOUTS): dense or shared-prompt rows, three
    samples each, or token-budget bins (several microbatches)."""
    from dsrl.rollout.samples import pack_microbatches

    budget = 24 if layout.endswith("budget") else 0
    return pack_microbatches(batch, 3, 0, dict(token_fields), max_tokens=budget, shared_prompt=layout.startswith("shared"))


def case(name: str, batch: List[Sample]) -> Tuple[ObjectiveSpec, Mapping, bool, Reduction, dict]:
    """(objective, config, reuse, reduction, token fields) of case `name` on `batch`."""
    from dsrl.loss import tinker

    objective, config, reuse, mode = CASES[name]
    if config is None:
        spec, config = get_objective(tinker.tinker_objective_name(objective)), tinker.resolve_config(objective, {})
    else:
        spec = get_objective(objective)
    reduction = Reduction(mode, global_tokens=float(sum(len(s.response_ids) for s in batch)),
                          global_seqs=float(len(batch)), norm_len=8.0)
    return spec, config, reuse, reduction, fields(batch, old=not reuse)


def run_case(engine, name: str, layout: str, batch: List[Sample]) -> list:
    """Every microbatch of case `name` through `engine.forward_backward` (the last one closes the
    accumulation window); returns the LossOutputs."""
    spec, config, reuse, reduction, token_fields = case(name, batch)
    mbs = microbatches(layout, batch, token_fields)
    return [engine.forward_backward(mb, spec, config, reduction, reuse_training_logprobs=reuse,
                                    is_last=i == len(mbs) - 1) for i, mb in enumerate(mbs)]
