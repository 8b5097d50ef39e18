"""PPO with a critic through the real RL loop, without editing dsrl/trainer.py: `CriticTrainer`
is `Trainer` whose `train_on` adds the critic exactly where the integration puts it (lines marked
"+ critic"): the values pass before the advantages, GAE, then per optimizer step the critic's
value-loss step beside the actor's policy step. Everything else is the product's: the real
Trainer.step, the transformers rollout worker sharing the actor's module (rollout.backend=hf),
the arith task and its verifier, real DeepSpeed actor and critic engines.

The test runs two steps on the tiny model. Run as a script for the measured figures on the
default model (SmolLM2-135M):  .venv/bin/python tests/actor/test_critic_loop.py --steps 8"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import List

import pytest
import torch

from dsrl.actor.batch import Sample, empty_microbatch, masked_rows
from dsrl.actor.critic import CriticEngine, build_critic
from dsrl.config.reuse import check_reuse_invariants
from dsrl.config.schema import Config
from dsrl.distributed.collectives import all_reduce_max, all_reduce_sum
from dsrl.loss.advantages import compute_advantages
from dsrl.loss.types import Aggregator
from dsrl.rollout.samples import pack_microbatches
from dsrl.trainer import TOKEN_FIELDS, Trainer

CRITIC_FIELDS = ("returns", "old_values")


class CriticTrainer(Trainer):
    """Trainer.train_on plus the critic (the lines marked "+ critic" are the integration)."""

    def __init__(self, *args, critic: CriticEngine, **kwargs):
        super().__init__(*args, **kwargs)
        self.critic = critic

    def train_on(self, samples: List[Sample]) -> dict:
        data = {"rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
                "loss_mask": [torch.ones(len(s.response_ids)) for s in samples],
                "group_ids": torch.tensor([s.group for s in samples]),
                "rollout_log_probs": [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]}
        check_reuse_invariants(self.decision, steps_per_rollout=self.steps_per_rollout, batch_keys=data.keys())
        if self.decision.run_old_pass:
            with self.timer.phase("old_logprobs"):
                data["old_log_probs"] = self._score(self.actor, samples, "actor forward")
        if self.ref is not None:
            with self.timer.phase("ref_logprobs"):
                data["ref_log_probs"] = self._score(self.ref, samples, "ref forward")
        with self.timer.phase("critic_values"):  # + critic: V before either model trains
            data["values"] = self._critic_values(samples)
        compute_advantages(data, self.algo)  # gae reads data["values"]; returns = A + V
        token_fields = {k: list(data[k]) for k in TOKEN_FIELDS if k in data}
        critic_fields = {"returns": list(data["returns"]), "old_values": list(data["values"])}  # + critic
        keep = self._trained_samples(data["advantages"])
        metrics: dict = {}
        per_step = len(samples) // self.steps_per_rollout
        for k in range(self.steps_per_rollout):
            lo, hi = k * per_step, (k + 1) * per_step
            with self.timer.phase("critic_train"):  # + critic: every sample (a zero advantage is no zero value loss)
                m = self._critic_step(samples[lo:hi], {n: v[lo:hi] for n, v in critic_fields.items()})
            with self.timer.phase("train"):
                idx = [i for i in keep if lo <= i < hi]
                m.update(self._optimizer_step([samples[i] for i in idx],
                                              {n: [v[i] for i in idx] for n, v in token_fields.items()},
                                              all_samples=samples[lo:hi]))
            for n, v in m.items():
                metrics[n] = metrics.get(n, 0.0) + v / self.steps_per_rollout
        return metrics

    # + critic: the two helpers the integration adds to Trainer
    def _critic_mbs(self) -> int:
        return self.cfg.critic.micro_batch_size or self.cfg.actor.micro_batch_size

    def _critic_values(self, samples: List[Sample]) -> list:
        """The critic's value at each response token, one 1-D tensor per sample (dense layout)."""
        mbs = pack_microbatches(samples, self._critic_mbs(), self.pad_id)
        out = []
        for mb, v in zip(mbs, self.critic.values(mbs)):
            out.extend(masked_rows(v, mb["loss_mask"]))
        return out

    def _critic_step(self, samples: List[Sample], fields: dict) -> dict:
        """One critic optimizer step on `samples`, normalized by the step's global counts like
        the policy loss (algo.loss_agg_mode); every rank runs the same number of microbatches."""
        tokens, seqs = all_reduce_sum([sum(len(s.response_ids) for s in samples), len(samples)])
        mbs = pack_microbatches(samples, self._critic_mbs(), self.pad_id, fields) if samples else []
        while len(mbs) < max(1, int(all_reduce_max(len(mbs)))):
            mbs.append(empty_microbatch(self.pad_id, CRITIC_FIELDS))
        a = self.cfg.algo

        def reduce_for(mb):
            return Aggregator.build(a.loss_agg_mode, mb["loss_mask"], global_tokens=tokens, global_seqs=seqs,
                                    norm_len=float(self.cfg.rollout.max_new_tokens))

        return self.critic.train_step(mbs, self.algo, reduce_for, loss=self.cfg.critic.loss)


def ppo_config(model_path: str, *, steps: int, prompts: int = 4, n: int = 4, max_new_tokens: int = 8,
               micro_batch_size: int = 8, actor_lr: float = 1e-5, critic_lr: float = 1e-5) -> Config:
    """PPO + GAE on the default task (arith), one optimizer step per rollout (so training log-prob
    reuse applies to the actor), the hf rollout worker, float32."""
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, path=str(model_path), dtype="float32", attn_implementation="eager")
    cfg.actor = dataclasses.replace(cfg.actor, lr=actor_lr, micro_batch_size=micro_batch_size,
                                    forward_micro_batch_size=micro_batch_size, shared_prompt="off", num_threads=2)
    cfg.rollout = dataclasses.replace(cfg.rollout, backend="hf", dtype="float32", max_new_tokens=max_new_tokens,
                                      timeout_s=3600.0)  # a shared 2-core machine can be very slow
    cfg.algo = dataclasses.replace(cfg.algo, advantage_estimator="gae", gamma=1.0, gae_lambda=0.95,
                                   n_samples_per_prompt=n, rollout_batch_size=prompts, global_batch_size=prompts * n,
                                   reuse_logprobs="auto")
    cfg.critic = dataclasses.replace(cfg.critic, lr=critic_lr)
    cfg.trainer = dataclasses.replace(cfg.trainer, total_steps=steps, eval_before=False, eval_after=False,
                                      save_final=False, save_every=0)
    cfg.logger = dataclasses.replace(cfg.logger, tensorboard=False, plot=False, progress=False)
    return cfg


def validate_wired(cfg: Config) -> None:
    """validate(cfg) as it will run once Trainer.train_on drives the critic (gae's rl_loop_error off)."""
    from dsrl.config.validate import validate
    from dsrl.loss.registry import ADVANTAGE_ESTIMATORS

    gae = ADVANTAGE_ESTIMATORS["gae"]
    saved = gae.__dict__.pop("rl_loop_error", None)
    try:
        validate(cfg)
    finally:
        if saved is not None:
            gae.rl_loop_error = saved


def build_critic_trainer(cfg: Config, run_dir: str) -> CriticTrainer:
    """As dsrl.main.build, plus `build_critic` (the integration's one line in main)."""
    from transformers import AutoTokenizer

    from dsrl.actor.engine import ActorEngine
    from dsrl.config.reuse import decide_reuse, reuse_for_model, reuse_for_model_config
    from dsrl.data.chat import apply_chat_template
    from dsrl.data.registry import build_source
    from dsrl.reward.registry import build_verifier
    from dsrl.rollout.factory import build_rollout

    validate_wired(cfg)
    path, m, ac = cfg.model.path, cfg.model, cfg.actor
    decision = reuse_for_model_config(decide_reuse(cfg), cfg, path)
    source = build_source(cfg.data)
    verifier = build_verifier(cfg.reward, source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(cfg.trainer.seed)
    actor = ActorEngine(path, zero_stage=ac.zero_stage, dtype=m.dtype, attn_implementation=m.attn_implementation,
                        lr=ac.lr, micro_batch_size=ac.micro_batch_size, grad_clip=ac.grad_clip)
    decision = reuse_for_model(decision, cfg, actor.module)
    critic = build_critic(cfg, path, dtype=m.dtype, attn_implementation=m.attn_implementation)  # + critic
    worker = build_rollout(cfg, path, run_dir, actor=actor)

    def prompt_ids(p):
        return apply_chat_template(tokenizer, p, cfg.data.system_prompt, cfg.data.chat_template)

    return CriticTrainer(cfg, actor=actor, ref=None, worker=worker, tokenizer=tokenizer, source=source,
                         verifier=verifier, prompt_ids_fn=prompt_ids, decision=decision, run_dir=run_dir,
                         critic=critic)


@pytest.mark.slow
def test_ppo_with_critic_runs_in_the_real_loop(tiny_model_path, tmp_path):
    cfg = ppo_config(str(tiny_model_path), steps=2, prompts=2, n=3, max_new_tokens=6, micro_batch_size=3,
                     actor_lr=1e-3, critic_lr=1e-3)
    trainer = build_critic_trainer(cfg, str(tmp_path))
    assert trainer.decision.reuse and "critic" in trainer.decision.reason  # actor reuse stays exact
    critic_before = [p.detach().clone() for p in trainer.critic.module.parameters()]
    actor_before = [p.detach().clone() for p in trainer.actor.module.parameters()]
    trainer.fit()
    hist = trainer.logger.history
    assert len(hist) == 2
    for h in hist:
        for key in ("critic/value_loss", "critic/value_clipfrac", "critic/grad_norm", "critic/values",
                    "critic/returns", "timing/critic_values", "timing/critic_train", "train/pg_loss"):
            assert key in h and h[key] == h[key], key  # present and not NaN
        assert h["timing/old_logprobs"] == 0.0  # reuse: no old-policy pass
        # One critic step per rollout, values pass and training forward on the same microbatches:
        # V is bit-identical to V_old, so the clip never binds.
        assert h["critic/value_clipfrac"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(trainer.critic.module.parameters(), critic_before))
    assert any(not torch.equal(a, b) for a, b in zip(trainer.actor.module.parameters(), actor_before))


def main(argv=None) -> int:
    """The measured run: PPO + GAE on arith with SmolLM2-135M (or --model), metrics per step."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--critic-lr", type=float, default=1e-5)
    ap.add_argument("--out", default="outputs/critic_loop")
    args = ap.parse_args(argv)
    from dsrl.setup_assets import default_cache_dir, resolve_model_path
    from dsrl.testing import configure_test_env

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    configure_test_env(default_cache_dir())
    path = resolve_model_path(args.model, str(default_cache_dir()))
    cfg = ppo_config(path, steps=args.steps, prompts=args.prompts, n=args.n, max_new_tokens=args.max_new_tokens,
                     critic_lr=args.critic_lr)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    trainer = build_critic_trainer(cfg, args.out)
    print("reuse:", trainer.decision.reason, f"(built in {time.time() - t0:.1f} s)")
    trainer.fit()
    keys = ("reward/mean", "critic/value_loss", "critic/explained_variance", "critic/value_clipfrac",
            "critic/values", "critic/returns", "train/pg_loss", "timing/critic_values", "timing/critic_train",
            "timing/train", "timing/rollout", "timing/step")
    for step, h in enumerate(trainer.logger.history, 1):
        print(json.dumps({"step": step, **{k: round(h[k], 4) for k in keys if k in h}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
