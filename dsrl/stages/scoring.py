"""The scoring passes of one step and its advantages: the forward-only passes that are needed (the
old policy unless reused; algo.reuse_logprobs=adaptive's probe; reference; teacher; gae: the
critic's values), then the advantages (the detach boundary first). A skipped pass reports exactly
0.0 s in its timing phase."""
from __future__ import annotations

import dataclasses
import logging
from typing import List, NamedTuple

import torch

from dsrl.actor.batch import Sample, masked_rows
from dsrl.actor.masks import response_loss_mask
from dsrl.actor.reuse_probe import judge, max_mismatch, mismatch_sums, missing_rollout_log_probs, probe_indices
from dsrl.actor.shared_prompt import engine_uses_shared_prompt
from dsrl.agent.episodes import episode_numbers
from dsrl.distributed.collectives import all_reduce_sum
from dsrl.distributed.ranks import global_rank, is_main_rank
from dsrl.loss.advantages import compute_advantages
from dsrl.loss.skip import zero_advantage_skip
from dsrl.rollout.samples import pack_microbatches
from dsrl.tracking import microbatch_bar
from dsrl.validation.reuse import check_reuse_invariants

log = logging.getLogger("dsrl")
# Per-token fixed inputs carried from the scoring passes / advantages into the microbatches.
TOKEN_FIELDS = ("old_log_probs", "ref_log_probs", "advantages", "opd_reverse_kl")


class Scored(NamedTuple):
    """One step's scored data: `data` (rewards, masks, log-probs of every pass that ran, the
    advantages; gae: values and returns), the per-token fields the objective reads
    (`token_fields`, aligned with the samples), the indices of the samples that go through the
    training forward (`trained`), and the adaptive probe's metrics (`reuse_metrics`)."""
    data: dict
    token_fields: dict
    trained: List[int]
    reuse_metrics: dict


class ScoringPasses:
    def __init__(self, cfg, *, actor, ref, teacher, critic_update, decision, pad_id: int, algo: dict,
                 steps_per_rollout: int, timer):
        self.cfg, self.actor, self.ref, self.teacher = cfg, actor, ref, teacher
        self.critic_update, self.decision, self.pad_id, self.algo = critic_update, decision, pad_id, algo
        self.steps_per_rollout, self.timer = steps_per_rollout, timer
        self.skip_zero_advantage, self.skip_reason = zero_advantage_skip(cfg)

    def run(self, samples: List[Sample], *, step: int) -> Scored:
        data = {"rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
                "loss_mask": [response_loss_mask(s) for s in samples],  # model tokens (episodes: env tokens 0)
                "group_ids": torch.tensor([s.group for s in samples]),
                # the agent endpoint's episodes (one may train as several samples): statistics per episode
                **({"episode_ids": episode_numbers(samples)} if any("episode" in s.extra for s in samples) else {}),
                "rollout_log_probs": [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]}
        # Reuse is only exact for one optimizer step on rollout data without actor log-probs:
        # checked before any old, reference or teacher pass runs.
        check_reuse_invariants(self.decision, steps_per_rollout=self.steps_per_rollout, batch_keys=data.keys())

        reuse_metrics: dict = {}
        if self.decision.probe:  # adaptive: rollout log-probs as the old policy unless the probe objects
            with self.timer.phase("old_logprobs"):
                data["old_log_probs"], reuse_metrics = self._old_policy_by_probe(samples, data["rollout_log_probs"],
                                                                                 step)
        elif self.decision.run_old_pass:
            with self.timer.phase("old_logprobs"):
                data["old_log_probs"] = self.score(self.actor, samples, "actor forward")
        if self.cfg.algo.reuse_logprobs == "adaptive" and not reuse_metrics:
            reuse_metrics = {"reuse/full_pass": float(self.decision.run_old_pass)}
        if self.ref is not None:
            with self.timer.phase("ref_logprobs"):
                data["ref_log_probs"] = self.score(self.ref, samples, "ref forward")
        if self.teacher is not None:
            with self.timer.phase("teacher_logprobs"):
                data["teacher_log_probs"] = self.score(self.teacher, samples, "teacher forward")
        if self.critic_update is not None:  # gae: V before either model trains (never skipped, whatever the reuse)
            with self.timer.phase("critic_values"):
                data["values"] = self.critic_update.values(samples)

        compute_advantages(data, self.algo)  # detach boundary first, then the estimator (gae: returns = A + V)
        token_fields = {k: list(data[k]) for k in TOKEN_FIELDS if k in data}
        return Scored(data, token_fields, self._trained_samples(data["advantages"]), reuse_metrics)

    def _old_policy_by_probe(self, samples: List[Sample], rollout_log_probs: list, step: int) -> tuple:
        """algo.reuse_logprobs=adaptive: re-score a reproducible sample of the sequences (all ranks
        decide together: the mismatch is all-reduced), then either the rollout log-probs (copies)
        or, when the probe objects, the full old-policy pass. Returns (old_log_probs, metrics)."""
        a = self.cfg.algo
        say = log.info if is_main_rank() else log.debug
        missing = missing_rollout_log_probs([len(s.response_ids) for s in samples], rollout_log_probs)
        idx = probe_indices(len(samples), a.reuse_probe_fraction, seed=self.cfg.data.seed, step=step, rank=global_rank())
        scored = self.score(self.actor, [samples[i] for i in idx], "reuse probe") if idx else []
        sums = mismatch_sums(scored, [rollout_log_probs[i] for i in idx]) if missing is None else [0.0, 0.0, 0.0]
        # A rank without usable rollout log-probs forces the full pass on every rank (NaN never passes).
        total = all_reduce_sum([*sums, float(missing is not None)])
        verdict = judge(total[:3], max_mismatch(self.cfg))
        if total[3] > 0:
            verdict = dataclasses.replace(verdict, full_pass=True, reason=(
                "reuse_logprobs=adaptive: rollout log-probs missing or not covering the response"
                + (f" (sample {missing} on rank {global_rank()})" if missing is not None else " on another rank")
                + ": full old-policy pass this step"))
        (say if verdict.full_pass else log.debug)("step %d: %s", step, verdict.reason)
        if verdict.full_pass:
            return self.score(self.actor, samples, "actor forward"), verdict.metrics()
        return [lp.clone() for lp in rollout_log_probs], verdict.metrics()

    def _trained_samples(self, advantages: list) -> List[int]:
        """Indices of the samples that go through the training forward: all of them, unless
        skipping all-zero-advantage samples is exact for this objective (see dsrl.loss.skip);
        skipped samples stay in the aggregation denominators."""
        keep = list(range(len(advantages)))
        if self.skip_zero_advantage:
            keep = [i for i in keep if bool(advantages[i].abs().sum() > 0)]
        return keep

    def score(self, engine, samples: List[Sample], desc: str) -> list:
        """Forward-only log-probs of each sample's response tokens, in the engine's layout
        (shared-prompt where exact for that engine: the training forward uses the same one)."""
        mbs = pack_microbatches(samples, self.cfg.actor.forward_micro_batch_size, self.pad_id,
                                shared_prompt=engine_uses_shared_prompt(self.cfg, engine))
        with microbatch_bar(len(mbs), desc, enabled=self.cfg.logger.progress) as bar:
            scored = engine.score(mbs, progress=bar)
        out = []
        for mb, lp in zip(mbs, scored):
            out.extend(masked_rows(lp, mb["response_mask"]))  # one value per response token (env ones 0)
        return out
