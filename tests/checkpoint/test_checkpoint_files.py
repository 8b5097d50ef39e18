"""Checkpoint discovery, damage detection, config compatibility (before any model loads), the
prompt-sampler and RNG state round trip, metrics history on resume, and the reaper."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import time

import psutil
import pytest
import torch

from dsrl.checkpoint import (MANIFEST, SHARED_STATE, _manifest, capture_rng, check_resume_compatible,
                             checkpoint_dir, config_record, find_latest, restore_rng)
from dsrl.config.schema import Config
from dsrl.errors import ConfigError
from dsrl.testing import subprocess_env
from dsrl.tracking.metrics import MetricsLogger


def _fake_checkpoint(run_dir, step, cfg=None, world=1):
    """A folder shaped like a complete checkpoint (no weights: discovery only reads the manifest)."""
    d = checkpoint_dir(str(run_dir), step)
    os.makedirs(os.path.join(d, "deepspeed"))
    with open(os.path.join(d, "deepspeed", "model.pt"), "wb") as f:
        f.write(b"x" * 100)
    with open(os.path.join(d, SHARED_STATE), "w") as f:
        json.dump({"step": step, "world_size": world, "metrics": [],
                   "config": config_record(cfg or Config())}, f)
    manifest = _manifest(d)
    with open(os.path.join(d, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return d


def test_newest_complete_checkpoint_wins_and_damaged_ones_are_named(tmp_path, caplog):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    six = _fake_checkpoint(tmp_path, 6)
    eight = _fake_checkpoint(tmp_path, 8)
    os.remove(os.path.join(eight, MANIFEST))  # a save that died before its manifest
    with open(os.path.join(six, "deepspeed", "model.pt"), "ab") as f:  # a file that changed after the save
        f.write(b"y")
    os.makedirs(tmp_path / "checkpoints" / ".tmp-step-000010")  # an unfinished save: never considered
    with caplog.at_level(logging.WARNING, logger="dsrl"):
        assert find_latest(str(tmp_path)) == checkpoint_dir(str(tmp_path), 4)
    text = caplog.text
    assert "step-000008: no manifest" in text
    assert "step-000006: deepspeed/model.pt has 101 bytes, manifest says 100" in text
    assert ".tmp" not in text


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert find_latest(str(tmp_path)) is None


def test_resume_compatibility_names_breaking_keys_and_allows_harmless_ones():
    saved = config_record(Config())
    cfg = Config()
    cfg.trainer = dataclasses.replace(cfg.trainer, total_steps=99, save_every=3)
    cfg.logger = dataclasses.replace(cfg.logger, wandb=True)
    check_resume_compatible(saved, 1, cfg, "ck")  # harmless changes pass
    cfg.algo = dataclasses.replace(cfg.algo, n_samples_per_prompt=4)
    cfg.model = dataclasses.replace(cfg.model, path="tiny")
    with pytest.raises(ConfigError) as e:
        check_resume_compatible(saved, 2, cfg, "ck")
    msg = str(e.value)
    assert "algo.n_samples_per_prompt: 8 in the checkpoint, 4 now" in msg
    assert "model.path: 'smollm2' in the checkpoint, 'tiny' now" in msg
    assert "world size: 2 in the checkpoint, 1 now" in msg
    assert "trainer.total_steps" not in msg.split("(only these")[0]


def _resolved(dtype, threads):
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dtype=dtype)
    cfg.actor = dataclasses.replace(cfg.actor, num_threads=threads)
    return cfg


def test_auto_settings_resolved_otherwise_on_the_resuming_machine_warn_or_refuse(caplog):
    """A requeued job on another machine: model.dtype and actor.num_threads were `auto` in both runs
    and resolve differently now. The user's `auto` is compared, each change named in one warning;
    trainer.resume_exact=true refuses instead."""
    import logging

    saved = config_record(_resolved("bfloat16", 2))
    auto = ("model.dtype", "actor.num_threads", "model.attn_implementation")
    cfg = _resolved("float32", 1)
    with caplog.at_level(logging.WARNING, logger="dsrl"):
        check_resume_compatible(saved, 1, cfg, "ck", auto_now=auto, auto_saved=list(auto))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "model.dtype=auto resolves to 'float32' on this machine, 'bfloat16' in the checkpoint's run" in lines[1]
    assert "actor.num_threads=auto resolves to 1 on this machine, 2 in the checkpoint's run" in lines[0]
    cfg.trainer = dataclasses.replace(cfg.trainer, resume_exact=True)
    with pytest.raises(ConfigError) as e:
        check_resume_compatible(saved, 1, cfg, "ck", auto_now=auto, auto_saved=list(auto))
    assert "model.dtype=auto: 'bfloat16' in the checkpoint's run, 'float32' on this machine" in str(e.value)
    assert "actor.num_threads=auto: 2 in the checkpoint's run, 1 on this machine" in str(e.value)
    check_resume_compatible(saved, 1, _resolved("bfloat16", 2), "ck", auto_now=auto, auto_saved=list(auto))


@pytest.mark.parametrize("auto_now,auto_saved", [(("model.dtype",), None), (("model.dtype",), []), ((), ["model.dtype"])],
                         ids=["checkpoint-before-records", "explicit-in-checkpoint", "explicit-now"])
def test_a_value_not_auto_in_both_runs_is_still_a_named_change(auto_now, auto_saved):
    with pytest.raises(ConfigError, match=r"model.dtype: 'bfloat16' in the checkpoint, 'float32' now"):
        check_resume_compatible(config_record(_resolved("bfloat16", 2)), 1, _resolved("float32", 2), "ck",
                                auto_now=auto_now, auto_saved=auto_saved)


def test_keys_added_after_a_checkpoint_pass_only_at_their_default():
    """A checkpoint written before algo.off_policy_steps existed: resuming with the key at its
    default (the old behaviour) is exact; turning it on is a named change."""
    saved = config_record(Config())
    del saved["algo"]["off_policy_steps"]
    check_resume_compatible(saved, 1, Config(), "ck")
    cfg = Config()
    cfg.algo = dataclasses.replace(cfg.algo, off_policy_steps=1)
    with pytest.raises(ConfigError, match=r"algo.off_policy_steps: None in the checkpoint, 1 now"):
        check_resume_compatible(saved, 1, cfg, "ck")


def test_changed_config_fails_through_the_cli_before_any_model_loads(tmp_path):
    """A checkpoint of a run with other batch sizes: the real CLI refuses to resume, naming the key."""
    from hydra import compose, initialize_config_dir

    from dsrl.config.schema import register_configs, to_config

    register_configs()
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(conf), version_base=None):
        saved = to_config(compose(config_name="config", overrides=["+exp=grpo_reuse", "model.path=tiny"]))
    from dsrl import hardware

    hardware.apply(saved, hardware.decide(saved, hardware.probe(1)))  # a real run records resolved values
    old = tmp_path / "old"
    _fake_checkpoint(old, 10, saved)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", "model.path=tiny",
                        "algo.rollout_batch_size=4", "algo.global_batch_size=32", f"trainer.resume_from={old}", f"hydra.run.dir={tmp_path / 'new'}"],
                       capture_output=True, text=True, env=subprocess_env(RAY_AUTH_MODE="disabled"), timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "algo.rollout_batch_size: 8 in the checkpoint, 4 now" in out, out
    assert "Loading weights" not in out and time.time() - t0 < 120


def test_rng_state_round_trip():
    random.seed(3)
    torch.manual_seed(3)
    state = capture_rng()
    want = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    restore_rng(state)
    got = (random.random(), torch.rand(3))
    assert want[0] == got[0] and torch.equal(want[1], got[1])


def test_metrics_history_is_rewritten_on_resume(tmp_path):
    crashed = MetricsLogger(tmp_path, tensorboard=False, enabled=True)
    for step in (1, 2, 3):  # step 3 ran after the last checkpoint (of step 2), then the run died
        crashed.log(step, {"reward/mean": step / 10})
    kept = crashed.history[:2]
    crashed.close()
    logger = MetricsLogger(tmp_path, tensorboard=False, enabled=True)
    logger.restore(kept, step=2, wandb_run_id=None)
    logger.log(3, {"reward/mean": 0.7})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2}, {"step": 3, "reward/mean": 0.7}]


_PARENT = r"""
import subprocess, sys, time
from dsrl.distributed.reaper import Reaper
reaper = Reaper.start()
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
print(reaper.pid, flush=True)
if sys.argv[1] == "clean":
    time.sleep(1.5)
    reaper.close()
    print("closed", flush=True)
time.sleep(600)
"""


def _tree(parent_pid, want, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        procs = psutil.Process(parent_pid).children(recursive=True)
        if len(procs) >= want:
            return procs
        time.sleep(0.2)
    raise AssertionError(f"expected {want} descendants of {parent_pid}")


def test_reaper_stops_the_children_of_a_sigkilled_parent():
    p = subprocess.Popen([sys.executable, "-c", _PARENT, "kill"], stdout=subprocess.PIPE, text=True,
                         env=subprocess_env())
    reaper_pid = int(p.stdout.readline())
    procs = [q for q in _tree(p.pid, 3) if q.pid != reaper_pid]  # child and grandchild
    time.sleep(1.0)  # the reaper has polled the tree
    p.kill()
    p.wait()
    _, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive
    with pytest.raises(psutil.NoSuchProcess):  # the reaper itself is gone too
        end = time.time() + 15
        while time.time() < end:
            if psutil.Process(reaper_pid).status() == psutil.STATUS_ZOMBIE:
                raise psutil.NoSuchProcess(reaper_pid)
            time.sleep(0.2)


def test_reaper_closed_cleanly_kills_nothing():
    p = subprocess.Popen([sys.executable, "-c", _PARENT, "clean"], stdout=subprocess.PIPE, text=True,
                         env=subprocess_env())
    reaper_pid = int(p.stdout.readline())
    procs = [q for q in _tree(p.pid, 3) if q.pid != reaper_pid]
    assert p.stdout.readline().strip() == "closed"
    p.kill()
    p.wait()
    time.sleep(2.0)
    try:
        assert all(q.is_running() for q in procs)  # a clean close leaves the children to their owner
    finally:
        for q in procs:
            q.kill()
