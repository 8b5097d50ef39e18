"""DeepSpeed's shared-memory allreduce buffers on CPU (one 69 MB file per rank under /dev/shm, which
DeepSpeed maps and never unlinks): their names, and unlinking this rank's once no rank needs to open
it any more (dsrl.actor.engine.init_distributed; the set-up's op-cache warm-up)."""
from __future__ import annotations

import contextlib
import os

SHM_ALLREDUCE_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"


def unlink_own_allreduce_buffer(rank: int) -> None:
    """Unlink this rank's buffer, named by DeepSpeed from the uid, MASTER_ADDR, MASTER_PORT and the
    rank; the mappings stay valid until the processes exit. None made (DeepSpeed's shm op not built,
    or not every rank on this host): nothing to do."""
    name = (f"{SHM_ALLREDUCE_PREFIX}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{int(rank)}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)
