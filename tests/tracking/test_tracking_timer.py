import time

import pytest

from dsrl.tracking.timer import PhaseTimer

PHASES = ("rollout", "old_logprobs", "ref_logprobs", "train", "weight_sync")


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_phases_accumulate_and_declared_default_to_zero():
    clock = FakeClock()
    timer = PhaseTimer(phases=PHASES, clock=clock)
    with timer.phase("rollout"):
        clock.t += 2.5
    with timer.phase("train"):
        clock.t += 1.0
    with timer.phase("rollout"):  # a second entry in the same step adds up
        clock.t += 0.5
    with timer.phase("eval"):  # undeclared phase: reported after declared ones
        clock.t += 0.25
    out = timer.pop()
    assert list(out) == [f"timing/{p}" for p in PHASES] + ["timing/eval"]
    assert out == {
        "timing/rollout": 3.0,
        "timing/old_logprobs": 0.0,
        "timing/ref_logprobs": 0.0,
        "timing/train": 1.0,
        "timing/weight_sync": 0.0,
        "timing/eval": 0.25,
    }
    # pop starts a new step
    assert timer.pop() == {f"timing/{p}": 0.0 for p in PHASES}


def test_time_is_charged_when_body_raises():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with pytest.raises(KeyError):
        with timer.phase("train"):
            clock.t += 4.0
            raise KeyError("boom")
    assert timer.pop() == {"timing/train": 4.0}


def test_nested_same_phase_and_pop_while_running_rejected():
    timer = PhaseTimer(phases=("train",))
    with timer.phase("train"):
        with pytest.raises(RuntimeError, match="already running"):
            with timer.phase("train"):
                pass
        with pytest.raises(RuntimeError, match="running"):
            timer.pop()


def test_real_clock_and_sync_hook():
    calls = []
    timer = PhaseTimer(phases=("rollout",), sync=lambda: calls.append(1))
    with timer.phase("rollout"):
        time.sleep(0.02)
    out = timer.pop()
    assert 0.015 <= out["timing/rollout"] < 1.0
    assert len(calls) == 2
