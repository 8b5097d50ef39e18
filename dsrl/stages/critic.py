"""The critic update (algo.advantage_estimator=gae): the value model's values at each response
token (GAE's V and the value loss's V_old) and its optimizer step, in its own engine.

The critic packs its microbatches as the actor does (dsrl.stages.policy): shared-prompt rows
where exact for the critic's model (critic.shared_prompt, null = actor.shared_prompt; decided by
dsrl.actor.shared_prompt.engine_uses_shared_prompt) and token-budget bins
(critic.max_tokens_per_microbatch, null = actor.max_tokens_per_microbatch), in both the values
pass and the train step."""
from __future__ import annotations

from typing import List

from dsrl.actor.batch import Sample, masked_rows, pad_to_largest_rank
from dsrl.actor.nonfinite import SkipCounter
from dsrl.actor.packing import plan_microbatches
from dsrl.actor.shared_prompt import engine_uses_shared_prompt
from dsrl.distributed.collectives import all_reduce_sum
from dsrl.loss.types import Reduction
from dsrl.rollout.samples import collate_plan
from dsrl.tracking import microbatch_bar

# The critic's own per-token inputs to its value loss (dsrl.loss.value).
CRITIC_FIELDS = ("returns", "old_values")


class CriticUpdate:
    def __init__(self, cfg, critic, *, pad_id: int, algo: dict, skips: SkipCounter):
        self.cfg, self.critic, self.pad_id, self.algo, self.skips = cfg, critic, pad_id, algo, skips
        c, a = cfg.critic, cfg.actor
        self.micro_batch_size = c.micro_batch_size or a.micro_batch_size
        self.max_tokens = a.max_tokens_per_microbatch if c.max_tokens_per_microbatch is None \
            else c.max_tokens_per_microbatch

    def pack(self, samples: List[Sample], fields: dict | None = None):
        """(plan, microbatches) of `samples` in the critic's layout: plan[k] lists the indices
        into `samples` of microbatch k's rows, in row order (a token budget reorders them)."""
        shared = engine_uses_shared_prompt(self.cfg, self.critic)
        plan = plan_microbatches(samples, micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens,
                                 shared_prompt=shared)
        return plan, collate_plan(samples, plan, self.pad_id, fields, shared_prompt=shared)

    def values(self, samples: List[Sample]) -> list:
        """The critic's value at each response token, one 1-D tensor per sample, in the order of
        `samples` whatever the layout (0 off the loss mask)."""
        plan, mbs = self.pack(samples)
        with microbatch_bar(len(mbs), "critic forward", enabled=self.cfg.logger.progress) as bar:
            values = self.critic.values(mbs, progress=bar)
        out: list = [None] * len(samples)
        for idx, mb, v in zip(plan, mbs, values):  # one value per response token
            for i, row in zip(idx, masked_rows(v, mb.get("response_mask", mb["loss_mask"])), strict=True):
                out[i] = row
        return out

    def step(self, samples: List[Sample], fields: dict, *, step: int) -> dict:
        """One critic optimizer step on `samples` (returns, old_values per token, aligned with
        `samples`), normalized by the step's global counts like the policy loss
        (algo.loss_agg_mode); every rank runs the same number of microbatches. A non-finite step
        is skipped and counted (critic/skipped_steps); trainer.max_skipped_steps in a row stop
        the run (TrainingDiverged)."""
        a = self.cfg.algo
        tokens, seqs = all_reduce_sum([sum(len(s.response_ids) for s in samples), len(samples)])
        mbs = self.pack(samples, fields)[1] if samples else []
        mbs = pad_to_largest_rank(mbs, self.pad_id, CRITIC_FIELDS)
        reduction = Reduction(a.loss_agg_mode, global_tokens=tokens, global_seqs=seqs,
                              norm_len=float(self.cfg.rollout.max_new_tokens))
        metrics = self.critic.train_step(mbs, self.algo, reduction, loss=self.cfg.critic.loss)
        self.skips.record(self.critic.last_step_skipped, step)
        return metrics
