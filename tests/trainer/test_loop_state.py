"""The loop state a checkpoint carries is one object (dsrl.stages.state.LoopState): every field is
in its state_dict and comes back from load_state_dict, a field added later cannot be left out of
the checkpoint, and what Trainer.save writes for a rank is exactly that state. Rank 0's shared
state names the W&B run, which a restored trainer continues."""
from __future__ import annotations

import dataclasses
import random

import torch

from dsrl.rollout.dynamic import Rollout
from dsrl.stages.state import LoopState

from _loop_fakes import make_cfg, make_trainer

# What a checkpoint's rank file holds besides the RNGs. A new LoopState field must be added here
# (and so reviewed for resume) or this test fails.
CHECKPOINTED = ["prompt_rng", "skips", "critic_skips", "next_rollout", "weights_step", "sync", "async_buffer",
                "prompts_drawn"]


def test_every_field_is_checkpointed_and_restored():
    assert [f.name for f in dataclasses.fields(LoopState)] == CHECKPOINTED
    a = LoopState.fresh(seed=3, rank=1, max_skipped_steps=3)
    a.prompt_rng.random()
    a.skips.record(True, 1)
    a.critic_skips.record(True, 1)
    a.critic_skips.record(True, 2)
    a.weights_step = 7
    a.prompts_drawn = 12
    a.next_rollout.preload(8, Rollout(samples=["x"]))
    a.sync.pushes, a.sync.checks, a.sync.sequences = 5, 3, [[1, 2, 3]]

    state = a.state_dict()
    assert list(state) == CHECKPOINTED
    b = LoopState.fresh(seed=0, rank=0, max_skipped_steps=3)
    assert b.load_state_dict(torch.load(_roundtrip(state), weights_only=False)) == []
    assert b.prompt_rng.random() == a.prompt_rng.random()
    assert (b.skips.total, b.skips.consecutive, b.critic_skips.total) == (1, 1, 2)
    assert b.weights_step == 7 and b.prompts_drawn == 12
    assert b.next_rollout.holds(8) and b.next_rollout.take(8).samples == ["x"]
    assert (b.sync.pushes, b.sync.checks, b.sync.sequences) == (5, 3, [[1, 2, 3]])


def test_an_older_checkpoint_without_a_field_keeps_its_fresh_value():
    b = LoopState.fresh(seed=0, rank=0, max_skipped_steps=3)
    old = {"prompt_rng": random.Random(5).getstate(), "skips": {"total": 2, "consecutive": 0}, "next_rollout": None}
    assert b.load_state_dict(old) == ["critic_skips", "weights_step", "sync", "async_buffer", "prompts_drawn"]
    assert b.skips.total == 2 and b.critic_skips.total == 0 and b.weights_step == 0


def test_trainer_save_writes_the_loop_state(tmp_path, monkeypatch):
    import dsrl.trainer as trainer_module

    written = {}

    def fake_save(run_dir, step, *, actor, tokenizer, keep, rank_state, shared):
        written.update(rank_state)
        return str(tmp_path), 0.0

    monkeypatch.setattr(trainer_module, "save_checkpoint", fake_save)
    t = make_trainer(make_cfg(total_steps=1), tmp_path, [])
    t.logger.log(1, t.step(1))
    t.save(1)
    assert list(written) == CHECKPOINTED and written["weights_step"] == 1
    assert written["prompt_rng"] == t.state.prompt_rng.getstate()


def test_the_checkpoint_names_the_wandb_run_and_a_restore_continues_it(tmp_path, monkeypatch):
    import dsrl.trainer as trainer_module

    saved = {}

    def fake_save(run_dir, step, *, actor, tokenizer, keep, rank_state, shared):
        saved.update(shared=dict(shared), rank={"trainer": rank_state, "rng": None})
        return str(tmp_path), 0.0

    monkeypatch.setattr(trainer_module, "save_checkpoint", fake_save)
    cfg = make_cfg(total_steps=2)
    cfg.logger = dataclasses.replace(cfg.logger, wandb=True, wandb_mode="offline")
    first = make_trainer(cfg, tmp_path / "first", [])
    first.logger.log(1, first.step(1))
    first.save(1)
    run_id = first.logger.wandb_run_id
    assert run_id is not None and saved["shared"]["wandb_run_id"] == run_id
    first.logger.close()  # the run ends (a crash would leave its W&B run unfinished)

    monkeypatch.setattr(trainer_module, "read_shared_state", lambda folder: {"step": 1, **saved["shared"]})
    monkeypatch.setattr(trainer_module, "load_rank_state", lambda folder: saved["rank"])
    monkeypatch.setattr(trainer_module, "restore_rng", lambda state: None)
    resumed = make_trainer(cfg, tmp_path / "resumed", [])
    resumed.actor = type("Actor", (), {"load_checkpoint": lambda self, folder: None})()
    assert resumed.logger.wandb_run_id is None  # built: no W&B run yet
    resumed.restore(str(tmp_path))
    assert resumed.logger.wandb_run_id == run_id
    resumed.fit()
    assert [r["step"] for r in resumed.logger.history] == [1, 2]


def _roundtrip(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_the_asynchronous_buffer_is_the_snapshot_of_the_last_push():
    """algo.async_schedule clock|deterministic: the checkpoint holds the buffer as snapshotted at
    the push (groups in flight with their versions, closed batches, the prompt stream's position),
    not as it stands when the checkpoint is written; a run without one refuses such a checkpoint."""
    from dsrl.rollout.async_buffer import AsyncBuffer

    def fresh():
        return LoopState.fresh(seed=0, rank=0, max_skipped_steps=3,
                               async_buffer=AsyncBuffer(groups_per_batch=2, n=1, k=2, total_batches=9))

    a = fresh()
    buf = a.async_buffer
    g = buf.admit("prompt", [5, 6])
    buf.extend(g.trajectories[0], [7], [-0.5], "length", max_tokens=4)
    buf.taken, buf.version = 3, 3
    buf.snapshot(a.prompt_rng.getstate())
    a.prompt_rng.random()  # the generator draws on after the push: not in the checkpoint
    buf.admit("later", [1])
    state = torch.load(_roundtrip(a.state_dict()), weights_only=False)
    b = fresh()
    assert b.load_state_dict(state) == []
    got = b.async_buffer
    assert (got.admitted, got.taken, got.version) == (1, 3, 3)
    assert got.active[0].trajectories[0].response_ids == [7] and got.active[0].trajectories[0].versions == [0]
    assert got.prompt_state == buf.prompt_state
    with __import__("pytest").raises(ValueError, match="holds an asynchronous buffer"):
        LoopState.fresh(seed=0, rank=0, max_skipped_steps=3).load_state_dict(state)
