"""Trainer-level tests on the real tiny DeepSpeed engine (random-init Llama around the SmolLM2
tokenizer, float32): training log-prob reuse on/off make the same update (ZeRO 0 and 3); the KL
loss against a reference model that differs from the actor is measured and reaches the gradient;
each aggregation mode's pg_loss and parameter update match a hand computation (python loops over
samples and tokens; gradients by autograd on a plain transformers model); the zero-advantage skip
keeps the update exactly for ppo and is refused where it would not (sft, MIS batch-normalize).
Only the rollout worker is a fake (tests/trainer/_real_engine.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from _real_engine import (MAX_NEW_TOKENS, assert_params_equal, build_engine, grpo_advantages, make_cfg,
                          make_samples, make_trainer, max_abs_diff, params, plain_model, reference_update,
                          response_log_probs, score_samples, update, with_rollout_log_probs)

# ~25 s together on a quiet machine (each test a few seconds; ~90 s when the 2 cores are shared).
pytestmark = pytest.mark.slow

# Three groups of three; the last has equal rewards (all-zero GRPO advantages).
REWARDS = [[1, 0, 0], [1, 1, 0], [0, 0, 0]]
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum")
# Per-token "rollout - trainer" log-prob offsets: PPO ratios exp(-offset) of 0.61, 1.35, 0.95,
# 1.57, 0.74, 1.11 and 1.0, both sides of the [0.8, 1.2] clip range and well away from its edges.
OFFSETS = (0.5, -0.3, 0.05, -0.45, 0.3, -0.1, 0.0)
EPS_CLIP = 0.2  # algo.eps_clip default


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def pad(tiny_tokenizer):
    return tiny_tokenizer.pad_token_id


@pytest.fixture(scope="module")
def base_lps(tiny_model_path, tiny_tokenizer, pad):
    """The 9 responses' log-probs under the initial weights, scored once by a real engine: the
    rollout log-probs of a rollout engine holding the trainer's weights."""
    samples = make_samples(tiny_tokenizer, REWARDS)
    return score_samples(build_engine(tiny_model_path, trainable=False), samples, pad)


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    return plain_model(tiny_model_path)


@pytest.fixture(scope="module")
def ref_path(tiny_model_path, tmp_path_factory):
    """A perturbed copy of the tiny model: a reference policy that really differs from the actor."""
    model = plain_model(tiny_model_path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("ref") / "tiny-ref"
    model.save_pretrained(str(out))
    return out


# ---------------------------------------------------------------------------- hand computations
def aggregate(mode, rows):
    """loss_agg_mode by hand over rows[i][t] (every sample of the optimizer step, skipped or not)."""
    n = len(rows)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / n
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / n
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in rows) / (n * MAX_NEW_TOKENS)
    if mode == "sum":
        return sum(sum(r) for r in rows)
    raise ValueError(mode)


def ppo_tokens(lps, olds, advs):
    """Clipped PPO loss of each token, max(-r*A, -clip(r, 0.8, 1.2)*A) with r = exp(lp - old),
    and whether the clipped branch won."""
    rows, clipped = [], []
    for lp, old, a in zip(lps, olds, advs, strict=True):
        row, crow = [], []
        for t in range(len(lp)):
            r = torch.exp(lp[t] - old[t])
            plain_pg = -r * a
            clip_pg = -torch.clamp(r, 1 - EPS_CLIP, 1 + EPS_CLIP) * a
            row.append(torch.maximum(plain_pg, clip_pg))
            crow.append(bool(clip_pg > plain_pg))
        rows.append(row)
        clipped.append(crow)
    return rows, clipped


def low_var_kl_tokens(lps, refs):
    """exp(ref - lp) - (ref - lp) - 1 per token, ref - lp clamped to [-20, 20], output to [-10, 10]."""
    rows = []
    for lp, ref in zip(lps, refs, strict=True):
        row = []
        for t in range(len(lp)):
            d = torch.clamp(ref[t] - lp[t], -20.0, 20.0)
            row.append(torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0))
        rows.append(row)
    return rows


def detached(lps):
    return [lp.detach() for lp in lps]


def assert_update_close(got, want, rel=1e-4):
    """Engine update vs the autograd reference: both are ~ -0.1 * gradient (see _real_engine)."""
    scale = max(float(v.abs().max()) for v in want.values())
    for k, w in want.items():
        diff = float((got[k] - w).abs().max())
        assert diff <= rel * scale, f"{k}: max abs diff {diff:.3e} vs update scale {scale:.3e}"


def count_calls(engine, name="score"):
    """Spy on a real engine method: the list grows by one per call."""
    calls, real = [], getattr(engine, name)

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    setattr(engine, name, spy)
    return calls


@dataclass
class StepRun:
    trainer: object
    metrics: dict
    before: dict  # parameters before the step
    after: dict  # ... and after it
    old_passes: int  # standalone old-policy passes (actor.score calls) during the step

    @property
    def update(self) -> dict:
        return update(self.before, self.after)


def run_step(tiny_model_path, tok, run_dir, cfg, samples, *, ref=None, force_skip=None, via_step=False) -> StepRun:
    """One training step of the real Trainer on a fresh real engine."""
    actor = build_engine(tiny_model_path, zero_stage=cfg.actor.zero_stage,
                         micro_batch_size=cfg.actor.micro_batch_size)
    before = params(actor)
    trainer = make_trainer(cfg, actor, tok, run_dir, ref=ref, samples=samples)
    if force_skip is not None:
        trainer.scoring.skip_zero_advantage = force_skip
    old_passes = count_calls(actor)
    metrics = trainer.step(1) if via_step else trainer.train_on(samples, 1)
    return StepRun(trainer, metrics, before, params(actor), len(old_passes))


# ---------------------------------------------------------------------------- 2. reuse on == off
INFORMATIVE = [[1, 0, 0], [1, 1, 0], [0, 1, 0]]  # every group has signal: nothing is skipped


def _offsets(samples, shift):
    """OFFSETS laid over the response tokens, starting at a different place for each sample."""
    return [[OFFSETS[(shift * i + t) % len(OFFSETS)] for t in range(len(s.response_ids))]
            for i, s in enumerate(samples)]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_reuse_on_and_off_make_the_same_update(tiny_model_path, tiny_tokenizer, base_lps, tmp_path, zero_stage):
    samples = make_samples(tiny_tokenizer, INFORMATIVE, base_lps)
    off, on = (run_step(tiny_model_path, tiny_tokenizer, tmp_path / mode,
                        make_cfg(tiny_model_path, zero_stage=zero_stage, reuse_logprobs=mode), samples, via_step=True)
               for mode in ("off", "on"))
    assert (off.trainer.decision.reuse, off.old_passes) == (False, 1)  # the standalone old pass ran
    assert (on.trainer.decision.reuse, on.old_passes) == (True, 0)  # ... and was skipped under reuse
    assert_params_equal(off.before, on.before)
    # Bit-exact: the old pass and the training forward see the same microbatch shapes, so the
    # old log-probs equal the training ones and ratio, loss, gradient and AdamW step all agree.
    assert_params_equal(off.after, on.after)
    for key in ("train/loss", "train/pg_loss", "train/ppo_kl", "train/pg_clipfrac", "train/entropy",
                "train/logprob", "train/grad_norm"):
        assert on.metrics[key] == off.metrics[key], key
    # The update is real, and it is what the rollout worker received.
    assert max(float(v.abs().max()) for v in on.update.values()) > 1e-3
    assert [step for step, _ in on.trainer.worker.pushed] == [1]
    assert_params_equal(on.trainer.worker.pushed[0][1], on.after)


def test_ppo_kl_is_measured_when_old_differs(tiny_model_path, tiny_tokenizer, base_lps, tmp_path):
    """Sanity arm: with rollout log-probs as the old policy, offset from the trainer's by known
    amounts, ppo_kl = token-mean(old - lp) = token-mean(offset) is non-zero."""
    samples = make_samples(tiny_tokenizer, INFORMATIVE)
    offs = _offsets(samples, 3)
    samples = with_rollout_log_probs(samples, base_lps, offs)
    cfg = make_cfg(tiny_model_path, reuse_logprobs="on", use_rollout_logprobs=True)
    run = run_step(tiny_model_path, tiny_tokenizer, tmp_path, cfg, samples)
    want = aggregate("token-mean", offs)
    assert abs(want) > 0.01
    assert run.metrics["train/ppo_kl"] == pytest.approx(want, abs=1e-5)
    abs_offs = [[abs(o) for o in row] for row in offs]
    assert run.metrics["rollout/logprob_diff"] == pytest.approx(aggregate("token-mean", abs_offs), abs=1e-5)
    assert run.metrics["train/pg_clipfrac"] > 0
    assert max(float(v.abs().max()) for v in run.update.values()) > 1e-3


# ---------------------------------------------------------------------------- 3. KL loss
@pytest.mark.parametrize("reuse", ["on", "off"])
def test_kl_loss_is_measured_and_reaches_the_gradient(tiny_model_path, tiny_tokenizer, base_lps, plain, ref_path,
                                                      tmp_path, pad, reuse):
    samples = make_samples(tiny_tokenizer, REWARDS, base_lps)
    ref = build_engine(ref_path, trainable=False)
    ref_lps = score_samples(ref, samples, pad)
    advs = grpo_advantages(REWARDS)
    coef = 0.1
    hand_kl = float(aggregate("token-mean", low_var_kl_tokens(base_lps, ref_lps)))
    assert hand_kl > 0.05  # ref != old: a KL "synthesized" as zero would fail below

    cfg = make_cfg(tiny_model_path, reuse_logprobs=reuse, use_kl_loss=True, kl_loss_coef=coef)
    ref_passes = count_calls(ref)
    run = run_step(tiny_model_path, tiny_tokenizer, tmp_path / "kl", cfg, samples, ref=ref)
    m = run.metrics
    assert run.trainer.decision.reuse is (reuse == "on") and run.old_passes == int(reuse == "off")
    assert len(ref_passes) == 1  # the reference pass runs (once) even when the old pass is skipped
    assert m["train/kl_loss"] == pytest.approx(hand_kl, rel=1e-5)
    assert m["train/loss"] == pytest.approx(m["train/pg_loss"] + coef * hand_kl, rel=1e-5)
    assert m["train/trained_fraction"] == 1.0  # the equal-reward group still pays KL: not skipped

    # Without the KL term (use_kl_loss=false) the same step moves the weights differently ...
    cfg0 = make_cfg(tiny_model_path, reuse_logprobs=reuse)
    no_kl = run_step(tiny_model_path, tiny_tokenizer, tmp_path / "nokl", cfg0, samples)
    assert "train/kl_loss" not in no_kl.metrics
    assert no_kl.metrics["train/pg_loss"] == pytest.approx(m["train/pg_loss"], rel=1e-6)
    assert max_abs_diff(run.update, no_kl.update) > 1e-4

    # ... and the update with it is the AdamW step of the hand loss pg + coef * KL.
    refs = [r.double() for r in ref_lps]

    def hand_loss(lps):
        pg, _ = ppo_tokens(lps, detached(lps), advs)  # first step: old == current policy
        return aggregate("token-mean", pg) + coef * aggregate("token-mean", low_var_kl_tokens(lps, refs))
    assert_update_close(run.update, reference_update(plain, samples, hand_loss))


# ---------------------------------------------------------------------------- 4. aggregation modes
@pytest.mark.parametrize("old_policy", ["reused", "rollout_offset"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_pg_loss_and_update_match_hand_aggregation(tiny_model_path, tiny_tokenizer, base_lps, plain, tmp_path,
                                                   mode, old_policy):
    samples = make_samples(tiny_tokenizer, REWARDS, base_lps)
    advs = grpo_advantages(REWARDS)
    algo = {"loss_agg_mode": mode, "reuse_logprobs": "on"}
    if old_policy == "rollout_offset":  # old = rollout log-probs != lp: ratios off 1, clipping matters
        samples = with_rollout_log_probs(samples, base_lps, _offsets(samples, 1))
        fixed_old = [torch.tensor(s.rollout_log_probs, dtype=torch.float64) for s in samples]
        algo["use_rollout_logprobs"] = True

        def olds(lps):
            return fixed_old
    else:
        olds = detached  # the reused training log-probs: ratio exactly 1
    # micro_batch_size 4: the 6 trained samples (the equal-reward group is skipped, exactly, but
    # stays in the denominators) go through 2 microbatches.
    run = run_step(tiny_model_path, tiny_tokenizer, tmp_path, make_cfg(tiny_model_path, **algo), samples)

    with torch.no_grad():
        lps = [lp.double() for lp in response_log_probs(plain, samples)]
    rows, clipped = ppo_tokens(lps, olds(lps), advs)
    want = float(aggregate(mode, rows))
    if old_policy == "reused":  # ratio 1: the pg loss of every token is -A
        minus_a = [[-a] * len(lp) for a, lp in zip(advs, lps, strict=True)]
        assert want == pytest.approx(aggregate(mode, minus_a), abs=1e-12)
    else:
        assert sum(map(sum, clipped)) >= 5
        unclipped = float(aggregate(mode, [[-torch.exp(lp[t] - old[t]) * a for t in range(len(lp))]
                                           for lp, old, a in zip(lps, olds(lps), advs, strict=True)]))
        assert abs(unclipped - want) > 1e-3  # the clip changes the number the trainer must match
    assert run.metrics["train/pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert run.metrics["train/microbatches"] == 2

    def hand_loss(lps):
        pg, _ = ppo_tokens(lps, olds(lps), advs)
        return aggregate(mode, pg)
    assert_update_close(run.update, reference_update(plain, samples, hand_loss))


# ---------------------------------------------------------------------------- 5. zero-advantage skip
SKIP_REWARDS = [[1, 0, 0], [1, 1, 1]]  # one informative group, one of equal rewards (advantages all 0)


def _skip_samples(tok, base_lps, zero_group_offset=0.0):
    samples = make_samples(tok, SKIP_REWARDS)
    offs = [[zero_group_offset if s.group == 1 else 0.0] * len(s.response_ids) for s in samples]
    return with_rollout_log_probs(samples, base_lps[:len(samples)], offs)


def test_zero_advantage_skip_is_exact_for_ppo(tiny_model_path, tiny_tokenizer, base_lps, tmp_path):
    samples = _skip_samples(tiny_tokenizer, base_lps)
    # micro_batch_size 3, one group per microbatch: both runs forward the informative group as the
    # same microbatch (same shapes, same kernels); without the skip a second one holds the
    # zero-advantage group. (Mixing the groups in one padded microbatch would change its shape, and
    # kernels are bit-identical only for identical shapes.)
    skip = run_step(tiny_model_path, tiny_tokenizer, tmp_path / "skip",
                    make_cfg(tiny_model_path, groups=2, micro_batch_size=3, reuse_logprobs="on"), samples)
    full = run_step(tiny_model_path, tiny_tokenizer, tmp_path / "noskip",
                    make_cfg(tiny_model_path, groups=2, micro_batch_size=3, reuse_logprobs="on",
                             skip_zero_variance_groups=False), samples)
    assert skip.trainer.scoring.skip_zero_advantage is True
    assert (skip.metrics["train/microbatches"], full.metrics["train/microbatches"]) == (1, 2)
    lens = [len(s.response_ids) for s in samples]
    assert skip.metrics["train/trained_fraction"] == pytest.approx(sum(lens[:3]) / sum(lens))
    assert full.metrics["train/trained_fraction"] == 1.0
    # Bit-exact: microbatch 1 is the same computation in both runs, and the zero-advantage one adds
    # exact zeros to the loss and the gradient (its dloss/dlp is 0: every term is a multiple of
    # A = 0, the ratio exactly 1 under reuse); so the AdamW step is unchanged.
    assert_params_equal(skip.after, full.after)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert skip.metrics[key] == full.metrics[key], key
    assert max(float(v.abs().max()) for v in skip.update.values()) > 1e-3


@pytest.mark.parametrize("objective", ["sft", "ppo_mis_batch_normalize"])
def test_zero_advantage_skip_refused_where_inexact(tiny_model_path, tiny_tokenizer, base_lps, tmp_path, objective):
    """sft imitates every sample whatever its advantage; MIS batch-normalize divides by the mean
    weight of the microbatch's tokens, zero-advantage ones included. Skipping would change both."""
    if objective == "sft":
        algo = {"policy_loss": "sft", "reuse_logprobs": "off"}
        samples = _skip_samples(tiny_tokenizer, base_lps)
    else:  # trainer-scored old log-probs (reuse off) vs rollout ones: the zero group's MIS weight is
        # exp(0.4) = 1.49, the informative group's 1, so the mean over microbatch 1 is > 1
        algo = {"reuse_logprobs": "off", "use_tis": True, "tis_function": "mis", "mis_batch_normalize": True}
        samples = _skip_samples(tiny_tokenizer, base_lps, zero_group_offset=-0.4)
    cfg = make_cfg(tiny_model_path, groups=2, **algo)  # skip_zero_variance_groups=true (default)
    asked = run_step(tiny_model_path, tiny_tokenizer, tmp_path / "on", cfg, samples)
    full = run_step(tiny_model_path, tiny_tokenizer, tmp_path / "off",
                    make_cfg(tiny_model_path, groups=2, skip_zero_variance_groups=False, **algo), samples)
    assert asked.trainer.scoring.skip_zero_advantage is False  # asked for, but not exact here
    assert asked.metrics["train/trained_fraction"] == 1.0
    assert_params_equal(asked.after, full.after)
    # Forcing the skip changes the update: the comparison above can fail.
    forced = run_step(tiny_model_path, tiny_tokenizer, tmp_path / "forced", cfg, samples, force_skip=True)
    assert forced.metrics["train/trained_fraction"] < 1.0
    assert max_abs_diff(forced.update, full.update) > 1e-4
