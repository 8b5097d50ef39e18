"""Weight sync into a colocated vLLM engine on the same GPU through CUDA IPC handles.

NOT YET RUN ON A GPU: written from torch's `multiprocessing/reductions.py` (OpenRLHF, verl and
vLLM 0.33's `ipc_engine.py` hand weights over the same way); the CPU build cannot exercise it.
`launch/gpu_smoke.sh vllm` is where it gets checked.

Per bucket (a uint8 CUDA buffer from dsrl.rollout.buckets): `reduce_tensor` gives a picklable
handle; one `collective_rpc` carries it with the tensors' metadata; the engine's worker rebuilds
the buffer on ITS index of the same physical GPU (the two processes may number GPUs differently,
so the handle names the GPU by UUID and the consumer overrides `storage_device`, args[6]) and
loads it like a shared-memory bucket (dsrl.rollout.engine_load: one layerwise-reload session over
all buckets).

Memory bound: the trainer never holds a second full copy of the model on its GPU. The buckets
stream: dsrl.rollout.weight_sync packs them lazily, and here each bucket is dropped by the
producer as soon as the engine's call for it has returned; only the next bucket is held besides
(the `last` flag needs one bucket of look-ahead). A dropped block stays valid while the engine
still maps it: torch's CUDA IPC reference counting keeps a sent block out of the caching
allocator until every consumer released it (`torch.cuda.ipc_collect()` reclaims those). The
engine releases a bucket once vLLM's layerwise reload no longer buffers views of it, i.e. when
every layer with a tensor in it is complete (dsrl.rollout.engine_load keeps no extra reference).
So at most two buckets plus the buckets of the one layer group being loaded are live: bytes in
flight <= 2 * rollout.sync_bucket_mb + one decoder layer (tests/rollout/test_ipc_stream.py counts
them on CPU). Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set by dsrl.rollout.vllm_worker). Never
load into a sleeping engine (P1): wake its weights first."""
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
    """Trainer side: every bucket into the engine, one RPC each, dropped once its call returned
    (see the module docstring for the bound); returns the bytes sent. `buckets` may be a lazy
    iterator (it is consumed once). The 'last' flag needs one bucket of look-ahead."""
    sent = 0
    it = iter(buckets)
    current = next(it, None)
    first = True
    try:
        while current is not None:
            nxt = next(it, None)
            llm.collective_rpc(load_ipc_bucket, args=(ipc_handle(current.data), meta_tuples(current.metas),
                                                      first, nxt is None))
            sent += current.nbytes
            first, current = False, nxt  # the loaded bucket's last producer reference goes here
            torch.cuda.ipc_collect()  # blocks the engine has released go back to the allocator
        torch.cuda.synchronize()
    finally:
        current = None
        torch.cuda.ipc_collect()
    return sent
