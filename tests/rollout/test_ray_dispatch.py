"""The multi-engine dispatch policy (dsrl.distributed.ray_dispatch) with fake engines: a
deterministic simulation of engines that run their calls one at a time (like Ray actors with
max_concurrency=1) at different speeds, on a simulated clock. Checks the order of results,
which engine got which chunk (hand-computed), errors and the deadline. Plus the pure helpers of
dsrl.rollout.ray_engines, the config checks of rollout.placement, and (two gloo ranks) a
leader-side failure reaching every rank as a named error."""
from __future__ import annotations

import pytest

from dsrl.distributed.ray_dispatch import DispatchTimeout, LeastOutstanding, dispatch_in_order, split_even
from dsrl.rollout.ray_engines import bundle_for_engine, node_local_slots


class FakeEngines:
    """Engine e needs `ticks[e]` simulated ticks per unit of cost and runs its calls in arrival
    order; ticks None = hung (never answers). `fail` = (engine, chunk) whose fetch raises."""

    def __init__(self, ticks, fail=None):
        self.ticks, self.fail = ticks, fail
        self.now = 0.0
        self.busy_until = [0.0] * len(ticks)
        self.finish = {}  # handle -> finish time
        self.log = []     # (chunk, engine) in submission order

    def submit(self, e, chunk):
        handle = (e, chunk)
        self.log.append((chunk, e))
        if self.ticks[e] is None:
            self.finish[handle] = float("inf")
        else:
            start = max(self.now, self.busy_until[e])
            self.busy_until[e] = self.finish[handle] = start + chunk_cost(chunk) * self.ticks[e]
        return handle

    def wait(self, handles, timeout):
        t = min(self.finish[h] for h in handles)
        if t == float("inf"):
            return []
        self.now = t
        return [h for h in handles if self.finish[h] == t]

    def fetch(self, e, handle):
        if self.fail == handle:
            raise RuntimeError(f"engine {e} died")
        return f"result of {handle[1]} from engine {e}"


def chunk_cost(chunk):
    return chunk[1] - chunk[0]


def _run(fake, chunks, n_engines, **kw):
    return dispatch_in_order(chunks, n_engines, submit=fake.submit, wait=fake.wait, fetch=fake.fetch,
                             cost=chunk_cost, **kw)


def test_split_even_covers_everything_in_order():
    assert split_even(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_even(3, 8) == [(0, 1), (1, 2), (2, 3)]  # never an empty chunk
    assert split_even(0, 4) == []
    with pytest.raises(ValueError, match="n_chunks=0"):
        split_even(5, 0)


def test_least_outstanding_picks_the_lightest_engine_with_room():
    p = LeastOutstanding(3, max_inflight=2, first=1)
    assert p.pick() == 1  # all idle: the rotation starts at `first`
    p.started(1, 5.0)
    assert p.pick() == 2  # 0 and 2 idle; 2 comes first counting from 1
    p.started(2, 1.0)
    assert p.pick() == 0
    p.started(0, 3.0)
    assert p.pick() == 2  # loads [3, 5, 1]
    p.started(2, 1.0)
    assert p.pick() == 0  # 2 is full (2 in flight); loads [3, 5, 2]
    p.started(0, 1.0)
    p.started(1, 1.0)
    assert p.pick() is None  # every engine holds max_inflight chunks
    p.finished(1, 5.0)
    assert p.pick() == 1


def test_results_come_back_in_order_and_the_fast_engine_takes_more():
    """Engine 0 needs 3 ticks per prompt, engine 1 one tick; one chunk in flight per engine.
    Hand-computed: t=0 chunk0->e0 (ends 3), chunk1->e1 (ends 1); t=1 chunk2->e1 (2); t=2
    chunk3->e1 (3); t=3 chunk0 and chunk3 end, chunk4->e0 (6), chunk5->e1 (4)."""
    chunks = split_even(6, 6)
    fake = FakeEngines([3, 1])
    out = _run(fake, chunks, 2, max_inflight=1)
    assert out == [f"result of {c} from engine {e}" for c, e in
                   zip(chunks, [0, 1, 1, 1, 0, 1])]
    assert fake.log == [(chunks[0], 0), (chunks[1], 1), (chunks[2], 1), (chunks[3], 1), (chunks[4], 0),
                        (chunks[5], 1)]
    assert fake.now == 6.0  # all done when the slow engine finished its second chunk


def test_rank_offset_and_queue_depth():
    """first=1: ties start at engine 1; max_inflight=2 queues a second chunk on each engine
    before any finishes (no idle gap between calls)."""
    chunks = split_even(4, 4)
    fake = FakeEngines([1, 1])
    _run(fake, chunks, 2, max_inflight=2, first=1)
    assert [e for _, e in fake.log] == [1, 0, 1, 0]


def test_costs_weigh_the_choice():
    """A big chunk on engine 0 makes the next two small ones go to engine 1."""
    chunks = [(0, 8), (8, 9), (9, 10)]
    fake = FakeEngines([1, 1])
    _run(fake, chunks, 2, max_inflight=3)
    assert [e for _, e in fake.log] == [0, 1, 1]


def test_an_engine_error_propagates_at_once():
    chunks = split_even(4, 4)
    fake = FakeEngines([1, 1], fail=(1, chunks[1]))
    with pytest.raises(RuntimeError, match="engine 1 died"):
        _run(fake, chunks, 2, max_inflight=1)


def test_a_hung_engine_hits_the_deadline_with_its_index():
    chunks = split_even(4, 4)
    fake = FakeEngines([1, None])
    with pytest.raises(DispatchTimeout) as info:
        _run(fake, chunks, 2, max_inflight=1, timeout_s=0.0)
    assert info.value.engines == [1]


def test_on_done_reports_each_chunk_once():
    chunks = split_even(5, 3)
    seen = []
    fake = FakeEngines([2, 1])
    _run(fake, chunks, 2, max_inflight=1, on_done=lambda e, c: seen.append(c))
    assert sorted(seen) == chunks


def test_bundles_and_node_local_core_slots():
    assert bundle_for_engine(gpu=False, tensor_parallel_size=1, cpus_per_engine=2) == {"CPU": 2.0}
    assert bundle_for_engine(gpu=True, tensor_parallel_size=4, cpus_per_engine=1) == {"CPU": 1.0, "GPU": 4.0}
    # Bundles of two nodes interleaved (Ray does not group them): slots count per node.
    assert node_local_slots(["a", "b", "a", "a", "b"]) == [(0, 3), (0, 2), (1, 3), (2, 3), (1, 2)]


def _cfg(**rollout):
    from dsrl.config.schema import Config

    cfg = Config()
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


@pytest.mark.parametrize("overrides, message", [
    ({"placement": "remote"}, "rollout.placement='remote' is not one of"),
    ({"placement": "ray", "num_engines": 0}, "rollout.num_engines=0"),
    ({"placement": "ray", "cpus_per_engine": 0}, "rollout.cpus_per_engine=0"),
    ({"placement": "ray", "ray_address": " "}, "rollout.ray_address is empty"),
    ({"tensor_parallel_size": 2}, "rollout.tensor_parallel_size=2 > 1 needs rollout.placement=ray"),
    ({"placement": "ray", "backend": "hf"}, "rollout.backend=hf runs in the trainer's process: it needs "
                                            "rollout.placement=colocated"),
])
def test_placement_config_errors_name_the_key(overrides, message):
    from dsrl.errors import ConfigError
    from dsrl.validation.validate import validate

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate(_cfg(**overrides))


def test_tensor_parallel_needs_cuda(monkeypatch):
    import torch

    from dsrl.errors import ConfigError
    from dsrl.validation.validate import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 > 1 needs CUDA"):
        validate(_cfg(placement="ray", tensor_parallel_size=2))


def test_ray_placement_defaults_validate():
    from dsrl.validation.validate import validate

    validate(_cfg(placement="ray", num_engines=2, ray_address="local"))


def _leader_rank(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks: rank 0's work succeeds once, then fails; rank 1 must get the
    result, then the failure as a named error (not a hang in the next collective)."""
    import json
    import os

    import torch.distributed as dist

    from dsrl.rollout.ray_engines import _on_leader
    from dsrl.rollout.resilient import RolloutEngineError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    record = {}
    record["first"] = _on_leader(rank == 0, lambda: {"engine-0": [1.5]}, "probe")

    def fail():
        raise RuntimeError("engine-1 died")

    try:
        _on_leader(rank == 0, fail, "push the weights")
    except RolloutEngineError as e:
        record["error"] = f"RolloutEngineError: {e}"
    except RuntimeError as e:
        record["error"] = f"RuntimeError: {e}"
    dist.barrier()  # both ranks reach the next collective
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.mark.slow  # two spawned gloo ranks: ~7 s of CPU, longer on a busy machine
def test_a_leader_failure_reaches_every_rank(tmp_path):
    import json

    import torch.multiprocessing as mp

    from dsrl.distributed.ports import free_port

    mp.spawn(_leader_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["first"] == r1["first"] == {"engine-0": [1.5]}
    assert r0["error"] == "RuntimeError: engine-1 died"  # the leader raises its own error
    assert r1["error"] == "RolloutEngineError: rank 0 could not push the weights: RuntimeError: engine-1 died"
