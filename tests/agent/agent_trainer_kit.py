"""Helpers for the trainer-level agent tests: a validated multi-turn Config on the tiny model, the
real Trainer around a real DeepSpeed engine and a real rollout worker (HFWorker sharing the
actor's module, or VLLMWorker), a spy that records what the trainer trains and scores (it wraps
the real methods, replaces nothing), hand-made episode samples (model and environment tokens),
and the independent reference for gradients (autograd on a plain transformers model).

Optimizer as in tests/trainer/_real_engine.py: AdamW with eps >> |g| makes the first update
-lr * g / (|g| + eps), so comparing parameter updates compares gradients."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from dsrl.actor.batch import Sample
from dsrl.actor.engine import ActorEngine
from dsrl.config.schema import Config
from dsrl.trainer import Trainer
from dsrl.validation.reuse import decide_reuse
from dsrl.validation.validate import validate

LR = 1.0
ADAM_EPS = 10.0


def agent_cfg(model_path, *, env: str = "guess_the_number", backend: str = "hf", groups: int = 2,
              group_size: int = 2, rollout=None, algo=None, actor=None, trainer=None) -> Config:
    """A validated multi-turn config: float32, one optimizer step per rollout, no eval."""
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, path=str(model_path), dtype="float32")
    cfg.algo = dataclasses.replace(cfg.algo, **{"n_samples_per_prompt": group_size, "rollout_batch_size": groups,
                                                "global_batch_size": groups * group_size, **(algo or {})})
    cfg.actor = dataclasses.replace(cfg.actor, **{"zero_stage": 0, "lr": LR, "eps": ADAM_EPS, "grad_clip": 0.0,
                                                  "micro_batch_size": 4, "forward_micro_batch_size": 4,
                                                  "num_threads": 2, **(actor or {})})
    cfg.rollout = dataclasses.replace(cfg.rollout, **{"env": env, "backend": backend, "dtype": "float32",
                                                      "max_turns": 3, "max_new_tokens": 8, "max_episode_tokens": 96,
                                                      "max_model_len": 512, "sync_probe": backend == "vllm",
                                                      "enforce_eager": True, **(rollout or {})})
    cfg.data = dataclasses.replace(cfg.data, digits=1, num_eval=4)
    cfg.logger = dataclasses.replace(cfg.logger, tensorboard=False, plot=False, progress=False)
    cfg.trainer = dataclasses.replace(cfg.trainer, **{"eval_before": False, "eval_after": False, "save_final": False,
                                                      "save_every": 0, "total_steps": 2, **(trainer or {})})
    validate(cfg)
    return cfg


def build_actor(cfg: Config) -> ActorEngine:
    torch.manual_seed(0)
    ac = cfg.actor
    return ActorEngine(cfg.model.path, zero_stage=ac.zero_stage, dtype="float32", lr=ac.lr, eps=ac.eps,
                       betas=(0.9, 0.999), weight_decay=0.0, grad_clip=ac.grad_clip,
                       micro_batch_size=ac.micro_batch_size, persistence_threshold=0,
                       temperature=cfg.rollout.temperature)


def build_trainer(cfg: Config, actor: ActorEngine, tokenizer, run_dir, worker=None) -> Trainer:
    """The real Trainer with dsrl.main's parts: the data source, its verifier, the rollout worker
    of dsrl.rollout.factory (the hf backend shares the actor's module) unless `worker` is given."""
    from dsrl.data.chat import apply_chat_template
    from dsrl.data.registry import build_source
    from dsrl.reward.registry import build_verifier
    from dsrl.rollout.factory import build_rollout

    source = build_source(cfg.data)
    if worker is None:
        worker = build_rollout(cfg, cfg.model.path, str(run_dir), actor=actor)
    return Trainer(cfg, actor=actor, ref=None, worker=worker, tokenizer=tokenizer, source=source,
                   verifier=build_verifier(cfg.reward, source),
                   prompt_ids_fn=lambda p: apply_chat_template(tokenizer, p, "", True),
                   decision=decide_reuse(cfg), run_dir=str(run_dir))


class Spy:
    """Records, per step, the samples `train_on` got, every `_score` pass (desc, samples, rows)
    and every training forward's microbatch with its log-probs (the actor's target_logprobs
    called with entropy, i.e. from forward_backward). Calls through to the real methods."""

    def __init__(self, trainer: Trainer):
        self.trained, self.scored, self.train_forwards = [], [], []
        train_on, score, target = trainer.train_on, trainer.scoring.score, trainer.actor.target_logprobs

        def spy_train_on(samples, step):
            self.trained.append(list(samples))
            return train_on(samples, step)

        def spy_score(engine, samples, desc):
            rows = score(engine, samples, desc)
            self.scored.append((desc, list(samples), [r.clone() for r in rows]))
            return rows

        def spy_target(batch, *, with_entropy=False):
            lp, ent = target(batch, with_entropy=with_entropy)
            if with_entropy:
                self.train_forwards.append((dict(batch), lp.detach().clone()))
            return lp, ent

        trainer.train_on, trainer.scoring.score, trainer.actor.target_logprobs = spy_train_on, spy_score, spy_target


def episode_samples(tokenizer, rewards: Sequence[Sequence[float]]) -> list:
    """Hand-made episodes: group g's prompt is a chat-templated question; each response is
    model turn, environment answer, model turn (the environment part masked: model_mask 0).
    Responses differ in length and in how many env tokens they hold."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    questions = ("Guess a number between 1 and 20.", "What is 7 + 5? Use the tool.")
    out = []
    for g, group in enumerate(rewards):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": questions[g]}],
                                               add_generation_prompt=True, tokenize=False)
        prompt_ids = enc(prompt)
        for j, r in enumerate(group):
            turn1 = enc(["[10]", "[4] I think", "<tool>calc: 7 + 5</tool>"][(g + j) % 3]) + [tokenizer.eos_token_id]
            env = enc("\n<|im_start|>user\n" + ["higher", "lower, try again", "<result>12</result>"][j % 3]
                      + "<|im_end|>\n<|im_start|>assistant\n")
            turn2 = enc(["[15]", "12", "[7] done now"][(g + 2 * j) % 3])
            resp = turn1 + env + turn2
            mask = [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
            out.append(Sample(prompt_ids=prompt_ids, response_ids=resp, rollout_log_probs=[0.0] * len(resp),
                              group=g, index=len(out), reward=float(r), extra={"model_mask": mask}))
    return out


def plain_model(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="eager")
    model.train()  # dropout 0 in the tiny config
    return model


def response_log_probs(model, samples) -> list:
    """Per response token log-prob, one unpadded sample at a time, with gradient."""
    out = []
    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(lp[len(s.prompt_ids) - 1:])
    return out


def reference_update(model, samples, loss_fn) -> dict:
    """The first AdamW update for the scalar loss_fn(per-sample log-prob rows): -LR * g / (|g| + eps)."""
    model.zero_grad(set_to_none=True)
    loss_fn(response_log_probs(model, samples)).backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = -LR * g / (g.abs() + ADAM_EPS)
    model.zero_grad(set_to_none=True)
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)
