"""rollout.sync_probe_every: the probe runs on pushes 0, N, 2N, ...; the train step checks the
pushes between on its sampled tokens (WeightSync.check_samples) and stops before the optimizer
step when they disagree; the schedule is refused by name where that check is not a sync check."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsrl.config.schema import Config, RolloutConfig
from dsrl.errors import ConfigError
from dsrl.rollout.weight_sync import SyncSchedule, WeightSync, WeightSyncError
from dsrl.validation.validate import validate


class _Actor:
    hf_config = SimpleNamespace(vocab_size=50)
    lora = None

    def weights_pushed(self):
        self.pushes = getattr(self, "pushes", 0) + 1

    def export_named_tensors(self, copy=False, device=None):
        yield "w", torch.arange(6, dtype=torch.float32)


class _Worker:
    name = "engine under test"

    def __init__(self):
        self.pushed = []

    def push_weights(self, buckets, step):
        self.pushed.append(step)
        return 0.0

    def probe_logprobs(self, token_id_lists):
        raise AssertionError("the probe itself is replaced in these tests")


def _sync(every: int, probe: bool = True) -> WeightSync:
    sync = WeightSync(_Actor(), _Worker(), dataclasses.replace(RolloutConfig(), dtype="float32", sync_probe=probe,
                                                               sync_probe_every=every))
    sync.probed = []
    sync.check = lambda step, count=True: (sync.probed.append(step), 1e-6)[1]
    return sync


def test_probe_runs_on_the_first_push_and_every_nth():
    sync = _sync(3)
    rows = [sync.push(step) for step in range(1, 8)]
    assert sync.worker.pushed == [1, 2, 3, 4, 5, 6, 7]  # every push loads the weights
    assert sync.probed == [1, 4, 7]
    assert [("rollout/sync_logprob_diff" in m) for m in rows] == [True, False, False, True, False, False, True]
    assert sync.checks_samples
    every = _sync(1)
    for step in range(1, 4):
        every.push(step)
    assert every.probed == [1, 2, 3] and not every.checks_samples
    assert not _sync(3, probe=False).checks_samples  # no probe at all: nothing to stand in for


def test_a_resumed_run_probes_the_steps_the_uninterrupted_one_does():
    """The schedule is loop state (dsrl.stages.state): restored, the resume's own push is probed
    but not counted, and the later pushes are probed where the uninterrupted run probes them."""
    full = _sync(3)
    for step in range(1, 8):
        full.push(step)
    first = _sync(3)
    for step in (1, 2, 3):
        first.push(step)
    resumed = _sync(3)
    resumed.schedule = SyncSchedule(**dataclasses.asdict(first.schedule))  # what a checkpoint carries
    assert "rollout/sync_logprob_diff" in resumed.push(3, scheduled=False)  # the resume's push: checked
    for step in range(4, 8):
        resumed.push(step)
    assert resumed.probed == [3, 4, 7] and full.probed[1:] == [4, 7]
    assert resumed.schedule == full.schedule


def test_check_samples_holds_the_mean_diff_to_the_tolerance():
    sync = _sync(4)
    assert sync.tolerance == 1e-3  # float32 default
    sync.check_samples(0.9e-3 * 100, 100, step=5)  # mean 9e-4: passes
    sync.check_samples(0.0, 0.0, step=5)  # nothing trained: nothing to check
    with pytest.raises(WeightSyncError, match=r"step 5: .*100 sampled tokens.*engine under test.*0\.002.*"
                                              r"rollout\.sync_tolerance=0\.001.*sync_probe_every=4"):
        sync.check_samples(0.2, 100, step=5)
    with pytest.raises(WeightSyncError):
        sync.check_samples(float("nan"), 100, step=5)


def _cfg(**rollout):
    cfg = Config()
    cfg.rollout = dataclasses.replace(cfg.rollout, **rollout)
    return cfg


def test_schedule_is_refused_where_the_step_cannot_check_the_sync():
    validate(_cfg(sync_probe_every=8))  # the default job: top_p 1, on-policy, one step per rollout
    with pytest.raises(ConfigError, match=r"rollout\.sync_probe_every=0 must be >= 1"):
        validate(_cfg(sync_probe_every=0))
    with pytest.raises(ConfigError, match=r"rollout\.sync_probe_every=8 .*rollout\.top_p=0\.9"):
        validate(_cfg(sync_probe_every=8, top_p=0.9))
    cfg = _cfg(sync_probe_every=8)
    cfg.algo = dataclasses.replace(cfg.algo, num_steps_per_rollout=2, global_batch_size=cfg.algo.global_batch_size // 2)
    with pytest.raises(ConfigError, match=r"rollout\.sync_probe_every=8 .*2 optimizer steps per rollout"):
        validate(cfg)
    cfg = _cfg(sync_probe_every=8)
    cfg.algo = dataclasses.replace(cfg.algo, off_policy_steps=1, use_rollout_logprobs=True)
    with pytest.raises(ConfigError, match=r"rollout\.sync_probe_every=8 .*algo\.off_policy_steps=1"):
        validate(cfg)


def test_auto_probes_every_32nd_push_where_the_step_checks_the_rest():
    """rollout.sync_probe_every=null (auto): 32 where the train step can check the pushes between on
    its samples, else 1 (the probe after every sync, 0.5-0.8 s of a ~6 s default step); an explicit
    value stands. WeightSync without the resolved value probes every push."""
    from dsrl.validation.validate import AUTO_PROBE_EVERY, probe_every

    assert AUTO_PROBE_EVERY == 32
    cfg = _cfg(sync_probe_every=None)
    validate(cfg)
    assert probe_every(cfg) == 32
    assert probe_every(_cfg(sync_probe_every=None, top_p=0.9)) == 1
    assert probe_every(_cfg(sync_probe_every=1)) == 1 and probe_every(_cfg(sync_probe_every=4)) == 4
    off = _cfg(sync_probe_every=None)
    off.algo = dataclasses.replace(off.algo, off_policy_steps=1, use_rollout_logprobs=True)
    assert probe_every(off) == 1
    validate(off)  # null is never a schedule the config cannot check
    sync = WeightSync(_Actor(), _Worker(), dataclasses.replace(RolloutConfig(), dtype="float32"),
                      probe_every=probe_every(cfg))
    assert sync.probe_every == 32 and sync.checks_samples
    plain = dataclasses.replace(RolloutConfig(), dtype="float32", sync_probe_every=None)
    assert WeightSync(_Actor(), _Worker(), plain).probe_every == 1


_spec = importlib.util.spec_from_file_location("_real_engine_for_sync_schedule",
                                               Path(__file__).parents[1] / "trainer" / "_real_engine.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)


@pytest.mark.slow
def test_train_step_stops_on_samples_from_other_weights(tiny_model_path, tiny_tokenizer, tmp_path):
    """Real engine: rollout log-probs equal to the trainer's pass the step's check; the same
    samples with log-probs 0.01 off everywhere (an engine serving other weights) raise
    WeightSyncError before the optimizer step (weights unchanged)."""
    cfg = rt.make_cfg(tiny_model_path)
    cfg.rollout = dataclasses.replace(cfg.rollout, dtype="float32")
    actor = rt.build_engine(tiny_model_path)
    samples = rt.make_samples(tiny_tokenizer, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    lps = rt.score_samples(actor, samples, tiny_tokenizer.pad_token_id)
    good = rt.with_rollout_log_probs(samples, lps)
    bad = rt.with_rollout_log_probs(samples, lps, offsets=[[0.01] * len(lp) for lp in lps])
    for name, rows, ok in (("bad", bad, False), ("good", good, True)):
        actor = rt.build_engine(tiny_model_path)  # the weights lps were scored with
        trainer = rt.make_trainer(cfg, actor, tiny_tokenizer, tmp_path / name)
        trainer.weight_sync.probe, trainer.weight_sync.probe_every = True, 4  # the fake worker cannot be probed
        if ok:
            assert trainer.train_on(rows, 1)["rollout/logprob_diff"] < 1e-5
            continue
        before = rt.params(actor)
        with pytest.raises(WeightSyncError, match=r"step 1: .* sampled tokens differ from .* by 0\.01 "):
            trainer.train_on(rows, 1)
        rt.assert_params_equal(rt.params(actor), before)
