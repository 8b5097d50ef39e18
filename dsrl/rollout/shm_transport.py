"""Weight sync into a vLLM engine on the same machine through shared memory (CPU path).

Each bucket is packed straight into a file under /dev/shm (one per bucket, reused by the next
sync when it fits: no new pages to fault in every step); the RPC to the engine carries only the
file's path and the tensors' metadata (raw tensors as RPC arguments kill a CPU engine), and the
engine maps the file without copying (dsrl.rollout.engine_load). The files of the last sync stay
until the next sync or `close()`, so a rebuilt engine gets the trainer's weights back from them
without any per-step disk write. Files are named `dsrl-sync-<pid>-<n>-<bucket>`; `close()` (also
run at exit) removes them; a process killed before that leaves its files behind, and the next
ShmStaging on the machine removes the files of processes that no longer run."""
from __future__ import annotations

import contextlib

import atexit
import itertools
import os
from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch

from dsrl.rollout.buckets import Bucket
from dsrl.rollout.engine_load import MetaTuple, meta_tuples

SHM_DIR = "/dev/shm"
PREFIX = "dsrl-sync-"
_COUNTER = itertools.count()


@dataclass(frozen=True)
class ShmBucketRef:
    """What the engine needs to load one staged bucket: the file and its tensors."""
    path: str
    rows: List[MetaTuple]
    nbytes: int


class _Segment:
    def __init__(self, path: str, size: int):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    def remove(self) -> None:
        self.buffer = None
        if os.path.exists(self.path):
            os.unlink(self.path)


class ShmStaging:
    """The trainer side: stages buckets in shared memory and remembers the last staged sync."""

    def __init__(self, directory: str = SHM_DIR):
        if not os.path.isdir(directory):
            raise RuntimeError(f"shared-memory weight sync needs {directory} (not found on this machine)")
        self.directory = directory
        reap_dead_segments(directory)  # a SIGKILLed process (or a ray.kill-ed actor) ran no close()
        self.tag = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self._segments: List[_Segment] = []
        self.refs: List[ShmBucketRef] = []  # the last complete staging; [] before the first
        atexit.register(self.close)

    def alloc(self, index: int, nbytes: int) -> torch.Tensor:
        """pack_buckets' allocator: segment `index`, reused when large enough, else recreated
        with 1/8 headroom (a bucket's size is the same every step for the same model)."""
        if index == 0:
            self.refs = []  # a new sync is being packed over the last one: it is no longer whole
        while len(self._segments) <= index:
            self._segments.append(None)
        seg = self._segments[index]
        if seg is None or seg.size < nbytes:
            if seg is not None:
                seg.remove()
            size = max(nbytes + nbytes // 8, 4096)
            seg = self._segments[index] = _Segment(os.path.join(self.directory, f"{self.tag}-{index}"), size)
        return seg.buffer

    def stage(self, buckets: Iterable[Bucket]) -> List[ShmBucketRef]:
        """Consume `buckets` (packed with `alloc`, or copied in here) and record them as the last
        staged sync; segments beyond the new count are removed."""
        self.refs = []  # a staging that fails midway leaves no half-new sync behind as "last"
        refs = []
        for i, b in enumerate(buckets):
            seg = self._segments[i] if i < len(self._segments) else None
            if seg is None or b.data.data_ptr() != seg.buffer.data_ptr():
                self.alloc(i, b.nbytes)[:b.nbytes].copy_(b.data[:b.nbytes])
            refs.append(ShmBucketRef(self._segments[i].path, meta_tuples(b.metas), b.nbytes))
        for seg in self._segments[len(refs):]:
            if seg is not None:
                seg.remove()
        del self._segments[len(refs):]
        self.refs = refs
        return refs

    @property
    def paths(self) -> List[str]:
        return [s.path for s in self._segments if s is not None]

    def close(self) -> None:
        """Remove every segment (idempotent)."""
        for seg in self._segments:
            if seg is not None:
                seg.remove()
        self._segments, self.refs = [], []
        atexit.unregister(self.close)


def leftover_segments(pid: Optional[int] = None, directory: str = SHM_DIR) -> List[str]:
    """Segment files of process `pid` (default: any dsrl process) still in `directory`."""
    start = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return sorted(n for n in os.listdir(directory) if n.startswith(start)) if os.path.isdir(directory) else []


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def reap_dead_segments(directory: str = SHM_DIR) -> List[str]:
    """Remove segment files whose owning process (the pid in the name) no longer runs; returns
    the names removed."""
    removed = []
    for name in leftover_segments(None, directory):
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_running(int(pid)):
            with contextlib.suppress(FileNotFoundError):  # another process reaped it first
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed
