"""The RL loop. One step: rollout -> scoring passes that are needed and advantages -> policy
update (gae: the critic's update before it) -> weight push -> metrics. Each stage is a module of
dsrl.stages with one job; the state a checkpoint carries is one object (dsrl.stages.state). The
components are built in dsrl.main and handed in."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import List, Optional

from dsrl.actor.batch import Sample
from dsrl.checkpoint import (config_record, load_rank_state, read_shared_state, restore_rng,
                             save_checkpoint)
from dsrl.actor.nonfinite import TrainingDiverged
from dsrl.config.schema import Config
from dsrl.distributed.collectives import all_reduce_max
from dsrl.distributed.ranks import global_rank, is_main_rank, world_size
from dsrl.errors import RunStopped
from dsrl.rollout.async_buffer import AsyncBuffer
from dsrl.rollout.faults import kill_point
from dsrl.rollout.memory import EngineMemory, sleep_mode_wanted
from dsrl.rollout.rewards import RewardGuard
from dsrl.rollout.weight_sync import WeightSync
from dsrl.stages.critic import CriticUpdate
from dsrl.stages.evaluation import evaluate
from dsrl.stages.policy import PolicyUpdate
from dsrl.stages.rollout import RolloutStage
from dsrl.stages.scoring import ScoringPasses
from dsrl.stages.state import LoopState
from dsrl.tracking import MetricsLogger, PhaseTimer, plot_run
from dsrl.tracking.jsonl import JsonlLog
from dsrl.validation.reuse import ReuseDecision, steps_per_rollout
from dsrl.validation.validate import async_mode, probe_every

log = logging.getLogger("dsrl")
PROMPTS_FILENAME = "prompts.jsonl"
PHASES = ("rollout", "old_logprobs", "ref_logprobs", "teacher_logprobs", "critic_values", "critic_train", "train",
          "weight_sync")


def async_buffer_for(cfg: Config):
    """algo.async_schedule clock | deterministic: this rank's empty asynchronous buffer; else None."""
    if async_mode(cfg) not in ("clock", "deterministic"):
        return None
    return AsyncBuffer(groups_per_batch=cfg.algo.rollout_batch_size // world_size(), n=cfg.algo.n_samples_per_prompt,
                       k=cfg.algo.off_policy_steps, total_batches=cfg.trainer.total_steps,
                       drop_stale=cfg.algo.stale_groups == "drop", bind=cfg.algo.stale_groups == "admission")


class Trainer:
    def __init__(self, cfg: Config, *, actor, ref, worker, tokenizer, source, verifier, prompt_ids_fn,
                 decision: ReuseDecision, run_dir: str, teacher=None, critic=None, hardware_auto=(),
                 eval_verifier=None):
        self.cfg, self.actor, self.worker, self.tokenizer, self.source = cfg, actor, worker, tokenizer, source
        self.critic, self.decision, self.run_dir, self.prompt_ids = critic, decision, run_dir, prompt_ids_fn
        self.hardware_auto = tuple(hardware_auto)  # keys dsrl.hardware resolved from `auto` (kept in checkpoints)
        # Raises/hangs: reward 0, counted; up to reward.concurrency calls in flight.
        self.verifier = RewardGuard.wrap(verifier, cfg.reward.timeout_s, cfg.reward.concurrency)
        # The greedy eval's verifier (reward.eval_fn); None: the training reward's.
        self.eval_verifier = (RewardGuard.wrap(eval_verifier, cfg.reward.timeout_s, cfg.reward.concurrency)
                              if eval_verifier is not None else self.verifier)
        self.state = LoopState.fresh(seed=cfg.data.seed, rank=global_rank(), max_skipped_steps=cfg.trainer.max_skipped_steps,
                                     async_buffer=async_buffer_for(cfg))
        self.algo = dataclasses.asdict(cfg.algo)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.logger = MetricsLogger.from_config(run_dir, cfg)  # jsonl + TensorBoard (+ W&B)
        # The prompts' lineage: per step and rank, the draw numbers of the prompts trained and dropped
        # (RolloutStage.lineage); `lineage` holds the current step's rows until they are logged.
        self.prompt_log = JsonlLog(os.path.join(run_dir, PROMPTS_FILENAME), enabled=is_main_rank())
        self.lineage: list = []
        self.timer = PhaseTimer(phases=PHASES)
        self.steps_per_rollout = steps_per_rollout(cfg)
        self.start_step = 0  # the last finished step (restore() sets it from a checkpoint)
        self.stop_signal: Optional[int] = None  # set by a signal handler: stop after this step
        # A colocated CUDA engine sleeps through the train phase (dsrl.rollout.memory); a no-op elsewhere.
        self.memory = EngineMemory(worker, sleep_mode_wanted(cfg))
        self.weight_sync = WeightSync(actor, worker, cfg.rollout, memory=self.memory, schedule=self.state.sync,
                                      probe_every=probe_every(cfg))
        self.rollout = RolloutStage(cfg, worker=worker, tokenizer=tokenizer, source=source, verifier=self.verifier,
                                    prompt_ids_fn=prompt_ids_fn, state=self.state)
        self.critic_update = (CriticUpdate(cfg, critic, pad_id=pad_id, algo=self.algo, skips=self.state.critic_skips)
                              if critic is not None else None)
        self.scoring = ScoringPasses(cfg, actor=actor, ref=ref, teacher=teacher, critic_update=self.critic_update,
                                     decision=decision, pad_id=pad_id, algo=self.algo,
                                     steps_per_rollout=self.steps_per_rollout, timer=self.timer)
        self.policy = PolicyUpdate(cfg, actor, pad_id=pad_id, algo=self.algo, decision=decision,
                                   weight_sync=self.weight_sync, skips=self.state.skips)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg = self.cfg
        say = log.info if is_main_rank() else log.debug  # one copy of each line, from rank 0
        say(self.decision.reason)
        say(self.scoring.skip_reason)
        self.logger.open()  # TensorBoard and W&B start with the loop (restore() has started a resumed run's)
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
            for row in self.lineage:
                self.prompt_log.append(row)
            say(self.logger.summary_line(step, metrics))
            if cfg.logger.plot and is_main_rank() and step % max(cfg.logger.plot_every, 1) == 0:
                plot_run(self.logger.history, os.path.join(self.run_dir, "plot.png"))
            saved = self.save(step) if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 else None
            if all_reduce_max(self.stop_signal or 0):  # a signal reached some rank: stop together
                raise RunStopped(int(all_reduce_max(self.stop_signal or 0)), step, saved or self.save(step))
        self.rollout.finish()  # no generation in flight beside the greedy eval (the last step starts none)
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
        self.prompt_log.close()
        return summary

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        """Checkpoint the state after `step` (collective); returns its folder."""
        self.rollout.checkpoint_snapshot(step)  # the asynchronous buffer, when there is one
        folder, seconds = save_checkpoint(
            self.run_dir, step, actor=self.actor, tokenizer=self.tokenizer, keep=self.cfg.trainer.keep_checkpoints,
            **({"storage": "node_local"} if self.cfg.trainer.checkpoint_storage == "node_local" else {}),
            **({"critic": self.critic} if self.critic is not None else {}),  # gae: the critic's DeepSpeed state
            rank_state=self.state.state_dict(),
            shared={"metrics": self.logger.history, "prompts": self.prompt_log.history,
                    "wandb_run_id": self.logger.wandb_run_id,
                    "config": config_record(self.cfg), "hardware_auto": list(self.hardware_auto)})
        if is_main_rank():
            log.info("checkpoint of step %d: %s (%.1f s)", step, folder, seconds)
        return folder

    def restore(self, folder: str) -> int:
        """Continue from a checkpoint: weights, optimizer, RNGs, the loop state, metrics and prompt
        lineage so far (and the metrics' W&B run); the rollout engine gets the restored weights.
        Returns the checkpoint's step."""
        shared = read_shared_state(folder)
        self.actor.load_checkpoint(folder)
        if self.critic is not None:
            self.critic.load_checkpoint(folder)
        state = load_rank_state(folder)
        self.start_step = int(shared["step"])
        # TensorBoard and W&B continue the checkpoint's run (started before the RNGs are restored,
        # as a fresh run's are before it draws); a checkpoint written before the W&B run's id
        # was kept starts a new W&B run.
        self.logger.restore(shared["metrics"], step=self.start_step, wandb_run_id=shared.get("wandb_run_id"))
        self.prompt_log.rewrite(shared.get("prompts", []))  # a checkpoint written before the file existed: none
        restore_rng(state["rng"])
        self.state.load_state_dict(state["trainer"])  # a field an older checkpoint lacks keeps its fresh value
        self.rollout.restored(self.start_step)
        self.weight_sync.push(self.start_step, scheduled=False)  # checked, not counted: the uninterrupted run made no such push
        self.state.weights_step = self.start_step
        if is_main_rank():
            log.info("resumed from %s: continuing after step %d", folder, self.start_step)
        return self.start_step

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        t_step = time.perf_counter()
        # Rollout and rewards (this rank's share of the prompts). Under algo.off_policy_steps=1 it
        # was generated during the previous step, and the next step's starts now, beside training.
        with self.timer.phase("rollout"), self.memory.for_rollout(), kill_point("rollout", step):
            rollout = self.rollout.collect(step)
        if self.rollout.mode == "overlap" and step < self.cfg.trainer.total_steps:
            self.rollout.start_next(step + 1)
        # Scoring passes, advantages, optimizer step(s); a colocated CUDA engine sleeps meanwhile.
        with self.memory.for_training():
            metrics = self.train_on(rollout.samples, step)
        # Weight push, verified on the next step's samples (under overlap rollout/logprob_diff also
        # holds one step of policy change); never while a generation is in flight (vLLM must not
        # load weights mid-generation): time spent waiting for it counts as rollout. Asynchronous
        # schedules load it between two generation chunks.
        with self.timer.phase("rollout"):
            self.state.next_rollout.wait()
        with self.timer.phase("weight_sync"), kill_point("weight_push", step):
            metrics.update(self.rollout.push(step, lambda: self.weight_sync.push(step)))
        self.state.weights_step = step
        rollout_metrics = self.rollout.metrics(step, rollout)
        self.lineage = self.rollout.lineage(step, rollout)
        metrics.update(self.timer.pop())
        metrics.update(rollout_metrics)
        metrics["train/skipped_steps"] = float(self.state.skips.total)
        metrics["timing/step"] = time.perf_counter() - t_step
        return metrics

    def train_on(self, samples: List[Sample], step: int) -> dict:
        """Scoring passes that are needed -> advantages -> optimizer step(s) on `samples` of RL step
        `step`. With a critic (gae): its values pass before the advantages, and per optimizer step a
        critic step (value loss, own engine) before the actor's."""
        with kill_point("scoring", step):
            scored = self.scoring.run(samples, step=step)
        metrics: dict = {}
        per_step = len(samples) // self.steps_per_rollout
        for k in range(self.steps_per_rollout):
            lo, hi = k * per_step, (k + 1) * per_step
            m = {}
            if self.critic_update is not None:  # every sample: a zero advantage is no zero value loss
                fields = {"returns": list(scored.data["returns"])[lo:hi], "old_values": list(scored.data["values"])[lo:hi]}
                with self.timer.phase("critic_train"):
                    m.update(self.critic_update.step(samples[lo:hi], fields, step=step))
            with self.timer.phase("train"), kill_point("optimizer", step):
                idx = [i for i in scored.trained if lo <= i < hi]
                m.update(self.policy.step([samples[i] for i in idx],
                                          {n: [v[i] for i in idx] for n, v in scored.token_fields.items()},
                                          all_samples=samples[lo:hi], step=step))
            for n, v in m.items():
                metrics[n] = metrics.get(n, 0.0) + v / self.steps_per_rollout
        if self.critic_update is not None:
            metrics["critic/skipped_steps"] = float(self.state.critic_skips.total)
        metrics.update(scored.reuse_metrics)
        return metrics

    def close(self) -> None:
        """Stop the rollout side: the agent endpoint's server (if one started), then the engines."""
        self.rollout.close()
        self.worker.close()

    def evaluate(self) -> dict:
        return evaluate(self.cfg, source=self.source, worker=self.worker, verifier=self.eval_verifier,
                        prompt_ids_fn=self.prompt_ids, memory=self.memory)
