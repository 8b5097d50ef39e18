"""The RL loop. One step: rollout -> reward -> scoring passes that are needed (gae: the critic's
values) -> advantages -> train (objective from the loss registry; gae: the critic's step too) ->
weight push -> track. Reads top to bottom; the components are built in dsrl.main and handed in."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import time
from types import SimpleNamespace
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from dsrl.checkpoint import (config_record, load_rank_state, read_shared_state, restore_rng,
                             save_checkpoint)
from dsrl.actor.batch import Sample, empty_microbatch, masked_rows
from dsrl.agent.masks import model_tokens, response_loss_mask
from dsrl.agent.rollout import generate_episode_samples, mean_episode_metrics
from dsrl.actor.nonfinite import SkipCounter, TrainingDiverged
from dsrl.actor.reuse_probe import judge, max_mismatch, mismatch_sums, missing_rollout_log_probs, probe_indices
from dsrl.actor.packing import padded_tokens, plan_microbatches
from dsrl.actor.shared_prompt import engine_uses_shared_prompt
from dsrl.config.reuse import ReuseDecision, check_reuse_invariants, steps_per_rollout
from dsrl.config.schema import Config
from dsrl.data.registry import source_metrics
from dsrl.distributed.collectives import all_reduce_, all_reduce_max, all_reduce_sum  # NCCL-safe host statistics
from dsrl.distributed.ranks import global_rank, is_main_rank, world_size
from dsrl.loss.advantages import compute_advantages
from dsrl.loss.options import objective_config
from dsrl.loss.registry import get_objective
from dsrl.loss.skip import zero_advantage_skip
from dsrl.loss.types import Reduction
from dsrl.registry import load_callable
from dsrl.rollout.seeds import request_seeds
from dsrl.rollout.dynamic import Rollout, collect_rollout
from dsrl.rollout.faults import fault_metrics
from dsrl.rollout.memory import EngineMemory, sleep_mode_wanted
from dsrl.rollout.overlap import BackgroundRollout
from dsrl.rollout.rewards import RewardGuard
from dsrl.rollout.samples import generate_samples, pack_microbatches
from dsrl.rollout.weight_sync import WeightSync
from dsrl.tracking import MetricsLogger, PhaseTimer, microbatch_bar, plot_run

log = logging.getLogger("dsrl")
PHASES = ("rollout", "old_logprobs", "ref_logprobs", "teacher_logprobs", "critic_values", "critic_train", "train",
          "weight_sync")
# algo.advantage_estimator=gae: the critic's own per-token inputs to its value loss (dsrl.loss.value).
CRITIC_FIELDS = ("returns", "old_values")
# Per-token fixed inputs carried from the scoring passes / advantages into the microbatches.
TOKEN_FIELDS = ("old_log_probs", "ref_log_probs", "advantages", "opd_reverse_kl")
# Objective metrics that are global sums (not means over trained samples).
LOSS_METRICS = ("loss", "pg_loss", "loss:sum")


class RunStopped(Exception):
    """A signal asked the run to stop; the state after `step` is checkpointed in `checkpoint`."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        super().__init__(f"stopped by signal {signum} after step {step}; checkpoint: {checkpoint}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class StepCounts(NamedTuple):
    """Global counts of one optimizer step (all ranks): the normalizers and what was trained."""
    tokens: float
    seqs: float
    trained_tokens: float
    trained_seqs: float
    microbatches: float


class Trainer:
    def __init__(self, cfg: Config, *, actor, ref, worker, tokenizer, source, verifier, prompt_ids_fn,
                 decision: ReuseDecision, run_dir: str, teacher=None, critic=None, hardware_auto=()):
        self.cfg, self.actor, self.ref, self.teacher, self.worker = cfg, actor, ref, teacher, worker
        self.critic = critic  # gae's value model (dsrl.actor.critic.CriticEngine); None for every other estimator
        self.tokenizer, self.source, self.verifier, self.prompt_ids = tokenizer, source, verifier, prompt_ids_fn
        self.decision, self.run_dir = decision, run_dir
        self.hardware_auto = tuple(hardware_auto)  # keys dsrl.hardware resolved from `auto` (kept in checkpoints)
        # Raises/hangs: reward 0, counted; up to reward.concurrency calls in flight.
        self.verifier = RewardGuard.wrap(verifier, cfg.reward.timeout_s, cfg.reward.concurrency)
        self.skips = SkipCounter(cfg.trainer.max_skipped_steps)  # non-finite optimizer steps
        self.critic_skips = SkipCounter(cfg.trainer.max_skipped_steps)  # the critic's, counted apart
        self.algo = dataclasses.asdict(cfg.algo)
        self.objective = get_objective(cfg.algo.policy_loss)
        self.objective_config = objective_config(self.objective, self.algo, cfg.algo.loss_fn_config)
        self.skip_zero_advantage, self.skip_reason = zero_advantage_skip(cfg)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.logger = MetricsLogger.from_config(run_dir, cfg)  # jsonl + TensorBoard (+ W&B)
        self.timer = PhaseTimer(phases=PHASES)
        self.rng = random.Random(cfg.data.seed * 1000 + global_rank())
        # Divisibility by the world size is checked by dsrl.config.validate before anything loads.
        self.prompts_per_rank = cfg.algo.rollout_batch_size // world_size()
        self.hooks = [load_callable(path, "trainer.before_train_step_hooks")
                      for path in cfg.trainer.before_train_step_hooks]
        self.steps_per_rollout = steps_per_rollout(cfg)
        self.start_step = 0  # the last finished step (restore() sets it from a checkpoint)
        self.stop_signal: Optional[int] = None  # set by a signal handler: stop after this step
        self.next_rollout: BackgroundRollout[Rollout] = BackgroundRollout()  # algo.off_policy_steps=1
        self.weights_step = 0  # the step whose weights the rollout engine holds (0: the initial ones)
        # A colocated CUDA engine sleeps through the train phase (dsrl.rollout.memory); a no-op elsewhere.
        self.memory = EngineMemory(worker, sleep_mode_wanted(cfg))
        self.weight_sync = WeightSync(actor, worker, cfg.rollout, memory=self.memory)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg = self.cfg
        say = log.info if is_main_rank() else log.debug  # one copy of each line, from rank 0
        say(self.decision.reason)
        say(self.skip_reason)
        summary = {}
        if cfg.trainer.eval_before and self.start_step == 0:
            summary.update({f"{k}_before": v for k, v in self.evaluate().items()})
            say("greedy accuracy before training: %.3f", summary["eval/accuracy_before"])
        for step in range(self.start_step + 1, cfg.trainer.total_steps + 1):
            try:
                metrics = self.step(step)
            except TrainingDiverged:
                # Weights and optimizer are those of the last good step; the prompt stream and RNGs
                # have moved through this step, so the checkpoint is labelled with it.
                self.save(step)
                raise
            self.logger.log(step, metrics)
            say(self.logger.summary_line(step, metrics))
            if cfg.logger.plot and is_main_rank() and step % max(cfg.logger.plot_every, 1) == 0:
                plot_run(self.logger.history, os.path.join(self.run_dir, "plot.png"))
            saved = self.save(step) if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 else None
            if all_reduce_max(self.stop_signal or 0):  # a signal reached some rank: stop together
                raise RunStopped(int(all_reduce_max(self.stop_signal or 0)), step, saved or self.save(step))
        self.next_rollout.wait()  # no generation in flight beside the greedy eval (the last step starts none)
        if cfg.trainer.eval_after:
            summary.update({f"{k}_after": v for k, v in self.evaluate().items()})
            say("greedy accuracy after training: %.3f", summary["eval/accuracy_after"])
        rewards = [h.get("reward/mean", 0.0) for h in self.logger.history]
        if rewards:
            k = min(5, len(rewards))
            summary["reward/first5"] = sum(rewards[:k]) / k
            summary["reward/last5"] = sum(rewards[-k:]) / k
        if is_main_rank():
            if cfg.logger.plot:
                plot_run(self.logger.history, os.path.join(self.run_dir, "plot.png"))
            with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        if cfg.trainer.save_final:
            self.actor.save_hf(os.path.join(self.run_dir, "final_model"), tokenizer=self.tokenizer)
        self.logger.close()
        return summary

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        """Checkpoint the state after `step` (collective); returns its folder."""
        folder, seconds = save_checkpoint(
            self.run_dir, step, actor=self.actor, tokenizer=self.tokenizer, keep=self.cfg.trainer.keep_checkpoints,
            **({"critic": self.critic} if self.critic is not None else {}),  # gae: the critic's DeepSpeed state
            rank_state={"prompt_rng": self.rng.getstate(), "skips": self.skips.state_dict(),
                        "critic_skips": self.critic_skips.state_dict(), "next_rollout": self._next_rollout_state()},
            shared={"metrics": self.logger.history, "config": config_record(self.cfg),
                    "hardware_auto": list(self.hardware_auto)})
        if is_main_rank():
            log.info("checkpoint of step %d: %s (%.1f s)", step, folder, seconds)
        return folder

    def restore(self, folder: str) -> int:
        """Continue from a checkpoint: weights, optimizer, RNGs, prompt stream, metrics so far; the
        rollout engine gets the restored weights. Returns the checkpoint's step."""
        shared = read_shared_state(folder)
        self.actor.load_checkpoint(folder)
        if self.critic is not None:
            self.critic.load_checkpoint(folder)
        state = load_rank_state(folder)
        restore_rng(state["rng"])
        self.rng.setstate(state["trainer"]["prompt_rng"])
        self.skips.load_state_dict(state["trainer"]["skips"])
        if "critic_skips" in state["trainer"]:
            self.critic_skips.load_state_dict(state["trainer"]["critic_skips"])
        self._restore_next_rollout(state["trainer"].get("next_rollout"))
        self.logger.restore(shared["metrics"])
        self.start_step = int(shared["step"])
        self._push_weights(self.start_step)
        self.weights_step = self.start_step
        if is_main_rank():
            log.info("resumed from %s: continuing after step %d", folder, self.start_step)
        return self.start_step

    def step(self, step: int) -> dict:
        t_step = time.perf_counter()
        self.skips.step = step

        # 1-2. rollout + reward (this rank's share of the prompts). Under algo.off_policy_steps=1
        # it was generated during the previous step, and the next step's starts now, beside training.
        with self.timer.phase("rollout"), self.memory.for_rollout():
            rollout = self._collect_samples(step)
        if self.cfg.algo.off_policy_steps and step < self.cfg.trainer.total_steps:
            self._start_next_rollout(step + 1)

        # 3-5. scoring passes, advantages, optimizer step(s); a colocated CUDA engine sleeps meanwhile
        with self.memory.for_training():
            metrics = self.train_on(rollout.samples)

        # 6. weight push, verified on the next step's samples (under overlap rollout/logprob_diff
        # also holds one step of policy change); never while a generation is in flight (vLLM must
        # not load weights mid-generation): time spent waiting for it counts as rollout.
        with self.timer.phase("rollout"):
            self.next_rollout.wait()
        with self.timer.phase("weight_sync"):
            metrics.update(self._push_weights(step))
        self.weights_step = step

        # Rewards and lengths of every generated sample (dynamic sampling's dropped groups too).
        tot = all_reduce_sum([rollout.reward_sum, rollout.generated, rollout.length_sum])
        metrics.update(self.timer.pop())
        metrics.update(rollout.source_metrics)
        # rollout/restarts, reward/errors|timeouts: the rollout's (counted when it finished) + the push's
        counted = SimpleNamespace(pop_metrics=lambda: rollout.fault_counts)
        metrics.update(fault_metrics(counted, self.worker, self.verifier))
        metrics.update(self._rollout_metrics(step, rollout))
        metrics["train/skipped_steps"] = float(self.skips.total)
        metrics["reward/mean"] = tot[0] / max(tot[1], 1)
        metrics["rollout/response_length"] = tot[2] / max(tot[1], 1)
        metrics["timing/step"] = time.perf_counter() - t_step
        return metrics

    # ------------------------------------------------------------------ rollout and weight push
    def _collect_samples(self, step: int) -> Rollout:
        """This rank's scored rollout of `step`: the one generated in the background during the
        previous step (algo.off_policy_steps=1; or restored from a checkpoint), else generated now."""
        if self.next_rollout.holds(step):
            return self.next_rollout.take(step)
        return self._rollout(step, weights_step=self.weights_step,
                             show_progress=self.cfg.logger.progress and is_main_rank())

    def _start_next_rollout(self, step: int) -> None:
        """Generate `step`'s rollout in a background thread with the weights the engine holds now
        (one step stale by the time it is trained). The main thread draws no prompts, pushes no
        weights and runs no eval until it is joined (dsrl.rollout.overlap)."""
        self.next_rollout.start(step, functools.partial(self._rollout, step, weights_step=self.weights_step,
                                                        show_progress=False))  # no bar beside the train bar

    def _rollout(self, step: int, *, weights_step: int, show_progress: bool) -> Rollout:
        """Draw prompts, generate and score them (with dynamic sampling: in rounds, dsrl.rollout.dynamic).
        Collective-free and touching only the worker, verifier and prompt stream: it may run in the
        background thread. Request seeds are unique per (step, round, global prompt index)."""
        cfg, a = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        first_prompt = global_rank() * self.prompts_per_rank
        episodes: List[tuple] = []  # rollout.env: (episodes, agent metrics) of each round

        def generate_round(sampling_round: int, count: int) -> List[Sample]:
            prompts = self.source.sample_train(count, self.rng)
            if cfg.rollout.env:  # multi-turn episodes: the environment writes the prompts and gives the rewards
                r = cfg.rollout
                seeds = request_seeds(r.seed, step, first_prompt, len(prompts), sampling_round)
                samples, agent_metrics = generate_episode_samples(
                    self.worker, self.tokenizer, prompts, env=r.env, env_kwargs=r.env_kwargs,
                    n=a.n_samples_per_prompt, max_turns=r.max_turns, max_episode_tokens=r.max_episode_tokens,
                    max_turn_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, seeds=seeds,
                    max_context=r.max_model_len, show_progress=show_progress)
                episodes.append((len(samples), agent_metrics))
                return samples
            ids = [self.prompt_ids(p) for p in prompts]
            seeds = request_seeds(cfg.rollout.seed, step, first_prompt, len(ids), sampling_round)
            return generate_samples(self.worker, ids, prompts, self.verifier, n=a.n_samples_per_prompt,
                                    temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                    max_tokens=cfg.rollout.max_new_tokens, show_progress=show_progress, seeds=seeds)

        out = collect_rollout(generate_round, share=self.prompts_per_rank, dynamic=a.dynamic_sampling,
                              max_rounds=a.max_sampling_rounds)
        out.weights_step, out.seconds = weights_step, time.perf_counter() - t0
        # This rank's fault counts, taken now: under overlap the next rollout starts before this
        # one's step logs its metrics.
        for counter in (self.worker, self.verifier):
            pop = getattr(counter, "pop_metrics", None)
            for name, value in (pop() if pop is not None else {}).items():
                out.fault_counts[name] = out.fault_counts.get(name, 0.0) + float(value)
        out.source_metrics = source_metrics(self.source)
        out.source_metrics.update(mean_episode_metrics(episodes))  # agent/*: this rank's episodes, every round
        return out

    def _rollout_metrics(self, step: int, rollout: Rollout) -> dict:
        """Staleness (steps between the generating and the trained weights) and, with dynamic
        sampling, its rounds and group counts over all ranks. Collective."""
        a = self.cfg.algo
        out = {"rollout/staleness": float(step - 1 - rollout.weights_step),
               "timing/generation": all_reduce_max(rollout.seconds)}
        if not a.dynamic_sampling:
            return out
        kept, dropped, filler, surplus = all_reduce_sum([rollout.kept_groups, rollout.dropped_groups,
                                                         rollout.filler_groups, rollout.surplus_groups])
        rounds = all_reduce_max(rollout.rounds)
        out.update({"rollout/sampling_rounds": rounds, "rollout/kept_groups": kept, "rollout/dropped_groups": dropped,
                    "rollout/filler_groups": filler, "rollout/surplus_groups": surplus})
        if filler and is_main_rank():
            log.warning("dynamic sampling: step %d found %d of algo.rollout_batch_size=%d informative groups in %d "
                        "round(s) (algo.max_sampling_rounds=%d); training on those plus %d all-equal (zero-advantage) "
                        "groups", step, int(kept), a.rollout_batch_size, int(rounds), a.max_sampling_rounds,
                        int(filler))
        return out

    def _next_rollout_state(self):
        """(step, rollout) of a finished background rollout, for the checkpoint (resume trains it
        as the uninterrupted run would), or None."""
        held = self.next_rollout.finished_value()
        return None if held is None else (self.next_rollout.step, held)

    def _restore_next_rollout(self, state) -> None:
        if state is not None:
            self.next_rollout.preload(*state)

    def _push_weights(self, step: int) -> dict:
        """The actor's weights after `step` into the rollout engine(s), bucketed and without disk,
        then checked on a fixed probe (dsrl.rollout.weight_sync); returns the sync's metrics
        (timing/sync_seconds, rollout/sync_bytes, _buckets, _logprob_diff). Collective: every rank."""
        return self.weight_sync.push(step)

    # ------------------------------------------------------------------ training
    def train_on(self, samples: List[Sample]) -> dict:
        """Scoring passes that are needed -> advantages -> optimizer step(s) on `samples`. With a
        critic (algo.advantage_estimator=gae): its values pass before the advantages, and per
        optimizer step a critic step (value loss, own engine) before the actor's."""
        data = {"rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
                "loss_mask": [response_loss_mask(s) for s in samples],  # model tokens (episodes: env tokens 0)
                "group_ids": torch.tensor([s.group for s in samples]),
                "rollout_log_probs": [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]}
        # Reuse is only exact for one optimizer step on rollout data without actor log-probs:
        # checked before any old, reference or teacher pass runs.
        check_reuse_invariants(self.decision, steps_per_rollout=self.steps_per_rollout, batch_keys=data.keys())

        # Scoring passes that are actually needed (the old-policy pass is skipped under reuse;
        # a skipped pass reports exactly 0.0 s).
        reuse_metrics: dict = {}
        if self.decision.probe:  # adaptive: rollout log-probs as the old policy unless the probe objects
            with self.timer.phase("old_logprobs"):
                data["old_log_probs"], reuse_metrics = self._old_policy_by_probe(samples, data["rollout_log_probs"])
        elif self.decision.run_old_pass:
            with self.timer.phase("old_logprobs"):
                data["old_log_probs"] = self._score(self.actor, samples, "actor forward")
        if self.cfg.algo.reuse_logprobs == "adaptive" and not reuse_metrics:
            reuse_metrics = {"reuse/full_pass": float(self.decision.run_old_pass)}
        if self.ref is not None:
            with self.timer.phase("ref_logprobs"):
                data["ref_log_probs"] = self._score(self.ref, samples, "ref forward")
        if self.teacher is not None:
            with self.timer.phase("teacher_logprobs"):
                data["teacher_log_probs"] = self._score(self.teacher, samples, "teacher forward")
        if self.critic is not None:  # gae: V before either model trains (never skipped, whatever the reuse)
            with self.timer.phase("critic_values"):
                data["values"] = self._critic_values(samples)

        compute_advantages(data, self.algo)  # detach boundary first, then the estimator (gae: returns = A + V)
        token_fields = {k: list(data[k]) for k in TOKEN_FIELDS if k in data}
        keep = self._trained_samples(data["advantages"])

        metrics: dict = {}
        per_step = len(samples) // self.steps_per_rollout
        for k in range(self.steps_per_rollout):
            lo, hi = k * per_step, (k + 1) * per_step
            m = {}
            if self.critic is not None:  # every sample: a zero advantage is no zero value loss
                with self.timer.phase("critic_train"):
                    m.update(self._critic_step(samples[lo:hi], {"returns": list(data["returns"])[lo:hi],
                                                                "old_values": list(data["values"])[lo:hi]}))
            with self.timer.phase("train"):
                idx = [i for i in keep if lo <= i < hi]
                m.update(self._optimizer_step([samples[i] for i in idx],
                                              {n: [v[i] for i in idx] for n, v in token_fields.items()},
                                              all_samples=samples[lo:hi]))
            for n, v in m.items():
                metrics[n] = metrics.get(n, 0.0) + v / self.steps_per_rollout
        if self.critic is not None:
            metrics["critic/skipped_steps"] = float(self.critic_skips.total)
        metrics.update(reuse_metrics)
        return metrics

    def _old_policy_by_probe(self, samples: List[Sample], rollout_log_probs: list) -> tuple:
        """algo.reuse_logprobs=adaptive: re-score a reproducible sample of the sequences (all ranks
        decide together: the mismatch is all-reduced), then either the rollout log-probs (copies)
        or, when the probe objects, the full old-policy pass. Returns (old_log_probs, metrics)."""
        a = self.cfg.algo
        say = log.info if is_main_rank() else log.debug
        missing = missing_rollout_log_probs([len(s.response_ids) for s in samples], rollout_log_probs)
        step = self.skips.step or 0  # the RL step in progress (set by step())
        idx = probe_indices(len(samples), a.reuse_probe_fraction, seed=self.cfg.data.seed, step=step, rank=global_rank())
        scored = self._score(self.actor, [samples[i] for i in idx], "reuse probe") if idx else []
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
            return self._score(self.actor, samples, "actor forward"), verdict.metrics()
        return [lp.clone() for lp in rollout_log_probs], verdict.metrics()

    def _trained_samples(self, advantages: list) -> List[int]:
        """Indices of the samples that go through the training forward: all of them, unless
        skipping all-zero-advantage samples is exact for this objective (see dsrl.loss.skip);
        skipped samples stay in the aggregation denominators."""
        keep = list(range(len(advantages)))
        if self.skip_zero_advantage:
            keep = [i for i in keep if bool(advantages[i].abs().sum() > 0)]
        return keep

    def _score(self, engine, samples: List[Sample], desc: str) -> list:
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

    # ------------------------------------------------------------------ the critic (algo.advantage_estimator=gae)
    def _critic_micro_batch_size(self) -> int:
        return self.cfg.critic.micro_batch_size or self.cfg.actor.micro_batch_size

    def _critic_values(self, samples: List[Sample]) -> list:
        """The critic's value at each response token, one 1-D tensor per sample (dense layout, in
        order): GAE's V and the value loss's V_old."""
        mbs = pack_microbatches(samples, self._critic_micro_batch_size(), self.pad_id)
        with microbatch_bar(len(mbs), "critic forward", enabled=self.cfg.logger.progress) as bar:
            values = self.critic.values(mbs, progress=bar)
        out = []
        for mb, v in zip(mbs, values):  # one value per response token (0 off the loss mask)
            out.extend(masked_rows(v, mb.get("response_mask", mb["loss_mask"])))
        return out

    def _critic_step(self, samples: List[Sample], fields: dict) -> dict:
        """One critic optimizer step on `samples` (returns, old_values per token), normalized by
        the step's global counts like the policy loss (algo.loss_agg_mode); every rank runs the
        same number of microbatches. A non-finite step is skipped and counted (critic/skipped_steps);
        trainer.max_skipped_steps in a row stop the run (TrainingDiverged)."""
        a = self.cfg.algo
        tokens, seqs = all_reduce_sum([sum(len(s.response_ids) for s in samples), len(samples)])
        mbs = pack_microbatches(samples, self._critic_micro_batch_size(), self.pad_id, fields) if samples else []
        n_mb = max(1, int(all_reduce_max(len(mbs))))
        while len(mbs) < n_mb:
            mbs.append(empty_microbatch(self.pad_id, CRITIC_FIELDS))

        reduction = Reduction(a.loss_agg_mode, global_tokens=tokens, global_seqs=seqs,
                              norm_len=float(self.cfg.rollout.max_new_tokens))
        metrics = self.critic.train_step(mbs, self.algo, reduction, loss=self.cfg.critic.loss)
        self.critic_skips.record(self.critic.last_step_skipped)
        return metrics

    def _optimizer_step(self, samples: List[Sample], token_fields: dict, *, all_samples: List[Sample]) -> dict:
        """One optimizer step: every microbatch of `samples` forward/backward, then the step.
        `all_samples` (skipped ones included) define the global normalizers."""
        counts = self._step_counts(samples, all_samples)
        microbatches = self._microbatches(samples, token_fields)
        sums = self._forward_backward(microbatches, counts)
        if self.weight_sync.checks_samples:  # the last push, between probes (rollout.sync_probe_every)
            self.weight_sync.check_samples(sums.get("rollout/abs_diff_sum", 0.0), sums.get("rollout/tokens", 0.0),
                                           self.skips.step)
        grad_norm = self.actor.optimizer_step()
        # Non-finite loss/gradient: the actor skipped the step; TrainingDiverged after max_skipped_steps in a row.
        self.skips.record(self.actor.last_step_skipped)
        if self.cfg.trainer.check_rank_sync:
            self._assert_ranks_in_sync()
        return self._step_metrics(sums, counts, grad_norm)

    def _step_counts(self, samples: List[Sample], all_samples: List[Sample]) -> StepCounts:
        """Global (all ranks) token/sequence counts of the step, trained and in all."""
        ac = self.cfg.actor
        plan = plan_microbatches(samples, micro_batch_size=ac.micro_batch_size, max_tokens=ac.max_tokens_per_microbatch,
                                 shared_prompt=engine_uses_shared_prompt(self.cfg, self.actor))
        tokens, seqs, trained_tokens, trained_seqs, n_mb = all_reduce_sum(
            [sum(model_tokens(s) for s in all_samples), len(all_samples),  # token-mean counts model tokens only
             sum(model_tokens(s) for s in samples), len(samples), len(plan)])
        return StepCounts(tokens, seqs, trained_tokens, trained_seqs, n_mb)

    def _microbatches(self, samples: List[Sample], token_fields: dict) -> List[dict]:
        """This rank's microbatches, padded with empty (all-zero-mask) ones to the largest count
        of any rank: every rank must run the same number of backward calls (ZeRO collectives).
        Layout and grouping: actor.shared_prompt and actor.max_tokens_per_microbatch."""
        ac = self.cfg.actor
        mbs = pack_microbatches(samples, ac.micro_batch_size, self.pad_id, token_fields,
                                max_tokens=ac.max_tokens_per_microbatch,
                                shared_prompt=engine_uses_shared_prompt(self.cfg, self.actor)) if samples else []
        n_mb = max(1, int(all_reduce_max(len(mbs))))
        while len(mbs) < n_mb:
            mbs.append(empty_microbatch(self.pad_id, ["rollout_log_probs", *token_fields]))
        return mbs

    def _forward_backward(self, microbatches: List[dict], counts: StepCounts) -> dict:
        """Forward/backward every microbatch with its objective; returns summed metric partials
        (plus train/pad_fraction: padded / all token positions of the step's microbatches, all
        ranks, the empty rank-padding microbatches left out; carried by rank 0 only, as the
        partials are summed over ranks)."""
        a = self.cfg.algo
        real = [padded_tokens(mb) for mb in microbatches if mb.get("sample_indices") != [-1]]
        padded, total = all_reduce_sum([sum(p for p, _ in real), sum(t for _, t in real)])
        sums: dict = {"train/pad_fraction": padded / max(total, 1.0) if global_rank() == 0 else 0.0}
        with microbatch_bar(len(microbatches), "actor train", enabled=self.cfg.logger.progress) as bar:
            for i, mb in enumerate(microbatches):
                for hook in self.hooks:
                    hook(mb)
                spec, config = self._objective_for(mb)
                if "sampling_logprobs" in spec.required_inputs:  # Tinker's sampler log-probs q
                    mb["sampling_logprobs"] = mb["rollout_log_probs"]
                reduction = Reduction(spec.aggregation or a.loss_agg_mode, global_tokens=counts.tokens,
                                      global_seqs=counts.seqs, norm_len=float(self.cfg.rollout.max_new_tokens))
                out = self.actor.forward_backward(mb, spec, config, reduction,
                                                  reuse_training_logprobs=self.decision.reuse,
                                                  is_last=i == len(microbatches) - 1)
                for n, v in out.metrics.items():
                    sums[n] = sums.get(n, 0.0) + float(v)
                bar.update(1)
        return sums

    def _step_metrics(self, sums: dict, counts: StepCounts, grad_norm: float) -> dict:
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

    def _objective_for(self, mb: dict):
        """A microbatch (work unit) may name its own objective and config (e.g. set by a hook);
        otherwise the run's configured objective applies."""
        name = mb.pop("loss_fn", None)
        overrides = mb.pop("loss_fn_config", None)
        if name is None and overrides is None:
            return self.objective, self.objective_config
        spec = self.objective if name is None else get_objective(name)
        try:
            return spec, objective_config(spec, self.algo, overrides or {})
        except KeyError as e:
            raise ValueError(f"microbatch of samples {mb.get('sample_indices')}: {e.args[0]}") from None

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

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """Greedy accuracy on the held-out prompts (split across ranks), overall and per
        prompt split (e.g. held-out problems vs unseen phrasings)."""
        prompts = self.source.eval_set(self.cfg.data.num_eval)
        splits = sorted({str(p.meta.get("split", "eval")) for p in prompts})
        mine = prompts[global_rank()::world_size()]
        ids = [self.prompt_ids(p) for p in mine]
        with self.memory.for_rollout():
            groups = self.worker.generate(ids, n=1, temperature=0.0, top_p=1.0,
                                          max_tokens=self.cfg.rollout.max_new_tokens,
                                          show_progress=self.cfg.logger.progress and is_main_rank())
        counts = [0.0] * (2 * len(splits) + 2)
        for g, p in zip(groups, mine):
            ok = float(self.verifier(g[0].text, p))
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

