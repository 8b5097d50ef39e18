"""algo.reuse_logprobs=adaptive, the parts without a model: which decision each config gets
(exact reuse where it applies, else the probe, else a full pass every step named by its blocker),
the config checks, the reproducible probe sample, and the mismatch numbers against hand values."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsrl.actor.reuse_probe import (DEFAULT_MAX_MISMATCH, judge, max_mismatch, mismatch_sums,
                                    missing_rollout_log_probs, probe_indices)
from dsrl.config.schema import Config
from dsrl.errors import ConfigError
from dsrl.validation.reuse import decide_reuse, reuse_for_model
from dsrl.validation.validate import validate


def cfg_with(**algo) -> Config:
    cfg = Config()
    rollout = {k[len("rollout_"):]: algo.pop(k) for k in list(algo) if k.startswith("rollout_")}
    cfg.algo = dataclasses.replace(cfg.algo, **{"reuse_logprobs": "adaptive", **algo})
    cfg.rollout = dataclasses.replace(cfg.rollout, **rollout)
    return cfg


# ---------------------------------------------------------------------------- decisions
def test_adaptive_uses_exact_reuse_for_one_step_per_rollout():
    d = decide_reuse(cfg_with())  # defaults: 64 samples, global batch 64 -> one step
    assert (d.reuse, d.run_old_pass, d.probe) == (True, False, False)


def test_adaptive_probes_beyond_one_step():
    d = decide_reuse(cfg_with(num_steps_per_rollout=4, global_batch_size=16))
    assert (d.reuse, d.run_old_pass, d.probe) == (False, False, True)
    assert "algo.num_steps_per_rollout" in d.reason and "reuse_max_mismatch=0.001" in d.reason  # fp32 default


def test_threshold_defaults_by_rollout_dtype():
    assert max_mismatch(cfg_with(rollout_dtype="float32")) == DEFAULT_MAX_MISMATCH["float32"] == 1e-3
    assert max_mismatch(cfg_with(rollout_dtype="bfloat16")) == DEFAULT_MAX_MISMATCH["bfloat16"]
    assert DEFAULT_MAX_MISMATCH["bfloat16"] > DEFAULT_MAX_MISMATCH["float32"]
    assert max_mismatch(cfg_with(rollout_dtype="auto")) == 1e-3  # unresolved: the strict one
    assert max_mismatch(cfg_with(rollout_dtype="bfloat16", reuse_max_mismatch=0.0)) == 0.0  # explicit wins


@pytest.mark.parametrize("change, key", [
    ({"rollout_top_p": 0.9}, "rollout.top_p"),
    ({"use_tis": True}, "algo.use_tis"),
    ({"off_policy_steps": 1, "use_tis": True}, "algo.off_policy_steps"),
])
def test_adaptive_blockers_run_the_full_pass_every_step(change, key):
    d = decide_reuse(cfg_with(num_steps_per_rollout=2, global_batch_size=32, **change))
    assert (d.reuse, d.run_old_pass, d.probe) == (False, True, False)
    assert "full old-policy pass every step" in d.reason and key in d.reason


def test_adaptive_with_rollout_logprobs_needs_no_probe():
    d = decide_reuse(cfg_with(num_steps_per_rollout=2, global_batch_size=32, use_rollout_logprobs=True))
    assert (d.reuse, d.run_old_pass, d.probe) == (False, False, False)


def test_adaptive_falls_back_to_the_probe_when_the_model_is_stochastic():
    cfg = cfg_with()
    d = reuse_for_model(decide_reuse(cfg), cfg, torch.nn.Sequential(torch.nn.Dropout(0.1)))
    assert (d.reuse, d.run_old_pass, d.probe) == (False, False, True)
    assert "exact reuse ruled out by model module" in d.reason


def test_adaptive_config_checks_name_the_key():
    validate(cfg_with(num_steps_per_rollout=2, global_batch_size=32))  # a good one passes (threshold null)
    validate(cfg_with(num_steps_per_rollout=2, global_batch_size=32, reuse_max_mismatch=0.0))
    for key, bad in (("reuse_probe_fraction", 0.0), ("reuse_probe_fraction", 1.5), ("reuse_max_mismatch", -0.1),
                     ("reuse_max_mismatch", float("nan"))):
        with pytest.raises(ConfigError, match=f"algo.{key}="):
            validate(cfg_with(**{key: bad}))
    with pytest.raises(ConfigError, match="adaptive"):  # the allowed values are listed
        validate(cfg_with(reuse_logprobs="sometimes"))


# ---------------------------------------------------------------------------- the probe
def test_probe_indices_are_reproducible_and_sized():
    a = probe_indices(64, 0.125, seed=3, step=5)
    assert a == probe_indices(64, 0.125, seed=3, step=5) and len(a) == 8 and a == sorted(set(a))
    assert all(0 <= i < 64 for i in a)
    assert a != probe_indices(64, 0.125, seed=3, step=6)  # a different sample each step
    assert a != probe_indices(64, 0.125, seed=3, step=5, rank=1)
    assert len(probe_indices(9, 0.125, seed=0, step=1)) == 2  # ceil(1.125)
    assert len(probe_indices(4, 0.01, seed=0, step=1)) == 1  # at least one
    assert probe_indices(5, 1.0, seed=0, step=1) == [0, 1, 2, 3, 4]
    assert probe_indices(0, 0.5, seed=0, step=1) == []


def test_mismatch_numbers_by_hand():
    trainer = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    rollout = [torch.tensor([-1.25, -1.5]), torch.tensor([-0.5])]
    abs_sum, k3_sum, tokens = mismatch_sums(trainer, rollout)
    # d = trainer - rollout = 0.25, -0.5, 0; k3 = exp(d) - 1 - d
    assert tokens == 3 and abs_sum == pytest.approx(0.75, abs=1e-12)
    want_k3 = (math.exp(0.25) - 1.25) + (math.exp(-0.5) - 0.5)
    assert k3_sum == pytest.approx(want_k3, rel=1e-12)
    ok = judge([abs_sum, k3_sum, tokens], 0.26)
    assert not ok.full_pass and ok.abs_diff == pytest.approx(0.25) and ok.k3_kl == pytest.approx(want_k3 / 3)
    assert ok.metrics()["reuse/full_pass"] == 0.0 and ok.metrics()["reuse/probe_tokens"] == 3.0
    bad = judge([abs_sum, k3_sum, tokens], 0.24)
    assert bad.full_pass and bad.metrics()["reuse/full_pass"] == 1.0 and "> algo.reuse_max_mismatch=0.24" in bad.reason


def test_non_finite_mismatch_forces_the_full_pass():
    sums = mismatch_sums([torch.tensor([-1.0])], [torch.tensor([float("nan")])])
    assert judge(sums, 1e9).full_pass
    sums = mismatch_sums([torch.tensor([-1.0])], [torch.tensor([float("-inf")])])
    assert judge(sums, 1e9).full_pass
    assert not judge([0.0, 0.0, 0.0], 0.0).full_pass  # nothing probed (empty responses): nothing to object to


def test_missing_rollout_log_probs_are_found():
    assert missing_rollout_log_probs([2, 1], [torch.zeros(2), torch.zeros(1)]) is None
    assert missing_rollout_log_probs([2, 3], [torch.zeros(2), torch.zeros(0)]) == 1
    with pytest.raises(ValueError, match="shape"):
        mismatch_sums([torch.zeros(2)], [torch.zeros(3)])
