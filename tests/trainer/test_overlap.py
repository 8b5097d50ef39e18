"""One-step-off-policy overlap (algo.off_policy_steps=1): the real Trainer loop and background
rollout around a scripted worker/verifier (tests/trainer/_loop_fakes.py). Order of operations
(step k+1's generation runs while step k trains; the push waits for it), staleness, errors
of the background generation surfacing in the main thread, the same prompt stream and seeds as
the synchronous loop, checkpoint/resume with the rollout in hand, and the config rules."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import dsrl.trainer as trainer_module
from _loop_fakes import ScriptedSource, make_cfg, make_trainer
from dsrl.errors import ConfigError
from dsrl.validation.reuse import decide_reuse

OVERLAP = {"off_policy_steps": 1, "use_rollout_logprobs": True}


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_next_generation_overlaps_training_and_the_push_waits_for_it(tmp_path):
    events = []
    cfg = make_cfg(total_steps=3, **OVERLAP)
    trainer = make_trainer(cfg, tmp_path, events, delay_s=0.3)
    worker, plain_train_on = trainer.worker, trainer.train_on
    overlapped = []

    def train_on(samples, step):
        assert step == len(trainer.trained) + 1
        # Training of step k only proceeds once step k+1's generation has started: a loop that
        # generated after training would time out here.
        overlapped.append(step == cfg.trainer.total_steps or _wait_for(lambda: worker.calls >= step + 1))
        return plain_train_on(samples, step)

    trainer.train_on = train_on
    trainer.fit()
    assert overlapped == [True, True, True]
    threads = [e[1] for e in events if e[0] == "generate"]
    assert threads == ["MainThread", "dsrl-rollout-step-2", "dsrl-rollout-step-3"]
    # The generation of step 3 is not started after the last step; each push comes after the
    # next step's generation finished, and none happens while a generate call runs.
    pushes = [e for e in events if e[0] == "push"]
    assert [p[1] for p in pushes] == [1, 2, 3] and all(p[2] == 0 for p in pushes)
    order = [(e[0], e[1]) for e in events if e[0] in ("generated", "push", "trained")]
    assert order == [("generated", "MainThread"), ("trained", 1), ("generated", "dsrl-rollout-step-2"), ("push", 1),
                     ("trained", 2), ("generated", "dsrl-rollout-step-3"), ("push", 2), ("trained", 3), ("push", 3)]
    assert [r["rollout/staleness"] for r in trainer.logger.history] == [0.0, 1.0, 1.0]
    assert all(r["timing/generation"] >= 0.3 for r in trainer.logger.history)


def test_synchronous_loop_has_no_staleness_and_no_thread(tmp_path):
    events = []
    trainer = make_trainer(make_cfg(total_steps=3), tmp_path, events)
    trainer.fit()
    assert {e[1] for e in events if e[0] == "generate"} == {"MainThread"}
    assert [r["rollout/staleness"] for r in trainer.logger.history] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_same_prompts_seeds_and_samples_as_the_synchronous_loop(tmp_path, dynamic):
    """The prompt stream is drawn in the same order (only the weights differ): same requests."""
    runs = {}
    for name, extra in (("sync", {"use_rollout_logprobs": True}), ("overlap", OVERLAP)):
        events = []
        trainer = make_trainer(make_cfg(total_steps=4, dynamic_sampling=dynamic, **extra), tmp_path / name, events,
                               kinds="UIIU")
        trainer.fit()
        runs[name] = ([e[2:] for e in events if e[0] == "generate"],
                      [[(s.prompt_ids, s.response_ids, s.reward, s.group, s.index) for s in step]
                       for step in trainer.trained])
    assert runs["sync"] == runs["overlap"]
    assert len(runs["sync"][0]) == (8 if dynamic else 4)


def test_an_error_in_the_background_generation_is_raised_in_the_main_thread(tmp_path):
    events = []
    trainer = make_trainer(make_cfg(total_steps=3, **OVERLAP), tmp_path, events, fail_on_call=2)
    with pytest.raises(RuntimeError, match="scripted failure of generate call 2") as info:
        trainer.fit()
    assert any("background rollout of step 2" in note for note in info.value.__notes__)
    assert len(trainer.trained) == 1
    assert not [e for e in events if e[0] == "push"]  # weights are never pushed past a failed generation
    assert not trainer.state.next_rollout.running and trainer.state.next_rollout.step is None


def test_checkpoint_holds_the_finished_next_rollout_and_resume_is_exact(tmp_path, monkeypatch):
    """Trainer.save/restore with the checkpoint files replaced by one torch.save'd dict: the
    rollout of step 3, generated during step 2 with step 1's weights, is in the checkpoint, and
    the resumed run trains exactly what the uninterrupted one trained."""
    full = make_trainer(make_cfg(total_steps=4, **OVERLAP), tmp_path / "full", [], kinds="IUU")
    full.fit()

    saved = {}

    def fake_save(run_dir, step, *, actor, tokenizer, keep, rank_state, shared):
        torch.save({"trainer": rank_state, "rng": None}, tmp_path / "rank.pt")
        saved.update(step=step, metrics=list(shared["metrics"]), auto=shared["hardware_auto"])
        return str(tmp_path), 0.0

    monkeypatch.setattr(trainer_module, "save_checkpoint", fake_save)
    first = make_trainer(make_cfg(total_steps=4, **OVERLAP), tmp_path / "first", [], kinds="IUU",
                         hardware_auto=("model.dtype", "actor.num_threads"))
    for step in (1, 2):
        first.logger.log(step, first.step(step))
    first.save(2)
    assert not first.state.next_rollout.running  # save waited for it
    assert saved["auto"] == ["model.dtype", "actor.num_threads"]  # a resume elsewhere compares the user's auto

    monkeypatch.setattr(trainer_module, "read_shared_state", lambda folder: {"step": 2, "metrics": saved["metrics"]})
    monkeypatch.setattr(trainer_module, "load_rank_state", lambda folder: torch.load(tmp_path / "rank.pt",
                                                                                      weights_only=False))
    monkeypatch.setattr(trainer_module, "restore_rng", lambda state: None)
    resumed = make_trainer(make_cfg(total_steps=4, **OVERLAP), tmp_path / "resumed", [], kinds="IUU")
    resumed.source.drawn = first.source.drawn  # the scripted source's position (a real source draws from the RNG)
    resumed.actor = type("Actor", (), {"load_checkpoint": lambda self, folder: None})()
    resumed.restore(str(tmp_path))
    assert resumed.state.next_rollout.holds(3) and resumed.state.weights_step == 2
    resumed.fit()
    as_tuples = [[(s.prompt_ids, s.reward, s.group) for s in step] for step in resumed.trained]
    assert as_tuples == [[(s.prompt_ids, s.reward, s.group) for s in step] for step in full.trained[2:]]
    assert [r["rollout/staleness"] for r in resumed.logger.history] == [0.0, 1.0, 1.0, 1.0]


def test_no_generation_in_flight_after_the_last_step(tmp_path):
    events = []
    trainer = make_trainer(make_cfg(total_steps=2, **OVERLAP), tmp_path, events, delay_s=0.1)
    trainer.fit()
    assert trainer.state.next_rollout.step is None and not trainer.state.next_rollout.running
    assert not [t for t in threading.enumerate() if t.name.startswith("dsrl-rollout-step")]


# ---------------------------------------------------------------------------------------- config rules
def test_overlap_needs_rollout_logprobs_or_tis():
    with pytest.raises(ConfigError, match=r"algo.off_policy_steps=1 needs algo.use_rollout_logprobs=true or "
                                          r"algo.use_tis=true"):
        make_cfg(off_policy_steps=1)
    make_cfg(off_policy_steps=1, use_tis=True)
    make_cfg(off_policy_steps=1, use_rollout_logprobs=True)
    with pytest.raises(ConfigError, match=r"algo.off_policy_steps=2 needs algo.use_rollout_logprobs=true"):
        make_cfg(off_policy_steps=2)
    with pytest.raises(ConfigError, match=r"algo.off_policy_steps=-1 must be >= 0"):
        make_cfg(off_policy_steps=-1, use_tis=True)


def test_async_schedule_rules():
    """k >= 2 runs the chunked asynchronous generator (clock unless deterministic is asked for);
    overlap is k = 1 only; what the chunked generator cannot do is named."""
    from dsrl.validation.validate import async_mode

    assert async_mode(make_cfg()) == "sync"
    assert async_mode(make_cfg(off_policy_steps=1, use_tis=True)) == "overlap"
    assert async_mode(make_cfg(off_policy_steps=2, use_tis=True)) == "clock"
    assert async_mode(make_cfg(off_policy_steps=1, use_tis=True, async_schedule="deterministic")) == "deterministic"
    with pytest.raises(ConfigError, match=r"algo.async_schedule=overlap generates one whole rollout ahead: it "
                                          r"needs algo.off_policy_steps=1, not 3"):
        make_cfg(off_policy_steps=3, use_tis=True, async_schedule="overlap")
    with pytest.raises(ConfigError, match=r"algo.async_schedule='sometimes' is not one of"):
        make_cfg(off_policy_steps=2, use_tis=True, async_schedule="sometimes")
    with pytest.raises(ConfigError, match=r"algo.stale_groups='never' is not one of"):
        make_cfg(off_policy_steps=2, use_tis=True, stale_groups="never")
    with pytest.raises(ConfigError) as e:
        make_cfg(off_policy_steps=2, use_tis=True, dynamic_sampling=True, num_steps_per_rollout=2)
    assert "cannot be combined with algo.dynamic_sampling=true" in str(e.value)
    assert "cannot be combined with 2 optimizer steps per rollout" in str(e.value)


def test_reuse_on_is_blocked_by_overlap_unless_the_rollout_logprobs_are_the_old_policy():
    with pytest.raises(ConfigError, match=r"algo.reuse_logprobs=on is incompatible with: algo.off_policy_steps"):
        make_cfg(off_policy_steps=1, use_tis=True, reuse_logprobs="on")
    cfg = make_cfg(off_policy_steps=1, use_rollout_logprobs=True, reuse_logprobs="on")
    assert decide_reuse(cfg).reuse
    auto = decide_reuse(make_cfg(off_policy_steps=1, use_tis=True, reuse_logprobs="auto"))
    assert not auto.reuse and auto.run_old_pass and "algo.off_policy_steps" in auto.reason
