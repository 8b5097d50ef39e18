"""The loss of episodes with environment tokens, hand-checked through the real Trainer.train_on
on a real DeepSpeed engine (tiny model, float32), on hand-made episodes (model turn, environment
answer, model turn; tests/agent/agent_trainer_kit.episode_samples):

- token-mean divides by the number of MODEL tokens and sums only over them: the parameter
  update equals the AdamW step of the hand loss -(1/N_model) sum_i sum_{t model} w_t A_i ratio_t
  (gradient by autograd on a plain transformers model), and a hand loss whose denominator also
  counts environment tokens gives a different update (the check can fail);
- per-episode advantages: GRPO (r - group mean) / (unbiased std + 1e-6) and RLOO r - mean of
  the others, one reward per episode, by hand;
- reuse on / auto (no old-policy pass) and off + TIS (w_t = min(exp(old - rollout), tis_clip)
  at model tokens, rollout log-probs shifted by hand) give those updates;
- the shared-prompt layout and the dense layout give the same log-probs and loss masks with
  environment tokens present, and the same update."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from agent_trainer_kit import (Spy, agent_cfg, build_actor, build_trainer, episode_samples, max_abs_diff,
                               plain_model, reference_update, response_log_probs)
from dsrl.actor.batch import collate, masked_rows
from dsrl.actor.masks import response_loss_mask
from dsrl.actor.shared_prompt import collate_shared_prompt

pytestmark = pytest.mark.slow  # a real engine per case (~5-10 s each on 2 shared cores)

REWARDS = [[1.0, 0.0, 0.5], [1.0, 1.0, 0.0]]
TIS_OFFSETS = (0.4, -0.9, 0.1, -0.2, 1.2)  # rollout = exact + offset at model tokens: w = exp(-offset)


def _advantages(kind: str) -> list:
    out = []
    for group in REWARDS:
        n, mean = len(group), sum(group) / len(group)
        if kind == "grpo":
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
            out += [(r - mean) / (std + 1e-6) for r in group]
        else:  # rloo
            out += [r - (sum(group) - r) / (n - 1) for r in group]
    return out


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    return plain_model(tiny_model_path)


@pytest.fixture(scope="module")
def exact(plain, tiny_tokenizer):
    """Each hand-made episode with its exact log-probs (the initial weights) as rollout log-probs
    at model tokens, 0.0 at environment tokens."""
    samples = episode_samples(tiny_tokenizer, REWARDS)
    with torch.no_grad():
        lps = response_log_probs(plain, samples)
    for s, lp in zip(samples, lps):
        mask = response_loss_mask(s)
        s.rollout_log_probs = [float(v) * float(m) for v, m in zip(lp, mask)]
    return samples


def _with_offsets(samples):
    out = []
    for i, s in enumerate(samples):
        mask = s.extra["model_mask"]
        rl = [v + (TIS_OFFSETS[(i + t) % len(TIS_OFFSETS)] if m else 0.0)
              for t, (v, m) in enumerate(zip(s.rollout_log_probs, mask))]
        out.append(dataclasses.replace(s, rollout_log_probs=rl))
    return out


def _hand_loss(samples, adv, *, tis_clip=None, count_env_tokens=False):
    """-(1/N) sum_i sum_{t model} w_t A_i exp(lp_t - sg(lp_t)); N = model tokens (or all
    response tokens when count_env_tokens: the wrong denominator)."""
    masks = [response_loss_mask(s) for s in samples]
    n = sum(len(m) if count_env_tokens else float(m.sum()) for m in masks)

    def loss(lps):
        total = 0.0
        for s, a, m, lp in zip(samples, adv, masks, lps):
            ratio = torch.exp(lp - lp.detach())
            w = torch.ones_like(lp)
            if tis_clip is not None:
                w = torch.exp(lp.detach() - torch.tensor(s.rollout_log_probs)).clamp(max=tis_clip)
            total = total + (-(w * a * ratio) * m).sum()
        return total / n
    return loss


def _train(tmp_path, tiny_model_path, tok, samples, **kw):
    cfg = agent_cfg(tiny_model_path, groups=2, group_size=3, **kw)
    actor = build_actor(cfg)
    before = {k: v.clone() for k, v in actor.state_dict_for_export().items()}
    trainer = build_trainer(cfg, actor, tok, tmp_path)
    spy = Spy(trainer)
    metrics = trainer.train_on(samples, 1)
    after = actor.state_dict_for_export()
    return {k: after[k] - before[k] for k in before}, metrics, spy


def _assert_update_close(got, want, rel=1e-4):
    scale = max(float(v.abs().max()) for v in want.values())
    assert max_abs_diff(got, want) <= rel * scale, (max_abs_diff(got, want), scale)


@pytest.mark.parametrize("estimator, reuse, shared", [("grpo", "on", "on"), ("grpo", "on", "off"),
                                                      ("rloo", "auto", "on"), ("grpo", "off", "off")])
def test_token_mean_over_model_tokens(tmp_path, tiny_model_path, tiny_tokenizer, plain, exact, estimator, reuse,
                                      shared):
    upd, metrics, spy = _train(tmp_path, tiny_model_path, tiny_tokenizer, exact,
                               algo={"advantage_estimator": estimator, "reuse_logprobs": reuse},
                               actor={"shared_prompt": shared})
    old_passes = [d for d, _, _ in spy.scored if d == "actor forward"]
    assert len(old_passes) == (1 if reuse == "off" else 0)
    adv = _advantages(estimator)
    want = reference_update(plain, exact, _hand_loss(exact, adv))
    _assert_update_close(upd, want)
    # the same loss over all response tokens (env ones counted in the denominator) is not it
    wrong = reference_update(plain, exact, _hand_loss(exact, adv, count_env_tokens=True))
    assert max_abs_diff(upd, wrong) > 0.05 * max(float(v.abs().max()) for v in want.values())
    n_model = sum(float(response_loss_mask(s).sum()) for s in exact)
    pg = -sum(a * float(response_loss_mask(s).sum()) for s, a in zip(exact, adv)) / n_model
    assert metrics["train/pg_loss"] == pytest.approx(pg, abs=1e-6)
    assert metrics["rollout/logprob_diff"] < 1e-5  # rollout log-probs at model tokens are the engine's


def test_tis_per_token_at_model_tokens(tmp_path, tiny_model_path, tiny_tokenizer, plain, exact):
    shifted = _with_offsets(exact)
    upd, metrics, _ = _train(tmp_path, tiny_model_path, tiny_tokenizer, shifted,
                             algo={"reuse_logprobs": "off", "use_tis": True, "tis_clip": 2.0})
    adv = _advantages("grpo")
    _assert_update_close(upd, reference_update(plain, shifted, _hand_loss(shifted, adv, tis_clip=2.0)))
    # without the weights the update differs: TIS acted
    plain_upd = reference_update(plain, shifted, _hand_loss(shifted, adv))
    assert max_abs_diff(upd, plain_upd) > 0.05 * max(float(v.abs().max()) for v in plain_upd.values())


def test_shared_prompt_equals_dense_with_env_tokens(tiny_model_path, tiny_tokenizer, exact):
    """Scoring: per response token the same log-probs (fp32 round-off) in both layouts; the loss
    masks read back per response token are the model masks in both; env tokens score 0."""
    cfg = agent_cfg(tiny_model_path)
    actor = build_actor(cfg)
    pad = tiny_tokenizer.pad_token_id
    dense, shared = collate(exact, pad), collate_shared_prompt(exact, pad)
    assert shared["input_ids"].shape[0] == 2  # one packed row per group
    (lp_dense,), (lp_shared,) = actor.score([dense]), actor.score([shared])
    rows_dense = masked_rows(lp_dense, dense["response_mask"])
    rows_shared = masked_rows(lp_shared, shared["response_mask"])
    masks_dense = masked_rows(dense["loss_mask"], dense["response_mask"])
    masks_shared = masked_rows(shared["loss_mask"], shared["response_mask"])
    for s, d, sh, lm_d, lm_s in zip(exact, rows_dense, rows_shared, masks_dense, masks_shared):
        mask = response_loss_mask(s)
        assert torch.equal(lm_d, mask) and torch.equal(lm_s, mask)
        torch.testing.assert_close(sh, d, atol=2e-5, rtol=0)
        torch.testing.assert_close(d[mask.bool()], torch.tensor(s.rollout_log_probs)[mask.bool()], atol=1e-5, rtol=0)
        assert torch.equal(d[~mask.bool()], torch.zeros(int((~mask.bool()).sum())))
