"""A forward_backward that fails part-way leaves no gradient behind.

The custom loss `serve_plugins.fails_on_marker` raises on a microbatch that holds a datum with
the marker weight; with micro_batch_size=2 a 4-datum request whose last datum carries it fails
after its first microbatch went backward. The client's accumulated gradient must be what it
was before the request (checked through its next optimizer step against a replay without the
failed request, bit for bit), and in a merged batch of two LoRA clients only the failing one
fails. The engine-level snapshot is checked on its own too, in fp32 and bf16 (BF16_Optimizer
keeps the gradient in fp32 accumulators of its own)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from serve_helpers import MODEL_NAME, datum, hold_compute, logprobs, start_server
from serve_plugins import MARKER

pytestmark = pytest.mark.slow  # one server, LoRA and full-parameter clients of the tiny model


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    srv = start_server(tiny_model_path, tmp_path_factory.mktemp("serve_failed"), micro_batch_size=2,
                       custom_losses={"marker": "serve_plugins.fails_on_marker"})
    yield srv
    srv.stop()


def _data(seed: int, n: int = 4, marker_at=None) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks = rng.integers(10, 1000, 7).tolist()
        w = rng.uniform(0.1, 1.0, 6).tolist()
        if i == marker_at:
            w[0] = MARKER
        out.append(datum(toks[:-1], target_tokens=toks[1:], weights=w))
    return out


PROBE = _data(99, n=2)
LOSS = ("custom", {"loss_id": "marker"})


def _adam():
    from tinker import types

    return types.AdamParams(learning_rate=1e-2)


def _probe(client):
    return logprobs(client.forward(PROBE, "cross_entropy").result())


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _client(sc, rank):
    """LoRA clients of one seed start equal; full-parameter ones start from the base model."""
    return sc.create_lora_training_client(MODEL_NAME, rank=rank, **({"seed": 5} if rank else {})).result()


@pytest.mark.parametrize("rank", [4, 0], ids=["lora", "full"])
def test_a_request_that_fails_part_way_leaves_the_gradient_as_before(sc, rank):
    """A: good request, failing request, step. B (same init): good request, step. A == B bit for
    bit. Without the snapshot, A's failed request would have added its first microbatch's gradient."""
    import tinker

    a = _client(sc, rank)
    a.forward_backward(_data(1), *LOSS).result()
    with pytest.raises(tinker.RequestFailedError, match="fails_on_marker: a datum carries the marker weight"):
        a.forward_backward(_data(2, marker_at=3), *LOSS).result()
    a.optim_step(_adam()).result()
    # a second round, the failure first this time (no gradient accumulated before it)
    with pytest.raises(tinker.RequestFailedError, match="marker weight"):
        a.forward_backward(_data(3, marker_at=2), *LOSS).result()
    a.forward_backward(_data(4), *LOSS).result()
    a.optim_step(_adam()).result()

    b = _client(sc, rank)
    before = _probe(b)
    for seed in (1, 4):
        b.forward_backward(_data(seed), *LOSS).result()
        b.optim_step(_adam()).result()
    assert not _same(before, _probe(b))  # they trained
    assert _same(_probe(a), _probe(b))


def test_in_a_merged_batch_only_the_failing_client_fails(sc, server, monkeypatch):
    """C and D train at once with cross_entropy, so their requests share one forward. A datum of C
    makes the pool's forward run out of memory (injected: the engine raises on a microbatch that
    holds it). D's request succeeds as if alone, C's fails, and C keeps no gradient."""
    import tinker

    c, d, e = (sc.create_lora_training_client(MODEL_NAME, rank=4, seed=s).result() for s in (7, 8, 8))
    c_before = _probe(c)
    engine = server.service._pool.engine
    real = engine.forward_backward

    def out_of_memory_on_the_marker(mb, *args, **kwargs):
        if bool((mb["loss_weights"] == MARKER).any()):
            raise RuntimeError("DefaultCPUAllocator: not enough memory (injected)")
        return real(mb, *args, **kwargs)
    monkeypatch.setattr(engine, "forward_backward", out_of_memory_on_the_marker)
    release, batches = hold_compute(server.service)
    bad = c.forward_backward(_data(11, marker_at=3), "cross_entropy")
    good = d.forward_backward(_data(12), "cross_entropy")
    deadline = time.monotonic() + 30
    while server.service.executor.queued() < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    release.set()
    good.result()
    with pytest.raises(tinker.RequestFailedError, match="not enough memory"):
        bad.result()
    lanes = {c.model_id: "C", d.model_id: "D"}
    # they did merge (in arrival order: the SDK sends each client's request from a thread of its own)
    assert sorted((k, lanes[m]) for k, m in batches[0]) == [("fwdbwd", "C"), ("fwdbwd", "D")]
    monkeypatch.undo()
    c.optim_step(_adam()).result()
    d.optim_step(_adam()).result()
    assert _same(c_before, _probe(c))  # C kept no gradient: its step moved nothing
    e.forward_backward(_data(12), "cross_entropy").result()  # D's replay alone
    e.optim_step(_adam()).result()
    assert _same(_probe(d), _probe(e))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_gradient_snapshot_restores_bit_for_bit(tiny_model_path, dtype):
    """ZeRO-0 ActorEngine: snapshot after one microbatch, a second backward, restore: the step
    equals the step of an engine that saw only the first microbatch (fp32 ``param.grad``; bf16
    BF16_Optimizer's fp32 accumulators). A snapshot with nothing accumulated restores to none."""
    from dsrl.actor.engine import ActorEngine
    from dsrl.actor.work_units import TrainingSession

    def engine():
        eng = ActorEngine(str(tiny_model_path), zero_stage=0, dtype=dtype, trainable=True, grad_clip=0.0,
                          micro_batch_size=2, role=f"snap-{dtype}")
        return eng, TrainingSession(eng, 2)

    first = [{"model_input": [5, 6, 7, 8], "loss_fn_inputs": {"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4}}]
    second = [{"model_input": [15, 16, 17], "loss_fn_inputs": {"target_tokens": [16, 17, 18], "weights": [1.0] * 3}}]
    a, sa = engine()
    b, sb = engine()
    w0 = {n: p.detach().clone() for n, p in a.module.named_parameters()}
    assert a.gradient_snapshot() is None
    empty = a.gradient_snapshot()
    sa.forward_backward(second, "cross_entropy")
    a.restore_gradients(empty)  # nothing was accumulated: nothing is
    sa.forward_backward(first, "cross_entropy")
    snap = a.gradient_snapshot()
    sa.forward_backward(second, "cross_entropy")
    a.restore_gradients(snap)
    sb.forward_backward(first, "cross_entropy")
    sa.optim_step({"learning_rate": 1e-3})
    sb.optim_step({"learning_rate": 1e-3})
    wa = {n: p.detach().clone() for n, p in a.module.named_parameters()}
    wb = {n: p.detach().clone() for n, p in b.module.named_parameters()}
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert not all(torch.equal(wa[n], w0[n]) for n in wa)  # the step moved the weights
