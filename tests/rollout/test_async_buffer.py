"""The asynchronous buffer and its generator thread (dsrl.rollout.async_buffer), on a stand-in
engine whose tokens are a function of (request seed, prompt, weights version): the schedule of a
hand-traced case, the deterministic schedule's independence from thread timing, the staleness
bound, and a snapshot that a fresh generator continues exactly. The real engine: tests/e2e/test_e2e_async.py."""
from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest

from dsrl.rollout.async_buffer import AsyncBuffer, AsyncGenerator, batch_samples, chunk_seed
from dsrl.rollout.vllm_engine import Completion

EOS = 1


class StandInEngine:
    """generate() as the worker's: tokens drawn from a PRNG keyed by (seed, prompt, weights);
    `lengths[first prompt token]` fixes where a trajectory emits EOS (None: never)."""

    def __init__(self, lengths=None, jitter: float = 0.0):
        self.weights, self.lengths, self.calls, self.jitter = 0, lengths, [], jitter
        self.rng = random.Random(7)

    def generate(self, prompt_ids, *, n, temperature, top_p, max_tokens, show_progress, seeds):
        assert n == 1 and len(seeds) == len(prompt_ids)
        if self.jitter:
            time.sleep(self.rng.random() * self.jitter)
        self.calls.append((self.weights, [len(p) for p in prompt_ids], max_tokens))
        out = []
        for p, s in zip(prompt_ids, seeds):
            key = hashlib.blake2b(f"{s}:{p}:{self.weights}".encode(), digest_size=8).digest()
            rng = random.Random(key)
            ids, reason = [], "length"
            stop_at = None if self.lengths is None else self.lengths[p[0]]
            for _ in range(max_tokens):
                done_len = len(p) - 1 + len(ids) + 1  # response tokens after this one (prompt is 1 token)
                if stop_at is not None and done_len == stop_at or stop_at is None and self.lengths is None \
                        and rng.random() < 0.2:
                    ids.append(EOS)
                    reason = "stop"
                    break
                ids.append(rng.randrange(2, 1000))
            out.append([Completion(ids, [-rng.random() for _ in ids], reason, "")])
        return out


def make(engine, *, k, groups, n=1, chunk=2, max_tokens=8, total=6, deterministic=True, drop=True, prompts=None):
    """A generator over a fresh buffer; prompts drawn from its prompt RNG (or, for the hand trace,
    `prompts` in order: group i's prompt is [i])."""
    rng = random.Random(0)
    it = iter(prompts) if prompts is not None else None
    draw = (lambda: next(it)) if it is not None else (lambda: rng.randrange(100, 10_000))
    buf = AsyncBuffer(groups_per_batch=groups, n=n, k=k, total_batches=total, drop_stale=drop)
    gen = AsyncGenerator(buf, worker=engine, draw_prompt=draw,
                         prompt_ids_fn=lambda p: [p], score=lambda texts, prompt, g: [float(prompt % 3 == 0)] * len(texts),
                         decode=lambda ids: "", prompt_rng=rng, deterministic=deterministic, chunk_tokens=chunk,
                         max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=11, rank=0)
    return buf, gen


def train(gen, steps, *, engine, sleep_rng=None, start=1):
    """The trainer's side: take batch s, 'train', push version s."""
    batches = []
    for step in range(start, start + steps):
        batch = gen.take(step)
        batches.append(batch)
        if sleep_rng is not None:
            time.sleep(sleep_rng.random() * 0.02)

        def push(step=step):
            engine.weights = step
            return {}
        gen.push(step, push)
    gen.stop()
    return batches


def summary(batches):
    return [[(g.index, [t.response_ids for t in g.trajectories], [t.versions for t in g.trajectories], g.rewards)
             for g in b.groups] + [b.dropped] for b in batches]


def test_a_hand_traced_deterministic_schedule():
    """B = 2 groups of 1 sample, k = 1, chunks of 2, at most 8 tokens; group i's prompt is [i].
    Lengths: g1 runs to 8 tokens, g4 to 4, the rest stop at 2 (EOS). A group is admitted while
    (batches closed) + (groups ahead of it) // B - version <= k. Traced by hand:
    chunk 1 (v0): admit g0 g1; g0 done -> open [g0]
    chunk 2 (v0): admit g2 (1 ahead: 0 + 1 - 0 <= 1); g2 done -> batch 1 = [g0, g2]; required version 0
    chunk 3 (v0): admit g3 (g1 ahead, 0 full batches); g3 done -> open [g3]
    chunk 4 (v0): no admission (1 + 1 - 0 > 1); g1 done (8 tokens) -> batch 2 = [g3, g1]; required 1: wait
    push v1; chunk 5 (v1): admit g4 g5; g5 done -> open [g5]
    chunk 6 (v1): g4 done (4 tokens) -> batch 3 = [g5, g4]. Nothing in flight at a close: none dropped."""
    lengths = {i: 2 for i in range(100)}
    lengths.update({1: 8, 4: 4})
    eng = StandInEngine(lengths)
    buf, gen = make(eng, k=1, groups=2, total=3, prompts=range(100))
    batches = train(gen, 3, engine=eng)
    assert [[g.index for g in b.groups] for b in batches] == [[0, 2], [3, 1], [5, 4]]
    assert [b.dropped for b in batches] == [0, 0, 0]
    assert [t.versions for g in batches[1].groups for t in g.trajectories] == [[0, 0], [0] * 8]
    assert [t.versions for g in batches[2].groups for t in g.trajectories] == [[1, 1], [1] * 4]
    assert [w for w, _, _ in eng.calls] == [0, 0, 0, 0, 1, 1]  # the engine's version at each chunk
    assert [len(sizes) for _, sizes, _ in eng.calls] == [2, 2, 2, 1, 2, 1]  # trajectories per chunk


@pytest.mark.parametrize("drop", [True, False])
def test_a_group_overtaken_while_the_weights_move_spans_versions_and_is_dropped_or_kept(drop):
    """The buffer's transitions by hand (what `clock` does when the trainer runs ahead): B = 2, k = 1.
    g0 is admitted with g1 at version 0 and is overtaken twice; its tokens come from versions 0, 1
    and 2, and it would train at step 3, two versions after its first token: dropped, or kept."""
    buf = AsyncBuffer(groups_per_batch=2, n=1, k=1, total_batches=9, drop_stale=drop)
    g0, g1 = buf.admit("p0", [0]), buf.admit("p1", [1])
    buf.extend(g0.trajectories[0], [5], [-0.1], "length", 8)
    buf.extend(g1.trajectories[0], [1], [-0.2], "stop", 8)
    buf.complete(g1)
    assert buf.may_admit()  # one ahead of it in flight, one finished: it would join batch 1
    g2 = buf.admit("p2", [2])
    buf.extend(g2.trajectories[0], [1], [-0.3], "stop", 8)
    buf.complete(g2)
    assert buf.closed == 1 and [g.index for g in buf.ready[0].groups] == [1, 2]
    assert buf.may_admit()  # g3 would join batch 2 (g0 ahead, no full batch): 1 + 0 - 0 <= 1
    g3 = buf.admit("p3", [3])
    buf.extend(g3.trajectories[0], [1], [-0.4], "stop", 8)
    buf.complete(g3)
    assert not buf.may_admit()  # g3 finished and g0 in flight fill batch 2: a new one joins batch 3, 2 ahead of v0
    buf.version = 1  # the push of step 1
    assert buf.may_admit()
    buf.extend(g0.trajectories[0], [6], [-0.5], "length", 8)
    g4 = buf.admit("p4", [4])
    buf.extend(g4.trajectories[0], [1], [-0.6], "stop", 8)
    buf.complete(g4)
    assert buf.closed == 2 and [g.index for g in buf.ready[1].groups] == [3, 4]
    buf.version = 2
    buf.extend(g0.trajectories[0], [1], [-0.7], "stop", 8)
    assert g0.trajectories[0].versions == [0, 1, 2] and g0.oldest_version == 0
    buf.complete(g0)  # would train at step 3: 3 - 1 - 0 = 2 > k
    assert (buf.open_dropped, buf.open_batch) == (([g0], []) if drop else ([], [g0]))
    assert buf.may_admit() and len(buf.active) == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_deterministic_schedule_does_not_depend_on_thread_timing(k):
    runs = []
    for timing in (None, 1, 2):
        eng = StandInEngine(jitter=0.0 if timing is None else 0.005)
        _, gen = make(eng, k=k, groups=3, n=2, chunk=3, max_tokens=9, total=6)
        runs.append(summary(train(gen, 6, engine=eng, sleep_rng=None if timing is None else random.Random(timing))))
    assert runs[0] == runs[1] == runs[2]
    # trained groups are never more than k versions old at their step (drop policy)
    for step, batch in enumerate(runs[0], start=1):
        for _, _, versions, _ in batch[:-1]:
            assert step - 1 - min(min(v) for v in versions) <= k


def test_clock_schedule_keeps_the_bound_and_admission_limit():
    eng = StandInEngine(jitter=0.003)
    buf, gen = make(eng, k=2, groups=2, n=2, chunk=2, max_tokens=8, total=8, deterministic=False)
    batches = train(gen, 8, engine=eng, sleep_rng=random.Random(3))
    for step, batch in enumerate(batches, start=1):
        assert len(batch.groups) == 2
        for g in batch.groups:
            assert step - 1 - g.oldest_version <= 2
    # every admitted group is accounted for: trained, dropped, or abandoned in flight at the end
    trained = sum(len(b.groups) for b in batches)
    dropped = sum(b.dropped for b in batches)
    assert trained + dropped <= buf.admitted <= trained + dropped + 2 + 2  # in flight at most B per chunk


def test_a_snapshot_continues_exactly():
    """Stop after step 3's push, load its snapshot into a fresh buffer (the prompt stream where it
    stood), and the steps after equal the uninterrupted run's."""
    eng = StandInEngine()
    _, gen = make(eng, k=2, groups=2, n=2, chunk=3, max_tokens=9, total=7)
    full = summary(train(gen, 7, engine=eng))

    eng = StandInEngine()
    buf, gen = make(eng, k=2, groups=2, n=2, chunk=3, max_tokens=9, total=7)
    first = train(gen, 3, engine=eng)
    state = buf.state_dict()
    assert state["taken"] == 3 and state["version"] == 3

    eng2 = StandInEngine()
    eng2.weights = 3  # the resumed engine gets the checkpoint's weights
    buf2, gen2 = make(eng2, k=2, groups=2, n=2, chunk=3, max_tokens=9, total=7)
    gen2.prompt_rng.random()  # a different position: the snapshot's must win
    buf2.load_state_dict(state)
    gen2.restore_prompt_rng()
    rest = train(gen2, 4, engine=eng2, start=4)
    assert summary(first) == full[:3]
    assert summary(rest) == full[3:]


def test_chunk_seeds_are_distinct_and_stable():
    seeds = {chunk_seed(0, r, g, j, c) for r in range(2) for g in range(20) for j in range(8) for c in range(4)}
    assert len(seeds) == 2 * 20 * 8 * 4
    assert chunk_seed(5, 0, 3, 1, 2) == chunk_seed(5, 0, 3, 1, 2) < 1 << 62


def test_an_engine_error_reaches_the_trainer_thread():
    class Broken(StandInEngine):
        def generate(self, *a, **kw):
            raise RuntimeError("engine died")
    _, gen = make(Broken(), k=1, groups=1)
    with pytest.raises(RuntimeError, match="engine died") as e:
        gen.take(1)
    assert "asynchronous rollout thread" in str(e.value.__notes__)


def test_a_clock_run_resumed_from_a_snapshot_trains_no_group_twice_and_loses_none():
    """clock: timing decides the interleaving, so a resumed run need not equal the uninterrupted one;
    what the snapshot guarantees is that the batches it holds are trained as they are, no group is
    trained twice, and every group admitted before it is trained or counted as dropped."""
    def build(eng):
        return make(eng, k=2, groups=2, n=2, chunk=3, max_tokens=9, total=8, deterministic=False)

    eng = StandInEngine(jitter=0.002)
    buf, gen = build(eng)
    first = train(gen, 3, engine=eng, sleep_rng=random.Random(1))
    assert buf.state_dict() is None  # clock: no snapshot at the pushes, only for a checkpoint
    gen.checkpoint_snapshot(3)
    state = buf.state_dict()
    eng2 = StandInEngine(jitter=0.002)
    eng2.weights = 3
    buf2, gen2 = build(eng2)
    buf2.load_state_dict(state)
    gen2.restore_prompt_rng()
    rest = train(gen2, 5, engine=eng2, start=4, sleep_rng=random.Random(2))
    held = [[g.index for g in b.groups] for b in state["ready"]]
    assert [[g.index for g in b.groups] for b in rest[:len(held)]] == held
    trained = [g.index for b in first + rest for g in b.groups]
    dropped = [i for b in first + rest for i in b.dropped_ids]
    assert len(set(trained)) == len(trained) and not set(trained) & set(dropped)
    # a group runs at most 3 chunks (9 tokens, chunks of 3) and 5 more batches need at least 5: every
    # group the snapshot holds in flight finishes before the run ends
    assert set(range(state["admitted"])) <= set(trained) | set(dropped)


def test_a_snapshot_without_a_push_is_taken_at_a_chunk_boundary():
    """TrainingDiverged writes a checkpoint after a step that pushed nothing: checkpoint_snapshot
    takes the buffer between two chunks (the engine lock), with the batches the trainer has taken."""
    eng = StandInEngine()
    buf, gen = make(eng, k=2, groups=2, n=2, chunk=3, max_tokens=9, total=6)
    gen.take(1)
    gen.checkpoint_snapshot(1)
    state = buf.state_dict()
    assert state["taken"] == 1 and state["version"] == 0
    assert all(len(t.response_ids) % 3 == 0 or t.finish_reason for g in state["active"] for t in g.trajectories)
    gen.stop()


def _lineage(batch, k):
    """prompts.jsonl's row of `batch` (RolloutStage.lineage on one rank; its reductions are the identity)."""
    from types import SimpleNamespace

    from dsrl.stages.rollout import RolloutStage

    stage = RolloutStage.__new__(RolloutStage)
    stage.cfg = SimpleNamespace(algo=SimpleNamespace(off_policy_steps=k))
    stage.generator = SimpleNamespace(take=lambda s: batch, generation_seconds=0.0)
    stage.fault_counters, stage.source = (), None
    [row] = stage.lineage(batch.index, stage._async_batch(batch.index))
    return row


def test_groups_are_numbered_by_their_draw_and_a_resumed_clock_run_keeps_the_numbers():
    """A group's admission index is its prompt's draw number in the rank's prompt stream (one draw per
    admission), the identity prompts.jsonl records: replaying the stream, group i's prompt is the i-th
    draw. A clock snapshot (the checkpoint of step 3) restored into a fresh buffer keeps its groups in
    flight with their numbers and prompts, new admissions continue the stream and the count, and over
    both runs each number is trained or dropped once (long prompts, one in four, are overtaken and
    dropped), or still in flight at the end."""
    lengths = {p: (16 if p % 4 == 1 else 2) for p in range(100, 10_000)}

    def build(seed, weights=0):
        eng = StandInEngine(lengths=lengths, jitter=0.0005)
        eng.rng, eng.weights = random.Random(seed), weights
        return (eng, *make(eng, k=1, groups=4, n=2, chunk=2, max_tokens=16, total=8, deterministic=False))

    stream = random.Random(0)  # make()'s prompt stream, replayed
    draws = [stream.randrange(100, 10_000) for _ in range(200)]

    eng, buf, gen = build(0)
    first = train(gen, 3, engine=eng, sleep_rng=random.Random(1))
    gen.checkpoint_snapshot(3)
    state = buf.state_dict()
    in_flight = [(g.index, g.prompt) for g in state["active"]]

    eng2, buf2, gen2 = build(1, weights=3)
    buf2.load_state_dict(state)
    assert buf2.resume(3, deterministic=False) is None
    gen2.restore_prompt_rng()
    assert [(g.index, g.prompt) for g in buf2.active] == in_flight
    rest = train(gen2, 5, engine=eng2, start=4, sleep_rng=random.Random(2))

    rows = [_lineage(b, 1) for b in first + rest]
    assert [r["step"] for r in rows] == list(range(1, 9)) and all(len(r["trained"]) == 4 for r in rows)
    groups = {g.index: g for b in first + rest for g in b.groups}
    assert [r["trained"] for r in rows] == [[g.index for g in b.groups] for b in first + rest]
    assert [r["dropped"] for r in rows] == [sorted(b.dropped_ids) for b in first + rest]
    trained = [i for r in rows for i in r["trained"]]
    dropped = [i for r in rows for i in r["dropped"]]
    assert dropped and all(draws[i] % 4 == 1 for i in dropped)  # the long ones
    assert all(groups[i].prompt == draws[i] for i in trained)  # each number is its draw, after the resume too
    assert [u for r in rows for u in r["trained_prompts"] + r["dropped_prompts"]] == \
        [str(draws[i]) for r in rows for i in r["trained"] + r["dropped"]]
    assert {i for i, _ in in_flight} <= set(trained) | set(dropped)  # the snapshot's groups in flight, not lost
    left = [g.index for g in buf2.active + buf2.open_batch + buf2.open_dropped + buf2.waiting]
    numbers = sorted(trained + dropped + left)
    assert numbers == list(range(buf2.admitted)), "a draw trained twice, or lost"
