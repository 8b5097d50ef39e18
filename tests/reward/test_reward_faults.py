"""Reward faults: a verifier that raises, returns a non-number or NaN, or outlives
reward.timeout_s gives that sample reward 0, counted in reward/errors or reward/timeouts and
logged once per step with the sample; the other samples keep their rewards; a verifier that
never returns blocks neither the loop nor process exit."""
from __future__ import annotations

import logging
import subprocess
import sys
import threading
import textwrap

import pytest

from dsrl.rollout.faults import FaultCounter, fault_metrics, pop_counts
from dsrl.rollout.rewards import RewardGuard
from dsrl.rollout.samples import generate_samples
from dsrl.rollout.vllm_engine import Completion


class _ListWorker:
    """Hands back the given completion texts for each prompt (unit tests of generate_samples;
    one token per character so the log-prob check passes)."""

    def __init__(self, texts_per_prompt):
        self.texts = texts_per_prompt

    def generate(self, prompt_ids, *, n, temperature, top_p, max_tokens, show_progress=False, seeds=None):
        return [[Completion(list(range(len(t))), [-0.5] * len(t), "stop", t) for t in self.texts[g]]
                for g in range(len(prompt_ids))]


@pytest.fixture
def release():
    """An event the hanging verifiers wait on; set at teardown so no test thread lingers."""
    ev = threading.Event()
    yield ev
    ev.set()


def test_good_bad_and_hanging_samples(caplog, release):
    def verifier(text, prompt):
        if text == "boom":
            raise KeyError("no answer field")
        if text == "hang":
            release.wait()
            return 1.0
        if text == "nan":
            return float("nan")
        if text == "none":
            return None
        return len(text) / 10.0 + prompt  # the good samples' reward: a value to compare with

    guard = RewardGuard(verifier, timeout_s=0.3)
    texts = [["ok", "boom", "hang"], ["good!", "nan", "none"], ["fine", "hang", "boom"]]
    with caplog.at_level(logging.WARNING, logger="dsrl"):
        samples = generate_samples(_ListWorker(texts), [[1], [2], [3]], [0.0, 1.0, 2.0], guard, n=3,
                                   temperature=1.0, top_p=1.0, max_tokens=8, show_progress=False)
    assert [s.reward for s in samples] == [0.2, 0.0, 0.0, 1.5, 0.0, 0.0, 2.4, 0.0, 0.0]
    assert not release.is_set()  # the hanging calls were not waited for: they still run
    assert guard.pop_metrics() == {"reward/errors": 4.0, "reward/timeouts": 2.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "dsrl"]
    assert len(lines) == 1  # once per step, with the first failing sample
    assert "prompt 0 (sample 1)" in lines[0] and "'boom'" in lines[0] and "KeyError" in lines[0]
    assert "no answer field" in lines[0]

    # The next step: counters start at 0 and the first failure is logged again.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsrl"):
        assert guard.score("hang", 0.0, where="prompt 5 (sample 40)") == 0.0
    assert guard.pop_metrics() == {"reward/errors": 0.0, "reward/timeouts": 1.0}
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dsrl"]
    assert "prompt 5 (sample 40)" in line and "reward.timeout_s=0.3" in line


def test_nonfinite_and_non_numbers_are_errors():
    guard = RewardGuard(lambda text, prompt: {"nan": float("nan"), "inf": float("inf"), "str": "1.0x"}[text], 5.0)
    assert [guard(t, None) for t in ("nan", "inf", "str")] == [0.0, 0.0, 0.0]
    assert guard.pop_metrics() == {"reward/errors": 3.0, "reward/timeouts": 0.0}


def test_normal_verifier_rewards_unchanged():
    def verifier(text, prompt):
        return 1.0 if text == prompt else 0.25

    texts = [["a", "b"], ["c", "c"]]
    plain = generate_samples(_ListWorker(texts), [[1], [2]], ["a", "c"], verifier, n=2, temperature=1.0,
                             top_p=1.0, max_tokens=4, show_progress=False)
    guard = RewardGuard(verifier, 5.0)
    guarded = generate_samples(_ListWorker(texts), [[1], [2]], ["a", "c"], guard, n=2, temperature=1.0,
                               top_p=1.0, max_tokens=4, show_progress=False)
    assert [s.reward for s in guarded] == [s.reward for s in plain] == [1.0, 0.25, 1.0, 1.0]
    assert guard.pop_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0}


def test_fault_counts_are_popped_once_and_summed_by_name():
    class Restarts:  # a resilient worker's counter
        def __init__(self):
            self.restarts = 2

        def pop_metrics(self):
            out, self.restarts = {"rollout/restarts": float(self.restarts)}, 0
            return out

    guard = RewardGuard(lambda text, prompt: {"ok": 1.0}[text], 5.0)
    assert [guard(t, None) for t in ("ok", "boom", "boom")] == [1.0, 0.0, 0.0]
    worker = Restarts()
    assert isinstance(guard, FaultCounter) and isinstance(worker, FaultCounter)
    assert not isinstance(_ListWorker([]), FaultCounter)  # a bare engine counts nothing
    taken = pop_counts(worker, guard)
    assert taken == {"rollout/restarts": 2.0, "reward/errors": 2.0, "reward/timeouts": 0.0}
    assert pop_counts(worker, guard) == {"rollout/restarts": 0.0, "reward/errors": 0.0, "reward/timeouts": 0.0}
    worker.restarts = 1  # counted after `taken` (a weight push's restart): added to it
    assert fault_metrics(taken, worker, guard) == {"reward/errors": 2.0, "reward/timeouts": 0.0,
                                                   "rollout/restarts": 3.0}
    assert fault_metrics({}) == {}


def test_wrap_keeps_a_guard_and_rejects_bad_timeouts():
    guard = RewardGuard(len, 1.0)
    assert RewardGuard.wrap(guard, 9.0) is guard
    with pytest.raises(ValueError, match="reward.timeout_s=0"):
        RewardGuard(len, 0)


def test_a_verifier_that_never_returns_does_not_block_process_exit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import threading
        from dsrl.rollout.rewards import RewardGuard
        never = threading.Event()
        guard = RewardGuard(lambda text, prompt: never.wait(), timeout_s=0.2)
        print("reward", guard("x", None), guard.pop_metrics()["reward/timeouts"], flush=True)
    """))
    # A hang would hit this generous guard against a stuck test, not a timing assert.
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "reward 0.0 1.0"


@pytest.mark.slow
def test_trainer_step_counts_reward_faults_and_trains_on(tiny_model_path, tiny_tokenizer, tmp_path, release):
    """Through the real Trainer on the real tiny engine: the step metrics count the failures,
    failed samples score 0 and the optimizer step still happens."""
    import importlib.util
    from pathlib import Path

    import torch

    path = Path(__file__).parents[1] / "trainer" / "_real_engine.py"
    spec = importlib.util.spec_from_file_location("_real_engine_for_rewards", path)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)

    cfg = helpers.make_cfg(tiny_model_path)
    cfg.reward.timeout_s = 0.5
    actor = helpers.build_engine(tiny_model_path)
    # FakeSource's answer is "1.0"; a sample's text is its intended reward ("1.0" / "0.0").
    samples = helpers.make_samples(tiny_tokenizer, [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    trainer = helpers.make_trainer(cfg, actor, tiny_tokenizer, tmp_path, samples=samples)
    calls = []

    def verifier(text, prompt):  # fails on samples #0 and #2, both of which deserve a 1
        calls.append(text)
        if len(calls) == 1:
            raise RuntimeError("verifier bug")
        if len(calls) == 3:
            release.wait()
        return float(text == prompt.answer)

    trainer.verifier.fn = verifier
    before = actor.state_dict_for_export()
    m = trainer.step(1)
    assert m["reward/errors"] == 1.0 and m["reward/timeouts"] == 1.0
    # Rewards 1,0,1 | 0,1,1 | 1,0,0 with samples #0 and #2 scored 0 instead: three 1s of nine.
    assert m["reward/mean"] == pytest.approx(3 / 9)
    after = actor.state_dict_for_export()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # training went on
