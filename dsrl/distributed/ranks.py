"""Where this process sits in the job: global rank, world size, local rank.

Resolution order, per call (nothing is cached, so a process group created
later is picked up automatically):

1. ``torch.distributed`` when it is available and a default process group is
   initialized (global rank / world size come from the group);
2. the launcher's environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (set by
   the ``deepspeed`` launcher, ``torchrun`` and Ray's torch integration);
3. a single-process default: rank 0 of a world of 1.

``local_rank`` has no process-group equivalent, so it always comes from
``LOCAL_RANK`` (falling back to 0).
"""

from __future__ import annotations

import os

__all__ = ["global_rank", "world_size", "local_rank", "is_main_rank"]


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from exc


def global_rank() -> int:
    """Rank of this process in the whole job (0 when not distributed)."""
    if _dist_initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return _env_int("RANK", 0)


def world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    if _dist_initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """Rank of this process on its node, from ``LOCAL_RANK`` (0 when unset)."""
    return _env_int("LOCAL_RANK", 0)


def is_main_rank() -> bool:
    """True on global rank 0: the one process that prints bars and writes logs."""
    return global_rank() == 0
