"""The policy update: one optimizer step of the actor on the step's trained samples. Packed once
in the actor's layout (the plan's microbatch count is the packing's), padded to the largest
rank's count, every microbatch forward/backward with its objective, the train step's check of
the last weight push (between probes), the guarded optimizer step, and the step's metrics."""
from __future__ import annotations

from typing import List, NamedTuple

import torch
import torch.distributed as dist

from dsrl.actor.batch import Sample, pad_to_largest_rank
from dsrl.actor.masks import model_tokens
from dsrl.actor.nonfinite import SkipCounter
from dsrl.actor.packing import padded_tokens
from dsrl.actor.shared_prompt import engine_uses_shared_prompt
from dsrl.distributed.collectives import all_reduce_, all_reduce_sum
from dsrl.distributed.ranks import global_rank
from dsrl.loss.options import objective_config
from dsrl.loss.registry import get_objective
from dsrl.loss.types import Reduction
from dsrl.registry import load_callable
from dsrl.rollout.samples import pack_microbatches
from dsrl.tracking import microbatch_bar

# Objective metrics that are global sums (not means over trained samples).
LOSS_METRICS = ("loss", "pg_loss", "loss:sum")
# A work unit's own objective: keys a hook may set on a microbatch (dsrl.loss.registry names).
WORK_UNIT_KEYS = ("loss_fn", "loss_fn_config")


class StepCounts(NamedTuple):
    """Global counts of one optimizer step (all ranks): the normalizers and what was trained."""
    tokens: float
    seqs: float
    trained_tokens: float
    trained_seqs: float
    microbatches: float


class PolicyUpdate:
    def __init__(self, cfg, actor, *, pad_id: int, algo: dict, decision, weight_sync, skips: SkipCounter):
        self.cfg, self.actor, self.pad_id, self.algo = cfg, actor, pad_id, algo
        self.decision, self.weight_sync, self.skips = decision, weight_sync, skips
        self.objective = get_objective(cfg.algo.policy_loss)
        self.objective_config = objective_config(self.objective, algo, cfg.algo.loss_fn_config)
        self.hooks = [load_callable(path, "trainer.before_train_step_hooks")
                      for path in cfg.trainer.before_train_step_hooks]

    def step(self, samples: List[Sample], token_fields: dict, *, all_samples: List[Sample], step: int) -> dict:
        """One optimizer step: every microbatch of `samples` forward/backward, then the step.
        `all_samples` (skipped ones included) define the global normalizers. Collective."""
        ac = self.cfg.actor
        mbs = pack_microbatches(samples, ac.micro_batch_size, self.pad_id, token_fields,
                                max_tokens=ac.max_tokens_per_microbatch,
                                shared_prompt=engine_uses_shared_prompt(self.cfg, self.actor)) if samples else []
        tokens, seqs, trained_tokens, trained_seqs, n_mb = all_reduce_sum(
            [sum(model_tokens(s) for s in all_samples), len(all_samples),  # token-mean counts model tokens only
             sum(model_tokens(s) for s in samples), len(samples), len(mbs)])
        counts = StepCounts(tokens, seqs, trained_tokens, trained_seqs, n_mb)
        sums = self._forward_backward(pad_to_largest_rank(mbs, self.pad_id, ["rollout_log_probs", *token_fields]),
                                      counts)
        if self.weight_sync.checks_samples:  # the last push, between probes (rollout.sync_probe_every)
            self.weight_sync.check_samples(sums.get("rollout/abs_diff_sum", 0.0), sums.get("rollout/tokens", 0.0),
                                           step)
        grad_norm = self.actor.optimizer_step()
        # Non-finite loss/gradient: the actor skipped the step; TrainingDiverged after max_skipped_steps in a row.
        self.skips.record(self.actor.last_step_skipped, step)
        if self.cfg.trainer.check_rank_sync:
            self._assert_ranks_in_sync()
        return self._metrics(sums, counts, grad_norm)

    def _forward_backward(self, microbatches: List[dict], counts: StepCounts) -> dict:
        """Forward/backward every microbatch with its objective; returns summed metric partials
        (plus train/pad_fraction: padded / all token positions of the step's microbatches, all
        ranks, the empty rank-padding microbatches left out; carried by rank 0 only, as the
        partials are summed over ranks). The microbatches are read, never changed: hooks run on
        them first (they may name a work unit's objective), and each engine call gets its own dict."""
        a = self.cfg.algo
        real = [padded_tokens(mb) for mb in microbatches if mb.get("sample_indices") != [-1]]
        padded, total = all_reduce_sum([sum(p for p, _ in real), sum(t for _, t in real)])
        sums: dict = {"train/pad_fraction": padded / max(total, 1.0) if global_rank() == 0 else 0.0}
        with microbatch_bar(len(microbatches), "actor train", enabled=self.cfg.logger.progress) as bar:
            for i, mb in enumerate(microbatches):
                for hook in self.hooks:
                    hook(mb)
                spec, config = self._objective_for(mb)
                inputs = {k: v for k, v in mb.items() if k not in WORK_UNIT_KEYS}
                if "sampling_logprobs" in spec.required_inputs:  # Tinker's sampler log-probs q
                    inputs["sampling_logprobs"] = inputs["rollout_log_probs"]
                reduction = Reduction(spec.aggregation or a.loss_agg_mode, global_tokens=counts.tokens,
                                      global_seqs=counts.seqs, norm_len=float(self.cfg.rollout.max_new_tokens))
                out = self.actor.forward_backward(inputs, spec, config, reduction,
                                                  reuse_training_logprobs=self.decision.reuse,
                                                  is_last=i == len(microbatches) - 1)
                for n, v in out.metrics.items():
                    sums[n] = sums.get(n, 0.0) + float(v)
                bar.update(1)
        return sums

    def _objective_for(self, mb: dict):
        """A microbatch (work unit) may name its own objective and config (e.g. set by a hook);
        otherwise the run's configured objective applies."""
        name, overrides = mb.get("loss_fn"), mb.get("loss_fn_config")
        if name is None and overrides is None:
            return self.objective, self.objective_config
        spec = self.objective if name is None else get_objective(name)
        try:
            return spec, objective_config(spec, self.algo, overrides or {})
        except KeyError as e:
            raise ValueError(f"microbatch of samples {mb.get('sample_indices')}: {e.args[0]}") from None

    def _metrics(self, sums: dict, counts: StepCounts, grad_norm: float) -> dict:
        """Global metrics of one optimizer step. Objective metrics are means over the *trained*
        samples; when no sample was trained they were never measured and are left out (never a
        fabricated 0). The loss itself is the global loss (skipped samples contribute 0)."""
        a = self.cfg.algo
        names = sorted(sums)
        totals = dict(zip(names, all_reduce_sum([sums[n] for n in names])))
        diff_sum, diff_tokens = totals.pop("rollout/abs_diff_sum", 0.0), totals.pop("rollout/tokens", 0.0)
        out = {"train/grad_norm": grad_norm, "train/trained_fraction": counts.trained_tokens / max(counts.tokens, 1.0),
               "train/microbatches": counts.microbatches}
        # Skipped samples add exact zeros to the partial sums: rescale to the trained ones.
        if a.loss_agg_mode == "token-mean":
            scale = counts.tokens / max(counts.trained_tokens, 1.0)
        elif a.loss_agg_mode.startswith("seq-mean"):
            scale = counts.seqs / max(counts.trained_seqs, 1.0)
        else:
            scale = 1.0
        for n, v in totals.items():
            key = n if "/" in n else f"train/{n}"
            if n in LOSS_METRICS or "/" in n:
                out[key] = v
            elif counts.trained_tokens > 0:
                out[key] = v * scale
        # Weight-push check: trainer vs vLLM log-probs of the new samples (before this update).
        # Under top_p < 1 vLLM's log-probs are over the renormalized nucleus: not comparable.
        if diff_tokens > 0 and self.cfg.rollout.top_p == 1.0:
            out["rollout/logprob_diff"] = diff_sum / diff_tokens
        return out

    def _assert_ranks_in_sync(self) -> None:
        """Every rank must hold bit-identical full parameters after an optimizer step."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        with self.actor.full_parameters():
            digest = torch.stack([p.detach().double().sum() + p.detach().double().abs().sum()
                                  for p in self.actor.module.parameters()])
        lo, hi = digest.clone(), digest.clone()
        all_reduce_(lo, op=dist.ReduceOp.MIN)  # on the backend's device whatever the parameters' (offload)
        all_reduce_(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            bad = int((lo != hi).nonzero()[0].item())
            raise RuntimeError(f"ranks diverged after the optimizer step (parameter #{bad} differs)")
