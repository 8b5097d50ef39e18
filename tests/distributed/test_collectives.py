"""Host statistics across ranks (dsrl.distributed.collectives): right sums on 2 real gloo ranks,
and the reduction device chosen from the group's backend name."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.distributed import collectives
from dsrl.distributed.ports import free_port


def _ranks(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        sums = collectives.all_reduce_sum([1.5 + rank, 10 * rank, 2 ** 40 + rank])
        top = collectives.all_reduce_max(3.0 - 5 * rank)
        t = torch.tensor([rank, 7], dtype=torch.long)
        collectives.all_reduce_(t, op=dist.ReduceOp.MAX)
        sub = dist.new_group([0, 1], backend="gloo")
        g = torch.tensor([0.25 * (rank + 1)], dtype=torch.float64)
        collectives.all_reduce_(g, group=sub)
        torch.save({"sums": sums, "max": top, "t": t, "g": g}, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sums_and_maxima_of_two_gloo_ranks(tmp_path):
    mp.spawn(_ranks, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"r{rank}.pt")
        # hand-computed: (1.5 + 2.5), (0 + 10), (2^40 + 2^40 + 1) exact in float64
        assert got["sums"] == [4.0, 10.0, float(2 ** 41 + 1)]
        assert got["max"] == 3.0
        assert torch.equal(got["t"], torch.tensor([1, 7]))
        assert torch.equal(got["g"], torch.tensor([0.75], dtype=torch.float64))


def test_single_process_passes_values_through():
    assert collectives.all_reduce_sum([1.0, 2.5]) == [1.0, 2.5]
    assert collectives.all_reduce_max(-4) == -4.0


@pytest.mark.parametrize("backend", ["gloo", "GLOO", "mpi", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"])
def test_host_backends_reduce_on_the_cpu(backend):
    assert collectives.reduction_device(backend) == torch.device("cpu")


class _FakeAccelerator:
    def __init__(self):
        self.calls = 0

    def current_device_name(self):
        self.calls += 1
        return "cuda:3"


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl", "xccl"])
def test_device_backends_reduce_on_the_accelerator_device(monkeypatch, backend):
    """Under NCCL the statistics go to the device DeepSpeed's accelerator API names (the rank's
    bound GPU), never a hard-coded "cuda"."""
    import deepspeed.accelerator

    fake = _FakeAccelerator()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    assert collectives.reduction_device(backend) == torch.device("cuda", 3)
    assert fake.calls == 1
