"""The CUDA IPC weight sync's memory bound, counted on CPU (dsrl.rollout.cuda_ipc): the buckets
stream from the actor's export into the engine, so the trainer never holds a second full copy of
the model. The real WeightSync.push -> ResilientWorker -> VLLMWorker.push_weights ->
push_ipc_buckets path runs; only the CUDA calls are replaced: buckets are CPU buffers whose
lifetimes are tracked, the 'engine' (collective_rpc) resolves each handle and, as vLLM's layerwise
reload does for a layer split across buckets, keeps the previous bucket until the next one
arrives. Before, every bucket stayed alive until the last one was loaded."""
import dataclasses
import weakref

import pytest
import torch

from dsrl.config.schema import RolloutConfig
from dsrl.rollout import cuda_ipc, weight_sync
from dsrl.rollout.resilient import ResilientWorker, RolloutEngineError
from dsrl.rollout.vllm_engine import VLLMEngine
from dsrl.rollout.vllm_worker import LocalEngine, VLLMWorker

pytestmark = pytest.mark.slow  # one tiny DeepSpeed engine


class Live:
    """Bucket buffers alive right now (weakref finalizers), and the most seen at once."""

    def __init__(self):
        self.now, self.most, self.total = {}, 0, 0

    def alloc(self, index, nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.now[index] = nbytes
        self.total += nbytes
        weakref.finalize(t, self.now.pop, index, None)
        return t

    def note(self):
        self.most = max(self.most, sum(self.now.values()))


class EngineDeadError(RuntimeError):
    """Named like vLLM's: ResilientWorker treats it as the engine's death."""


class FakeEngine:
    """collective_rpc(load_ipc_bucket, args=(handle, rows, first, last)): resolves the handle to the
    bucket, holds it until the next call (a layer split across two buckets), counts."""

    def __init__(self, live, die_at=None):
        self.live, self.held, self.calls, self.die_at = live, None, [], die_at

    def collective_rpc(self, fn, args):
        assert fn is cuda_ipc.load_ipc_bucket
        handle, rows, first, last = args
        if self.die_at is not None and len(self.calls) == self.die_at:
            raise EngineDeadError("engine core died")
        self.held = handle["ref"]()  # the engine maps it; vLLM keeps views of it until the layer completes
        assert self.held is not None, "a bucket was freed before the engine loaded it"
        self.calls.append((len(rows), first, last))
        self.live.note()
        if last:
            self.held = None

    def reset_prefix_cache(self):
        self.cache_resets = getattr(self, "cache_resets", 0) + 1


def _worker(fake_llm):
    """The real VLLMWorker -> VLLMEngine.push_ipc path, with the fake in place of vllm.LLM."""
    engine = object.__new__(VLLMEngine)
    engine.llm = fake_llm
    w = object.__new__(VLLMWorker)
    w._engine = LocalEngine(engine)
    return w


@pytest.fixture()
def ipc(monkeypatch):
    live = Live()
    monkeypatch.setattr(weight_sync, "_ipc_worker", lambda worker: True)
    monkeypatch.setattr(cuda_ipc, "gpu_alloc", lambda: live.alloc)
    monkeypatch.setattr(cuda_ipc, "ipc_handle", lambda data: {"ref": weakref.ref(data)})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(VLLMWorker, "shared_memory_sync", property(lambda self: False))
    monkeypatch.setattr(VLLMWorker, "engine_alive", lambda self: True)  # the fake engine has no processes
    monkeypatch.setattr(VLLMWorker, "kill", lambda self: None)
    return live


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    from dsrl.actor.engine import ActorEngine

    return ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=2)


class EvenActor:
    """An actor whose export is 48 equal 48 KiB tensors (a model with no dominant embedding), so the
    bound is far below the model's size; the tiny Llama's 25 MB embedding is most of its 26 MB."""

    hf_config = None
    lora = None

    def export_named_tensors(self, copy=False, device=None):
        for i in range(48):
            yield f"model.layers.{i // 4}.w{i % 4}", torch.full((12288,), float(i))

    def weights_pushed(self):
        self.pushed = True


@pytest.mark.parametrize("which", ["tiny-engine", "even"])
def test_an_ipc_push_streams_with_at_most_three_buckets_alive(ipc, actor, which):
    src = actor if which == "tiny-engine" else EvenActor()
    engine = FakeEngine(ipc)
    cfg = dataclasses.replace(RolloutConfig(), sync_probe=False, sync_bucket_mb=0.1)
    worker = ResilientWorker(lambda: _worker(engine), name="engine 0", max_restarts=2, timeout_s=60)
    metrics = weight_sync.WeightSync(src, worker, cfg).push(1)
    n = int(metrics["rollout/sync_buckets"])
    assert n >= 8 and len(engine.calls) == n
    assert [c[1] for c in engine.calls] == [True] + [False] * (n - 1)  # one session: first ...
    assert [c[2] for c in engine.calls] == [False] * (n - 1) + [True]  # ... and last
    assert metrics["rollout/sync_bytes"] == ipc.total
    assert ipc.now == {}  # nothing left alive after the push
    assert engine.cache_resets == 1  # the prefix cache of the old weights is dropped once
    # The bound: the bucket being loaded, the look-ahead one and the one the engine still reads.
    sizes = sorted((b.nbytes for b in _buckets(src, cfg)), reverse=True)
    assert ipc.most <= sum(sizes[:3]), (ipc.most, sizes[:3])
    if which == "even":
        assert ipc.most <= ipc.total / 4, (ipc.most, ipc.total)  # before: every bucket, ipc.total


def _buckets(actor, cfg):
    from dsrl.rollout.buckets import pack_buckets

    return list(pack_buckets(actor.export_named_tensors(copy=True), int(cfg.sync_bucket_mb * (1 << 20))))


def test_a_streamed_push_that_fails_is_not_replayed_into_a_rebuilt_engine(ipc, actor):
    engines = [FakeEngine(ipc, die_at=3), FakeEngine(ipc)]
    made = iter(engines)
    cfg = dataclasses.replace(RolloutConfig(), sync_probe=False, sync_bucket_mb=0.1)
    worker = ResilientWorker(lambda: _worker(next(made)), name="engine 0", max_restarts=2, timeout_s=60)
    with pytest.raises(RolloutEngineError, match="a streamed weight push cannot be replayed"):
        weight_sync.WeightSync(actor, worker, cfg).push(1)
    assert len(engines[0].calls) == 3 and engines[1].calls == []
