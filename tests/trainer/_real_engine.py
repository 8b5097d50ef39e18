"""Real tiny DeepSpeed engines, hand-made samples and a Trainer around them, for the
trainer-level tests. The engine, objectives, estimators and aggregation are the product's; only
the rollout worker is a fake (it hands back these samples and records weight pushes).

Optimizer: AdamW's first step moves each weight by -lr * g / (|g| + eps). With the usual tiny
eps that is ~ -lr * sign(g): two different gradients (even a uniformly rescaled one) would give
nearly the same update, and a test comparing updates could not fail. With eps >> |g| the step is
~ -lr * g / eps, linear in the gradient, so comparing parameter updates compares gradients
(`reference_update` uses the exact formula, so it holds for any |g|).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

import torch

from dsrl.actor.batch import Sample, collate, masked_rows
from dsrl.actor.engine import ActorEngine
from dsrl.config.schema import Config
from dsrl.data.types import user_prompt
from dsrl.rollout.vllm_engine import Completion
from dsrl.trainer import Trainer
from dsrl.validation.reuse import decide_reuse
from dsrl.validation.validate import validate

LR = 1.0
# max |gradient| here is ~0.2 for the mean-type loss_agg_modes (~7 for "sum"), so the update
# -LR * g / (|g| + ADAM_EPS) is ~ -0.1 * g; the reference updates use the exact formula.
ADAM_EPS = 10.0
MAX_NEW_TOKENS = 12  # rollout.max_new_tokens: the seq-mean-token-sum-norm length

# One prompt per group; its responses have different lengths (real tokenizer ids).
PROMPTS = ("What is 3 + 4?", "Name a prime number larger than ten.", "Spell the word cat backwards.")
RESPONSES = (
    ("7", "It is 7.", "3 plus 4 makes 7, I think"),
    ("11", "Thirteen is prime.", "Maybe 12"),
    ("tac", "t a c", "The reverse is tac, done."),
)


def build_engine(model_path, *, zero_stage: int = 0, micro_batch_size: int = 4,
                 trainable: bool = True) -> ActorEngine:
    """A fresh float32 engine with the test optimizer (see module docstring) and no gradient
    clipping (a norm clip would rescale the gradient before the step)."""
    torch.manual_seed(0)
    return ActorEngine(str(model_path), zero_stage=zero_stage, dtype="float32", trainable=trainable,
                       lr=LR, eps=ADAM_EPS, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=0.0,
                       micro_batch_size=micro_batch_size, persistence_threshold=0)


def make_cfg(model_path, *, groups: int = 3, group_size: int = 3, micro_batch_size: int = 4,
             zero_stage: int = 0, **algo) -> Config:
    """A validated config for `groups` x `group_size` samples, one optimizer step per rollout;
    scoring passes are packed like training microbatches (same shapes: bit-exact reuse)."""
    cfg = Config()
    algo = {"n_samples_per_prompt": group_size, "rollout_batch_size": groups,
            "global_batch_size": groups * group_size, **algo}
    cfg.algo = dataclasses.replace(cfg.algo, **algo)
    cfg.model = dataclasses.replace(cfg.model, path=str(model_path))
    cfg.actor = dataclasses.replace(cfg.actor, zero_stage=zero_stage, lr=LR, eps=ADAM_EPS, grad_clip=0.0,
                                    micro_batch_size=micro_batch_size,
                                    forward_micro_batch_size=micro_batch_size,
                                    stage3_param_persistence_threshold=0)
    cfg.rollout = dataclasses.replace(cfg.rollout, max_new_tokens=MAX_NEW_TOKENS,
                                      sync_probe=False)  # the fake worker has no engine to probe
    cfg.logger = dataclasses.replace(cfg.logger, tensorboard=False, plot=False, progress=False)
    cfg.trainer = dataclasses.replace(cfg.trainer, eval_before=False, eval_after=False, save_final=False)
    validate(cfg)
    return cfg


def make_samples(tokenizer, rewards: Sequence[Sequence[float]],
                 rollout_log_probs: Optional[Sequence[torch.Tensor]] = None) -> list[Sample]:
    """Samples of len(rewards) groups (group g uses PROMPTS[g] and RESPONSES[g]); rollout
    log-probs default to zeros (set them from a real engine with `with_rollout_log_probs`)."""
    out = []
    for g, group_rewards in enumerate(rewards):
        prompt = tokenizer.encode(PROMPTS[g], add_special_tokens=False)
        for j, r in enumerate(group_rewards):
            resp = tokenizer.encode(" " + RESPONSES[g][j], add_special_tokens=False)
            if len(resp) > MAX_NEW_TOKENS:
                raise ValueError(f"response {RESPONSES[g][j]!r} is longer than MAX_NEW_TOKENS")
            out.append(Sample(prompt_ids=prompt, response_ids=resp, rollout_log_probs=[0.0] * len(resp),
                              group=g, index=len(out), reward=float(r), text=str(float(r))))
    if rollout_log_probs is not None:
        out = with_rollout_log_probs(out, rollout_log_probs)
    return out


def with_rollout_log_probs(samples: Sequence[Sample], log_probs: Sequence[torch.Tensor],
                           offsets: Optional[Sequence[Sequence[float]]] = None) -> list[Sample]:
    """Copies of `samples` whose rollout log-probs are `log_probs` (+ per-token `offsets`)."""
    out = []
    for i, (s, lp) in enumerate(zip(samples, log_probs, strict=True)):
        vals = [float(v) for v in lp]
        if offsets is not None:
            vals = [v + float(o) for v, o in zip(vals, offsets[i], strict=True)]
        out.append(dataclasses.replace(s, rollout_log_probs=vals))
    return out


def score_samples(engine: ActorEngine, samples: Sequence[Sample], pad_id: int) -> list[torch.Tensor]:
    """Forward-only log-prob of every response token, one 1-D tensor per sample."""
    mb = collate(list(samples), pad_id)
    (lp,) = engine.score([mb])
    return masked_rows(lp, mb["loss_mask"])


def grpo_advantages(rewards: Sequence[Sequence[float]]) -> list[float]:
    """GRPO by hand: (r - group mean) / (unbiased group std + 1e-6); 0 for an equal-reward group."""
    out = []
    for group in rewards:
        n = len(group)
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out.extend([(r - mean) / (std + 1e-6) if std > 0 else 0.0 for r in group])
    return out


class FakeWorker:
    """Stands in for the vLLM worker in `Trainer.step`: returns the given samples' completions
    for each prompt (in order) and records every weight push."""

    def __init__(self, samples: Sequence[Sample]):
        self.samples = list(samples)
        self.pushed: list = []

    def generate(self, prompt_ids, *, n, temperature, top_p, max_tokens, show_progress=False, seeds=None):
        groups = []
        for g, ids in enumerate(prompt_ids):
            mine = [s for s in self.samples if s.group == g]
            if len(mine) != n or list(ids) != list(mine[0].prompt_ids):
                raise AssertionError(f"prompt {g}: unexpected request (n={n})")
            groups.append([Completion(list(s.response_ids), list(s.rollout_log_probs), "stop", s.text)
                           for s in mine])
        return groups

    def push_weights(self, buckets, step):
        from dsrl.rollout.buckets import unpack

        self.pushed.append((step, {k: v.clone() for b in buckets for k, v in unpack(b)}))
        return 0.0


class FakeSource:
    """PROMPTS[0..n) in order, answer "1.0": the verifier (text == answer) turns each sample's
    text "1.0"/"0.0" back into its reward."""

    def sample_train(self, n, rng):
        return [user_prompt(PROMPTS[i], "1.0") for i in range(n)]


def make_trainer(cfg: Config, actor, tokenizer, run_dir, *, ref=None, samples=()) -> Trainer:
    """The real Trainer around real engines; the FakeWorker/FakeSource only matter for `step()`."""
    return Trainer(cfg, actor=actor, ref=ref, worker=FakeWorker(samples), tokenizer=tokenizer,
                   source=FakeSource(), verifier=lambda text, p: float(text == p.answer),
                   prompt_ids_fn=lambda p: tokenizer.encode(p.messages[0]["content"], add_special_tokens=False),
                   decision=decide_reuse(cfg), run_dir=str(run_dir))


def plain_model(model_path):
    """The same checkpoint as a plain transformers model (no DeepSpeed): the independent
    reference for gradients. Never stepped."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="eager")
    model.train()  # dropout is 0 in this config: same numbers as eval
    return model


def response_log_probs(model, samples: Sequence[Sample]) -> list[torch.Tensor]:
    """Log-prob of each response token, one unpadded sample at a time, with gradient."""
    out = []
    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        logits = model(input_ids=ids).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(lp[len(s.prompt_ids) - 1:])
    return out


def reference_update(model, samples: Sequence[Sample], loss_fn) -> dict[str, torch.Tensor]:
    """The first AdamW step the engine should take for the scalar `loss_fn(log_probs)`:
    -LR * g / (|g| + ADAM_EPS) (bias-corrected moments of one step are g and |g|), with g
    from autograd on the plain model."""
    model.zero_grad(set_to_none=True)
    loss_fn(response_log_probs(model, samples)).backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = -LR * g / (g.abs() + ADAM_EPS)
    model.zero_grad(set_to_none=True)
    return out


def params(engine: ActorEngine) -> dict[str, torch.Tensor]:
    return engine.state_dict_for_export()


def update(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: after[k] - before[k] for k in before}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"different parameter names: {sorted(set(a) ^ set(b))}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact, naming the first differing parameter."""
    if set(a) != set(b):
        raise AssertionError(f"different parameter names: {sorted(set(a) ^ set(b))}")
    for k, v in a.items():
        if not torch.equal(v, b[k]):
            raise AssertionError(f"{k}: max abs diff {float((v - b[k]).abs().max()):.3e}")
