"""prompts.jsonl, the prompts' lineage: per step and rank, the draw numbers (in the rank's prompt
stream) of the prompts trained and of those dropped, written by the main rank, rewritten on resume
like metrics.jsonl. The real Trainer around the scripted rollout side (tests/trainer/_loop_fakes.py:
the scripted source names each prompt by its draw, "I<k>" or "U<k>"). The asynchronous schedules'
numbers: tests/rollout/test_async_buffer.py; through kills and resumes: tests/e2e/test_kill_anywhere.py."""
from __future__ import annotations

import json

import torch

import dsrl.trainer as trainer_module
from _loop_fakes import make_cfg, make_trainer, prompt_text

N = 4


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]


def _draw_numbers(samples):
    """The draw numbers of a step's trained groups, read from the scripted prompts' texts."""
    return [int(prompt_text(s.prompt_ids)[1:].split(":")[0]) for s in samples[::N]]


def test_dynamic_sampling_lists_the_trained_and_the_dropped_draws(tmp_path):
    """Each step: round 0 draws U, I; round 1 draws U, I (tests/trainer/test_dynamic_sampling.py):
    the I prompts train, the all-equal U prompts are dropped."""
    trainer = make_trainer(make_cfg(groups=2, group_size=N, total_steps=3, dynamic_sampling=True,
                                    max_sampling_rounds=3), tmp_path, [], kinds="UI")
    trainer.fit()
    rows = _rows(tmp_path)
    assert [(r["step"], r["rank"], r["trained"], r["dropped"]) for r in rows] == [
        (1, 0, [1, 3], [0, 2]), (2, 0, [5, 7], [4, 6]), (3, 0, [9, 11], [8, 10])]
    assert [r["trained"] for r in rows] == [_draw_numbers(samples) for samples in trainer.trained]
    # each prompt's uid (a prompt without a meta id: its text), in the order of its draw number
    assert [r["trained_prompts"] for r in rows] == [[prompt_text(s.prompt_ids) for s in samples[::N]]
                                                    for samples in trainer.trained]
    assert [[u.split(":")[0] for u in r["dropped_prompts"]] for r in rows] == [[f"U{d}" for d in r["dropped"]]
                                                                               for r in rows]
    assert trainer.state.prompts_drawn == 12


def test_a_resume_rewrites_the_rows_after_its_checkpoint(tmp_path, monkeypatch):
    """A run logs steps 1-3 and checkpoints step 2 (files replaced by one torch.save'd dict); the
    resumed run in the same folder replaces step 3's row, continues the draw numbers from the
    checkpoint's count, and the file equals the uninterrupted run's, each step once."""
    full = make_trainer(make_cfg(total_steps=4), tmp_path / "full", [], kinds="IU")
    full.fit()

    saved = {}

    def fake_save(run_dir, step, *, actor, tokenizer, keep, rank_state, shared):
        torch.save({"trainer": rank_state, "rng": None}, tmp_path / "rank.pt")
        saved.update(step=step, metrics=list(shared["metrics"]), prompts=list(shared["prompts"]))
        return str(tmp_path), 0.0

    monkeypatch.setattr(trainer_module, "save_checkpoint", fake_save)
    run = tmp_path / "run"
    first = make_trainer(make_cfg(total_steps=4), run, [], kinds="IU")
    for step in (1, 2, 3):
        first.logger.log(step, first.step(step))
        for row in first.lineage:
            first.prompt_log.append(row)
        if step == 2:
            first.save(2)
            drawn = first.source.drawn
    first.prompt_log.close()
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]

    monkeypatch.setattr(trainer_module, "read_shared_state", lambda folder: {"step": 2, **saved})
    monkeypatch.setattr(trainer_module, "load_rank_state", lambda folder: torch.load(tmp_path / "rank.pt",
                                                                                      weights_only=False))
    monkeypatch.setattr(trainer_module, "restore_rng", lambda state: None)
    resumed = make_trainer(make_cfg(total_steps=4), run, [], kinds="IU")
    resumed.source.drawn = drawn  # the scripted source's position (a real source draws from the RNG)
    resumed.actor = type("Actor", (), {"load_checkpoint": lambda self, folder: None})()
    resumed.restore(str(tmp_path))
    assert [r["step"] for r in _rows(run)] == [1, 2]
    resumed.fit()
    assert _rows(run) == _rows(tmp_path / "full")
    assert [(r["step"], r["trained"], r["dropped"]) for r in _rows(run)] == [
        (s, [2 * s - 2, 2 * s - 1], []) for s in range(1, 5)]
