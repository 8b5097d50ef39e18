"""The clock schedule, honest about what it drops (stand-in engine of tests/rollout/test_async_buffer.py):
- on a long-tailed task under stale_groups=drop the long groups are the ones dropped, and the step
  metrics show it: dropped groups' count and mean length apart from the trained ones', per-token
  staleness (mean, the fraction of tokens sampled by an older version, responses spanning versions);
- stale_groups=admission (bind: group i joins batch i // B + 1, admitted while that batch is at most
  k versions ahead) drops nothing, trains every group exactly once in admission order, and keeps
  every token within k versions, whatever the timing."""
from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rollout"))

from test_async_buffer import StandInEngine, make, train  # noqa: E402

from dsrl.stages.rollout import RolloutStage  # noqa: E402

G, K, STEPS = 4, 1, 8


def _long_tailed():
    """One prompt in four runs to 24 tokens, the rest stop after 2 (chunks of 2): prompts are the
    admission index (prompts=range), so every fourth group is long."""
    return StandInEngine(lengths={i: (24 if i % 4 == 1 else 2) for i in range(1000)}, jitter=0.0005)


def _run(stale_groups: str, seed: int):
    """A trainer that takes and pushes at once (the weights move as fast as batches close); the
    engine's timing jittered by `seed`."""
    eng = _long_tailed()
    eng.rng = random.Random(seed)
    buf, gen = make(eng, k=K, groups=G, n=2, chunk=2, max_tokens=24, total=STEPS, deterministic=False,
                    drop=stale_groups == "drop", prompts=range(1000))
    buf.bind = stale_groups == "admission"
    return buf, train(gen, STEPS, engine=eng)


def _stage_metrics(batch, step):
    """RolloutStage's metrics of one batch (one rank: the reductions are the identity)."""
    stage = RolloutStage.__new__(RolloutStage)
    stage.cfg = SimpleNamespace(algo=SimpleNamespace(off_policy_steps=K, dynamic_sampling=False))
    stage.generator = SimpleNamespace(take=lambda s: batch, generation_seconds=0.0)
    stage.fault_counters, stage.source = (), None
    rollout = stage._async_batch(step)
    return stage.metrics(step, rollout)


@pytest.mark.parametrize("seed", [0, 1])
def test_drop_loses_the_long_groups_and_the_metrics_say_so(seed):
    buf, batches = _run("drop", seed)
    trained = [g for b in batches for g in b.groups]
    dropped = [i for b in batches for i in b.dropped_ids]
    assert dropped and all(i % 4 == 1 for i in dropped)  # only long groups are overtaken and dropped
    long_trained = sum(1 for g in trained if g.index % 4 == 1) / len(trained)
    assert long_trained < 0.25  # a quarter of the admitted groups, fewer of the trained ones
    b = next(b for b in batches if b.dropped)
    m = _stage_metrics(b, b.index)
    lengths = [len(t.response_ids) for g in b.groups for t in g.trajectories]
    assert m["async/dropped_groups"] == b.dropped
    assert m["async/dropped_response_length"] == b.dropped_length_sum / b.dropped_samples == 24
    assert m["async/trained_response_length"] == sum(lengths) / len(lengths)
    versions = [t.versions for g in b.groups for t in g.trajectories]
    tokens = [v for vs in versions for v in vs]
    assert m["async/stale_token_fraction"] == sum(1 for v in tokens if b.index - 1 - v > 0) / len(tokens)
    assert m["async/spanning_responses"] == sum(1 for vs in versions if len(set(vs)) > 1) / len(versions)
    assert m["async/token_lag_mean"] == sum(b.index - 1 - v for v in tokens) / len(tokens)


@pytest.mark.parametrize("seed", [0, 1])
def test_admission_bound_trains_every_group_once_in_order_within_k(seed):
    buf, batches = _run("admission", seed)
    assert [[g.index for g in sorted(b.groups, key=lambda g: g.index)] for b in batches] == \
        [list(range(G * s, G * (s + 1))) for s in range(STEPS)]
    assert all(b.dropped == 0 for b in batches)
    for step, b in enumerate(batches, start=1):
        assert all(step - 1 - v <= K for g in b.groups for t in g.trajectories for v in t.versions)
    long_trained = sum(1 for b in batches for g in b.groups if g.index % 4 == 1)
    assert long_trained == STEPS  # one long group per batch, as admitted


def test_admission_bound_resumed_from_a_checkpoint_snapshot_loses_and_repeats_no_group():
    eng = _long_tailed()
    buf, gen = make(eng, k=K, groups=G, n=2, chunk=2, max_tokens=24, total=STEPS, deterministic=False,
                    drop=False, prompts=range(1000))
    buf.bind = True
    first = train(gen, 3, engine=eng, sleep_rng=random.Random(5))
    gen.checkpoint_snapshot(3)
    state = buf.state_dict()
    eng2 = _long_tailed()
    eng2.weights = 3
    buf2, gen2 = make(eng2, k=K, groups=G, n=2, chunk=2, max_tokens=24, total=STEPS, deterministic=False,
                      drop=False, prompts=range(state["admitted"], 1000))  # the prompt stream where it stood
    buf2.bind = True
    buf2.load_state_dict(state)
    assert buf2.resume(3, deterministic=False) is None
    rest = train(gen2, STEPS - 3, engine=eng2, start=4, sleep_rng=random.Random(6))
    assert sorted(g.index for b in first + rest for g in b.groups) == list(range(G * STEPS))
