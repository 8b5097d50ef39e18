"""algo.reuse_logprobs=adaptive on the real tiny DeepSpeed engine (float32), three optimizer steps
per rollout: the switch both ways.
- rollout log-probs that match the trainer (scored by a real engine with the same weights): the
  probe passes, only the probe's forward runs, old_log_probs are the rollout log-probs (bit-exact)
  and the whole update equals reuse off + use_rollout_logprobs (the same old policy, by config);
- perturbed rollout log-probs: the probe objects (log line, reuse/full_pass=1), the full pass
  runs, old_log_probs are the trainer's scores (bit-exact) and the update equals reuse off.
Only the rollout worker is a fake (tests/trainer/_real_engine.py)."""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from _real_engine import (assert_params_equal, build_engine, make_cfg, make_samples, make_trainer,  # noqa: E402
                          params, score_samples, with_rollout_log_probs)
from dsrl.actor.reuse_probe import probe_indices  # noqa: E402

pytestmark = pytest.mark.slow  # a few engines of the tiny model: ~20-40 s

REWARDS = [[1, 0, 0], [1, 1, 0], [0, 1, 0]]  # every group informative
STEPS = 3  # optimizer steps per rollout: one group each


@pytest.fixture(scope="module")
def base_lps(tiny_model_path, tiny_tokenizer):
    """The responses' log-probs under the initial weights: what a rollout engine holding the
    trainer's weights reports."""
    samples = make_samples(tiny_tokenizer, REWARDS)
    return score_samples(build_engine(tiny_model_path, trainable=False), samples, tiny_tokenizer.pad_token_id)


def adaptive_cfg(tiny_model_path, **algo):
    return make_cfg(tiny_model_path, num_steps_per_rollout=STEPS, global_batch_size=9 // STEPS, **algo)


def run(tiny_model_path, tok, tmp_path, cfg, samples):
    """Fresh engine + trainer; returns (trainer, metrics, params before, params after, score calls)."""
    actor = build_engine(tiny_model_path, micro_batch_size=cfg.actor.micro_batch_size)
    trainer = make_trainer(cfg, actor, tok, tmp_path, samples=samples)
    calls, real = [], actor.score

    def spy(mbs, **k):
        mbs = list(mbs)
        calls.append(sum(int(mb["loss_mask"].shape[0]) for mb in mbs))  # rows scored
        return real(mbs, **k)
    actor.score = spy
    before = params(actor)
    metrics = trainer.train_on(samples, 1)
    return trainer, metrics, before, params(actor), calls


def test_probe_passes_and_rollout_log_probs_are_the_old_policy(tiny_model_path, tiny_tokenizer, base_lps, tmp_path):
    samples = make_samples(tiny_tokenizer, REWARDS, base_lps)
    cfg = adaptive_cfg(tiny_model_path, reuse_logprobs="adaptive")
    trainer, metrics, before, after, calls = run(tiny_model_path, tiny_tokenizer, tmp_path / "a", cfg, samples)
    assert trainer.decision.probe and not trainer.decision.run_old_pass
    assert calls == [2]  # only the probe: ceil(0.125 * 9) sequences, no full pass
    assert metrics["reuse/full_pass"] == 0.0
    assert 0.0 <= metrics["reuse/probe_abs_diff"] < 1e-5  # same weights; 2-row probe vs 9-row batch: fp32 round-off
    assert metrics["reuse/probe_tokens"] > 0

    # The old policy handed to the loss is the rollout log-probs, bit for bit.
    trainer2 = make_trainer(cfg, build_engine(tiny_model_path), tiny_tokenizer, tmp_path / "b", samples=samples)
    rollout = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
    old, m = trainer2.scoring._old_policy_by_probe(samples, rollout, 1)
    assert m["reuse/full_pass"] == 0.0
    assert all(torch.equal(o, r) for o, r in zip(old, rollout, strict=True))

    # ... so the three optimizer steps equal those with the rollout log-probs as old policy by config.
    ref_cfg = adaptive_cfg(tiny_model_path, reuse_logprobs="off", use_rollout_logprobs=True)
    _, ref_metrics, ref_before, ref_after, ref_calls = run(tiny_model_path, tiny_tokenizer, tmp_path / "c", ref_cfg,
                                                           samples)
    assert ref_calls == []
    assert_params_equal(before, ref_before)
    # Bit-exact: the same training microbatches with the same old-policy values (the probe only reads).
    assert_params_equal(after, ref_after)
    assert metrics["train/loss"] == ref_metrics["train/loss"]
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-3  # a real update


def test_probe_objects_and_the_full_pass_runs(tiny_model_path, tiny_tokenizer, base_lps, tmp_path, caplog):
    samples = make_samples(tiny_tokenizer, REWARDS)
    # Rollout log-probs off by +-0.3 per token: mean |dlogp| 0.3 > the 0.02 default threshold.
    offsets = [[0.3 if (i + t) % 2 else -0.3 for t in range(len(s.response_ids))] for i, s in enumerate(samples)]
    samples = with_rollout_log_probs(samples, base_lps, offsets)
    cfg = adaptive_cfg(tiny_model_path, reuse_logprobs="adaptive")
    with caplog.at_level(logging.INFO, logger="dsrl"):
        trainer, metrics, before, after, calls = run(tiny_model_path, tiny_tokenizer, tmp_path / "a", cfg, samples)
    assert calls == [2, 9]  # the probe, then the full pass over every sequence
    assert metrics["reuse/full_pass"] == 1.0
    assert metrics["reuse/probe_abs_diff"] == pytest.approx(0.3, abs=1e-5)
    # d = trainer - rollout = -offset on the probed tokens: k3 = mean(exp(-o) - 1 + o), by hand.
    probed = probe_indices(9, cfg.algo.reuse_probe_fraction, seed=cfg.data.seed, step=1)
    offs = [o for i in probed for o in offsets[i]]
    assert metrics["reuse/probe_k3_kl"] == pytest.approx(sum(math.exp(-o) - 1 + o for o in offs) / len(offs), abs=1e-5)
    assert any("full old-policy pass this step" in r.getMessage() for r in caplog.records)

    # The old policy handed to the loss is the trainer's own scoring pass, bit for bit.
    trainer2 = make_trainer(cfg, build_engine(tiny_model_path), tiny_tokenizer, tmp_path / "b", samples=samples)
    rollout = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
    old, m = trainer2.scoring._old_policy_by_probe(samples, rollout, 1)
    scored = trainer2.scoring.score(trainer2.actor, samples, "check")
    assert m["reuse/full_pass"] == 1.0
    assert all(torch.equal(o, s) for o, s in zip(old, scored, strict=True))  # the same score call twice
    assert not torch.equal(old[0], rollout[0])

    # ... so the update equals reuse off (the standalone old-policy pass every step).
    off_cfg = adaptive_cfg(tiny_model_path, reuse_logprobs="off")
    _, off_metrics, off_before, off_after, off_calls = run(tiny_model_path, tiny_tokenizer, tmp_path / "c", off_cfg,
                                                           samples)
    assert off_calls == [9]
    assert_params_equal(before, off_before)
    # Bit-exact: both full passes score the same microbatches, then train the same ones.
    assert_params_equal(after, off_after)
    assert metrics["train/loss"] == off_metrics["train/loss"]


def test_zero_threshold_with_exact_log_probs_still_passes_or_reports(tiny_model_path, tiny_tokenizer, base_lps,
                                                                     tmp_path):
    """Threshold 0 objects to any kernel difference at all; the metric says which happened and
    the decision follows it (no hidden tolerance)."""
    samples = make_samples(tiny_tokenizer, REWARDS, base_lps)
    cfg = adaptive_cfg(tiny_model_path, reuse_logprobs="adaptive", reuse_max_mismatch=0.0)
    _, metrics, _, _, calls = run(tiny_model_path, tiny_tokenizer, tmp_path, cfg, samples)
    full = metrics["reuse/probe_abs_diff"] > 0.0
    assert metrics["reuse/full_pass"] == float(full)
    assert calls == ([2, 9] if full else [2])
