"""The asynchronous buffer resumes from every checkpoint (the stand-in engine of
tests/rollout/test_async_buffer.py: tokens keyed by seed, prompt and weights version):
- a snapshot taken while batch s + k was still open (a checkpoint after a step without a push, a
  stop by TrainingDiverged) continues on the checkpoint's weights with one reason;
- a finished run resumed with a larger trainer.total_steps continues (its groups in flight too);
- a deterministic snapshot at a push continues bit for bit, with no reason;
- the snapshot copies only what a chunk can still change."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rollout"))

from test_async_buffer import StandInEngine, make, summary, train  # noqa: E402

SHAPE = dict(k=2, groups=2, n=2, chunk=3, max_tokens=9)


def _versions(batch):
    return {v for g in batch.groups for t in g.trajectories for v in t.versions}


def _resumed(state, step, total, deterministic=True):
    eng = StandInEngine()
    eng.weights = step  # the resumed engine gets the checkpoint's weights
    buf, gen = make(eng, total=total, deterministic=deterministic, **SHAPE)
    buf.load_state_dict(state)
    why = buf.resume(step, deterministic=deterministic)
    gen.restore_prompt_rng()
    return eng, buf, gen, why


def test_a_checkpoint_without_its_push_resumes_on_the_checkpoints_weights_with_a_reason():
    """Steps 1-2 pushed; step 3 diverges (no push) and its checkpoint snapshots the buffer with batch
    5 still open (sampled by version 2 in the schedule). Before: `RuntimeError: deterministic
    schedule: the engine holds version 3, the chunk needs 2` at the resumed generator's first chunk."""
    eng = StandInEngine()
    buf, gen = make(eng, total=7, **SHAPE)
    for step in (1, 2):
        gen.take(step)

        def push(step=step):
            eng.weights = step
            if step == 2:
                gen.stopping = True  # nothing generated after this push: batch 5 stays open
            return {}
        gen.push(step, push)
    gen.take(3)
    gen.checkpoint_snapshot(3)  # what Trainer.save does after TrainingDiverged
    state = buf.state_dict()
    assert (state["taken"], state["closed"], state["version"]) == (3, 4, 2)

    eng2, buf2, gen2, why = _resumed(state, 3, 7)
    assert why is not None and "TrainingDiverged" in why and "version 3" in why
    rest = train(gen2, 4, engine=eng2, start=4)
    assert [b.index for b in rest] == [4, 5, 6, 7]
    # batch 4 closed before the snapshot (version 1); 5 and 6 by the checkpoint's weights; 7 by 4
    assert [_versions(b) for b in rest] == [{1}, {3}, {3}, {4}]


def test_a_finished_run_extended_with_more_steps_continues_with_a_reason():
    """A 4-step run's last checkpoint resumed with trainer.total_steps=7. Before: `RuntimeError:
    deterministic schedule: the engine holds version 4, the chunk needs 2`."""
    eng = StandInEngine()
    buf, gen = make(eng, total=4, **SHAPE)
    train(gen, 4, engine=eng)
    state = buf.state_dict()
    assert (state["taken"], state["closed"], state["version"], state["total_batches"]) == (4, 4, 4, 4)

    assert _resumed(state, 4, 4)[3] is None  # the same length: nothing left to generate, nothing to say
    eng2, buf2, gen2, why = _resumed(state, 4, 7)
    assert "trainer.total_steps=4, now 7" in why
    rest = train(gen2, 3, engine=eng2, start=5)
    assert [b.index for b in rest] == [5, 6, 7]
    assert [_versions(b) for b in rest] == [{4}, {4}, {4}]
    assert all(len(b.groups) == 2 for b in rest)


def test_a_snapshot_at_a_push_resumes_exactly_without_a_reason():
    eng = StandInEngine()
    _, gen = make(eng, total=7, **SHAPE)
    full = summary(train(gen, 7, engine=eng))
    eng = StandInEngine()
    buf, gen = make(eng, total=7, **SHAPE)
    train(gen, 3, engine=eng)
    eng2, buf2, gen2, why = _resumed(buf.state_dict(), 3, 7)
    assert why is None and buf2.floor == 0
    assert summary(train(gen2, 4, engine=eng2, start=4)) == full[3:]


def test_a_clock_run_extended_trains_its_groups_in_flight_at_the_end():
    """clock keeps the groups in flight when its last batch closes: a longer resumed run trains them
    (or counts them dropped) instead of losing them."""
    eng = StandInEngine(jitter=0.001)
    buf, gen = make(eng, total=3, deterministic=False, **SHAPE)
    first = train(gen, 3, engine=eng)
    gen.checkpoint_snapshot(3)
    state = buf.state_dict()
    eng2, buf2, gen2, why = _resumed(state, 3, 6, deterministic=False)
    assert "trainer.total_steps=3, now 6" in why
    rest = train(gen2, 3, engine=eng2, start=4)
    trained = [g.index for b in first + rest for g in b.groups]
    dropped = [i for b in first + rest for i in b.dropped_ids]
    assert len(set(trained)) == len(trained) and not set(trained) & set(dropped)
    assert set(range(state["admitted"])) <= set(trained) | set(dropped)


def test_the_snapshot_copies_the_groups_in_flight_and_shares_the_finished_ones():
    eng = StandInEngine()
    buf, gen = make(eng, total=7, deterministic=False, **SHAPE)
    gen.take(1)
    gen.stop()
    gen.checkpoint_snapshot(1)
    saved = buf.state_dict()
    assert all(a is b for a, b in zip(saved["ready"], buf.ready))  # closed batches: never modified again
    if buf.active:
        assert saved["active"][0] is not buf.active[0]
        buf.active[0].trajectories[0].response_ids.append(5)
        assert saved["active"][0].trajectories[0].response_ids != buf.active[0].trajectories[0].response_ids
