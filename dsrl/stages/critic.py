"""The critic update (algo.advantage_estimator=gae): the value model's values at each response
token (GAE's V and the value loss's V_old) and its optimizer step, in its own engine."""
from __future__ import annotations

from typing import List

from dsrl.actor.batch import Sample, masked_rows, pad_to_largest_rank
from dsrl.actor.nonfinite import SkipCounter
from dsrl.distributed.collectives import all_reduce_sum
from dsrl.loss.types import Reduction
from dsrl.rollout.samples import pack_microbatches
from dsrl.tracking import microbatch_bar

# The critic's own per-token inputs to its value loss (dsrl.loss.value).
CRITIC_FIELDS = ("returns", "old_values")


class CriticUpdate:
    def __init__(self, cfg, critic, *, pad_id: int, algo: dict, skips: SkipCounter):
        self.cfg, self.critic, self.pad_id, self.algo, self.skips = cfg, critic, pad_id, algo, skips
        self.micro_batch_size = cfg.critic.micro_batch_size or cfg.actor.micro_batch_size

    def values(self, samples: List[Sample]) -> list:
        """The critic's value at each response token, one 1-D tensor per sample (dense layout, in
        order)."""
        mbs = pack_microbatches(samples, self.micro_batch_size, self.pad_id)
        with microbatch_bar(len(mbs), "critic forward", enabled=self.cfg.logger.progress) as bar:
            values = self.critic.values(mbs, progress=bar)
        out = []
        for mb, v in zip(mbs, values):  # one value per response token (0 off the loss mask)
            out.extend(masked_rows(v, mb.get("response_mask", mb["loss_mask"])))
        return out

    def step(self, samples: List[Sample], fields: dict, *, step: int) -> dict:
        """One critic optimizer step on `samples` (returns, old_values per token), normalized by
        the step's global counts like the policy loss (algo.loss_agg_mode); every rank runs the
        same number of microbatches. A non-finite step is skipped and counted (critic/skipped_steps);
        trainer.max_skipped_steps in a row stop the run (TrainingDiverged)."""
        a = self.cfg.algo
        tokens, seqs = all_reduce_sum([sum(len(s.response_ids) for s in samples), len(samples)])
        mbs = pack_microbatches(samples, self.micro_batch_size, self.pad_id, fields) if samples else []
        mbs = pad_to_largest_rank(mbs, self.pad_id, CRITIC_FIELDS)
        reduction = Reduction(a.loss_agg_mode, global_tokens=tokens, global_seqs=seqs,
                              norm_len=float(self.cfg.rollout.max_new_tokens))
        metrics = self.critic.train_step(mbs, self.algo, reduction, loss=self.cfg.critic.loss)
        self.skips.record(self.critic.last_step_skipped, step)
        return metrics
