"""Weight sync into a colocated vLLM engine on the same GPU through CUDA IPC handles.

NOT YET RUN ON A GPU: written from torch's `multiprocessing/reductions.py` and the reading notes
in shared/reference/gpu-path.md §1d / P8 (OpenRLHF, verl and vLLM 0.33's `ipc_engine.py` do the
same); the CPU build cannot exercise it. `launch/gpu_smoke.sh vllm` is where it gets checked.

Per bucket (a uint8 CUDA buffer from dsrl.rollout.buckets): `reduce_tensor` gives a picklable
handle; one `collective_rpc` carries it with the tensors' metadata; the engine's worker rebuilds
the buffer on ITS index of the same physical GPU (the two processes may number GPUs differently,
so the handle names the GPU by UUID and the consumer overrides `storage_device`, args[6]) and
loads it like a shared-memory bucket (dsrl.rollout.engine_load: one layerwise-reload session over
all buckets). The handle does not keep the storage alive: the producer holds every bucket until
the last bucket's call has returned (loaders may keep views until their layer is complete), then
drops them and calls `torch.cuda.ipc_collect()`. Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set by
dsrl.rollout.vllm_worker). Never load into a sleeping engine (P1): wake its weights first."""
from __future__ import annotations

from typing import Iterable, List

import torch

from dsrl.rollout.buckets import Bucket
from dsrl.rollout.engine_load import MetaTuple, load_bucket, meta_tuples, metas_from_tuples


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def gpu_alloc():
    """pack_buckets' allocator for IPC: each bucket's buffer on this process's current GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    return lambda index, nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device)


def ipc_handle(data: torch.Tensor) -> dict:
    """{physical GPU UUID: (rebuild fn, args)} for a CUDA buffer."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not data.is_cuda:
        raise ValueError("CUDA IPC needs a CUDA tensor (pack the buckets on the GPU)")
    fn, args = reduce_tensor(data)
    return {gpu_uuid(data.device.index): (fn, args)}


def rebuild_from_handle(handle: dict) -> torch.Tensor:
    """Consumer side: the buffer, mapped on this process's index of the producer's GPU."""
    for index in range(torch.cuda.device_count()):
        entry = handle.get(gpu_uuid(index))
        if entry is not None:
            fn, args = entry
            args = list(args)
            args[6] = index  # storage_device: this process's numbering of that GPU
            return fn(*args)
    raise RuntimeError(f"no visible GPU matches the IPC handle's GPU(s) {sorted(handle)}")


def load_ipc_bucket(worker, handle: dict, rows: List[MetaTuple], first: bool, last: bool) -> int:
    """collective_rpc target (inside the vLLM worker): rebuild the bucket and load it."""
    return load_bucket(worker, rebuild_from_handle(handle), metas_from_tuples(rows), first, last)


def push_ipc_buckets(llm, buckets: Iterable[Bucket]) -> int:
    """Trainer side: every bucket into the engine, one RPC each; returns the bytes sent. The
    'last' flag needs one bucket of look-ahead, so two buckets are alive before the first call."""
    held: List[torch.Tensor] = []
    sent = 0
    it = iter(buckets)
    current = next(it, None)
    first = True
    try:
        while current is not None:
            nxt = next(it, None)
            held.append(current.data)
            llm.collective_rpc(load_ipc_bucket, args=(ipc_handle(current.data), meta_tuples(current.metas),
                                                      first, nxt is None))
            sent += current.nbytes
            first, current = False, nxt
        torch.cuda.synchronize()
    finally:
        held.clear()
        torch.cuda.ipc_collect()
    return sent
