"""bench/async_timeline.py, the off-policy timeline simulator, against timelines computed by hand."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import async_timeline as at  # noqa: E402


def fixed(lengths):
    """Response lengths taken in turn (a deterministic 'distribution')."""
    it = {"i": 0}

    def draw(rng):
        n = lengths[it["i"] % len(lengths)]
        it["i"] += 1
        return n
    return draw


def wl(**kw):
    base = dict(batch=2, engines=1, slots=2, decode_s=1.0, decode_s_per_seq=0.0, train_s=10.0, train_s_per_token=0.0,
                sync_s=1.0, lengths=fixed([3, 5]), contention=1.0)
    base.update(kw)
    return at.Workload(**base)


def test_engine_makespan_is_continuous_batching():
    w = wl(slots=2, decode_s=1.0, decode_s_per_seq=0.5)
    # [3, 5, 2] on 2 slots: 3 steps at 2 held (2 s each) -> 6 s; the 2 joins: 2 steps at 2 held -> 10 s;
    # the 5 has 0 left; total 10 s
    assert at._engine_makespan(w, [3, 5, 2]) == pytest.approx(10.0)
    assert at.batch_makespan(wl(engines=2, slots=1), [3, 5, 2, 1]) == pytest.approx(5.0 + 1.0)


def test_sync_and_one_step_by_hand():
    # sync: 5 (longest) + 10 (update) + 1 (push) = 16 s a step
    r = at.run_sync(wl(), steps=4)
    assert r.seconds == pytest.approx(4 * 16.0) and max(r.staleness) == 0
    # one_step: 5 alone, then each step max(5, 10) + 1 = 11 s
    r = at.run_one_step(wl(), steps=4)
    assert r.seconds == pytest.approx(5.0 + 4 * 11.0) and r.staleness == [0, 0] + [1] * 6
    # two jobs on shared cores (contention 2): 5 s of generation beside 10 s of update take 5*2 + 5 = 15 s
    r = at.run_one_step(wl(contention=2.0), steps=2)
    assert r.seconds == pytest.approx(5.0 + 15.0 + 1.0 + 10.0 + 1.0)


def test_async_k0_is_the_synchronous_loop_and_k1_is_trainer_bound():
    r = at.run_async(wl(), steps=4, k=0)
    assert r.seconds == pytest.approx(4 * 16.0) and max(r.staleness) == 0
    # k=1: batch 2 (3, 5 tokens) is generated at once: the engine is one batch ahead, the update
    # (10 s) + push (1 s) is the bottleneck after the first batch's 5 s
    r = at.run_async(wl(), steps=6, k=1)
    assert r.seconds == pytest.approx(5.0 + 6 * 11.0)
    assert max(r.staleness) == 1 and r.staleness[:2] == [0, 0]


def test_async_bounds_staleness_and_helps_long_tails():
    w = at.workload(dict(batch=32, engines=2, slots=16, decode_s=0.01, decode_s_per_seq=0.0, train_s=2.0,
                         train_s_per_token=0.0, sync_s=0.1, mean_len=200, sigma=1.0, max_len=2000, contention=1.0))
    sync = at.run_sync(w, 20)
    for k in (1, 2, 3):
        r = at.run_async(w, 20, k)
        assert max(r.staleness) <= k  # older samples are dropped when the trainer takes a batch
        assert r.steps_per_s > sync.steps_per_s  # the long tail no longer stalls every step
        kept = at.run_async(w, 20, k, drop_stale=False)
        assert kept.dropped == 0 and max(kept.staleness) > k  # a long sample outlives k pushes
