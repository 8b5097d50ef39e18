"""Host-side statistics across ranks (counts, sums, flags) on any process-group backend.

The trainer's statistics are Python numbers or CPU tensors. gloo reduces CPU tensors; NCCL
reduces only device tensors and fails on CPU ones. So every host statistic goes through
`all_reduce_`, which runs the collective on the device the group's backend can reduce
(`reduction_device`: the CPU for gloo/mpi, the accelerator's current device, e.g. cuda:LOCAL_RANK,
for nccl and other device backends) and copies the result back in place."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

# Backends that reduce host (CPU) tensors.
HOST_BACKENDS = ("gloo", "mpi", "ccl")


def reduction_device(backend: str) -> torch.device:
    """The device whose tensors a group with backend name `backend` can reduce. `backend` is
    what `dist.get_backend(group)` returns: a plain name ("gloo", "nccl") or a per-device
    mapping ("cpu:gloo,cuda:nccl"), where a CPU entry means host tensors are fine."""
    name = str(backend).lower()
    for part in name.split(","):
        dev, _, backend_of_part = part.rpartition(":")
        if dev == "cpu" or (not dev and backend_of_part in HOST_BACKENDS):
            return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's accelerator API names the device this rank was bound to (cuda:LOCAL_RANK).
    return torch.device(get_accelerator().current_device_name())


def _distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_(t: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """In-place all-reduce of `t` (any device) over `group` (default: the world), run on the
    group backend's reduction device. Returns `t`. A no-op outside a multi-rank job."""
    if not _distributed(group):
        return t
    op = dist.ReduceOp.SUM if op is None else op
    device = reduction_device(dist.get_backend(group))
    work = t if t.device == device else t.to(device)
    dist.all_reduce(work, op=op, group=group)
    if work is not t:
        t.copy_(work)
    return t


def all_reduce_sum(values: List[float]) -> List[float]:
    """Element-wise sum of `values` over all ranks (float64 on the wire)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return all_reduce_(t).tolist()


def all_reduce_max(value: float) -> float:
    """The largest `value` of any rank."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    return float(all_reduce_(t, op=dist.ReduceOp.MAX).item())


def broadcast_from_rank0(obj):
    """Global rank 0's `obj` on every rank (a picklable object, over the default process group);
    the object itself when there is one rank. Collective."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (a picklable object), in rank order, on every rank; `[obj]` when there
    is one rank. Collective."""
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
