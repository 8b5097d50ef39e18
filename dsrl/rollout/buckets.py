"""Weight buckets: many named tensors packed into one flat byte buffer, so a weight sync moves a
few large buffers (one call per bucket) instead of one message per parameter.

A `Bucket` is plain data (a uint8 tensor and a list of `TensorMeta`): it pickles as bytes, so it
can go to a Ray actor as is, or its bytes can be copied into shared memory and the metadata sent
alone (dsrl.rollout.shm_transport). `unpack` gives zero-copy views into the buffer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch

ALIGN = 64  # byte alignment of each tensor in a bucket: every dtype view is aligned, copies are fast


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket's buffer."""
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: Tuple[int, ...]
    offset: int  # byte offset in the bucket's buffer (a multiple of ALIGN)
    nbytes: int


@dataclass
class Bucket:
    """A flat uint8 buffer and the tensors packed in it (in packing order)."""
    data: torch.Tensor
    metas: List[TensorMeta] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes in use (the last tensor's end); `data` may be longer (a reused buffer)."""
        return self.metas[-1].offset + self.metas[-1].nbytes if self.metas else 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weight bucket")
    return dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view of a contiguous copy if needed)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def pack_buckets(named_tensors: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int, *,
                 alloc: Optional[Callable[[int, int], torch.Tensor]] = None) -> Iterator[Bucket]:
    """Pack tensors (in order) into buckets of at most `bucket_bytes` bytes; a tensor larger than
    that gets a bucket of its own. Lazy: only the current bucket's tensors are held, so a ZeRO-3
    export gathered group by group never exists in full. `alloc(index, nbytes)` may supply each
    bucket's uint8 buffer (e.g. a shared-memory segment, saving a copy); default: a new tensor."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    pending: List[Tuple[str, torch.Tensor]] = []
    size, index = 0, 0
    for name, tensor in named_tensors:
        need = _aligned(tensor.numel() * tensor.element_size())
        if pending and size + need > bucket_bytes:
            yield _fill(pending, index, alloc)
            pending, size, index = [], 0, index + 1
        pending.append((name, tensor))
        size += need
    if pending:
        yield _fill(pending, index, alloc)


def _fill(pending: List[Tuple[str, torch.Tensor]], index: int, alloc) -> Bucket:
    metas, offset = [], 0
    for name, t in pending:
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset += _aligned(nbytes)
    total = metas[-1].offset + metas[-1].nbytes
    data = alloc(index, total) if alloc is not None else torch.empty(total, dtype=torch.uint8)
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < total:
        raise ValueError(f"bucket {index}: alloc gave {tuple(data.shape)} {data.dtype}, need >= {total} uint8")
    for (_, t), m in zip(pending, metas):
        data[m.offset:m.offset + m.nbytes].copy_(_byte_view(t))  # copy_ crosses devices
    return Bucket(data, metas)


def unpack(bucket: Bucket) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) views into the bucket's buffer, no copy."""
    return unpack_buffer(bucket.data, bucket.metas)


def unpack_buffer(data: torch.Tensor, metas: Iterable[TensorMeta]) -> List[Tuple[str, torch.Tensor]]:
    """Views of `metas` into a uint8 buffer (a bucket's, or a mapping of its bytes elsewhere)."""
    out = []
    for m in metas:
        dtype = dtype_from_name(m.dtype)
        raw = data[m.offset:m.offset + m.nbytes]
        t = raw.view(dtype) if m.nbytes else torch.empty(0, dtype=dtype, device=data.device)
        out.append((m.name, t.view(m.shape)))
    return out
