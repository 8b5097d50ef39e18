"""bench/bench_train.py's split of a train phase (multiplies / optimizer / rest) and its projection
onto faster multiplies, against figures computed by hand."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_train as bt  # noqa: E402


def test_split_table_rest_is_what_the_multiplies_and_the_optimizer_leave():
    med = {"dense/count": 6.0, "shared/count": 3.0}
    opt = {"dense/count": 0.5, "shared/count": 0.5}
    matmul = {"dense/count": 4.0, "shared/count": 1.0}
    flops = {"dense/count": 2e12, "shared/count": 0.5e12}
    rows = {r[0]: r for r in bt.split_table(med, opt, matmul, flops)}
    assert rows["dense/count"] == ("dense/count", 6.0, 4.0, 0.5, 1.5, 2e12)
    assert rows["shared/count"] == ("shared/count", 3.0, 1.0, 0.5, 1.5, 0.5e12)


def test_projection_moves_the_ratio_towards_the_rest():
    dense = ("dense/count", 6.0, 4.0, 0.5, 1.5, 0)
    shared = ("shared/count", 3.0, 1.0, 0.5, 1.5, 0)
    assert bt.projected_ratio(shared, dense, 1.0) == pytest.approx(3.0 / 6.0)
    # multiplies 4 x faster: dense 1 + 0.5 + 1.5 = 3.0, shared 0.25 + 0.5 + 1.5 = 2.25
    assert bt.projected_ratio(shared, dense, 4.0) == pytest.approx(2.25 / 3.0)
    # without bound the ratio tends to the rest's (optimizer included): 2.0 / 2.0
    assert bt.projected_ratio(shared, dense, 1e9) == pytest.approx(1.0)


def test_step_clock_times_the_optimizer_step_and_passes_its_result_through():
    import time

    class Actor:
        def optimizer_step(self):
            time.sleep(0.02)
            return 1.25

    actor = Actor()
    clock = bt.StepClock(actor)
    assert actor.optimizer_step() == 1.25
    first = clock.pop()
    assert first >= 0.02
    assert clock.pop() == 0.0
