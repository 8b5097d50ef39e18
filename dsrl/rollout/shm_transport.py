"""Weight sync into a vLLM engine on the same machine through shared memory (CPU path).

Each bucket is packed straight into a file under /dev/shm (one per bucket, reused by the next
sync when it fits: no new pages to fault in every step); the RPC to the engine carries only the
file's path and the tensors' metadata (raw tensors as RPC arguments kill a CPU engine), and the
engine maps the file without copying (dsrl.rollout.engine_load). The files of the last sync stay
until the next sync or `close()`, so a rebuilt engine gets the trainer's weights back from them
without any per-step disk write. Files are named `dsrl-sync-<pid>-<n>-<bucket>`; `close()` (also
run at exit) removes them; a process killed before that leaves its files behind, and the next
ShmStaging on the machine removes the files of processes that no longer run.

Staged, then loaded (`stage_then_load`): every bucket is packed into its file first (the export
runs to the end: under ZeRO-3 it is collective), then the engine loads them in order, one call per
bucket and one that closes its reload session (dsrl.rollout.engine_load.finish_reload); a failed
load names the bucket and the engine. Loading each bucket while the next is packed (a loader
thread) was tried and measured slower on CPU in every run (`make bench-sync`, docs/benchmarks.md):
the engine's loads are ~93% of a sync, and the thread only competed with them for the cores."""
from __future__ import annotations

import contextlib

import atexit
import itertools
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional

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
        return list(self.staged(buckets))

    def staged(self, buckets: Iterable[Bucket]) -> Iterator[ShmBucketRef]:
        """`stage`, one bucket at a time: each bucket's ref as soon as its bytes are in its file.
        The refs become the last staged sync only once `buckets` is exhausted."""
        self.refs = []  # a staging that fails midway leaves no half-new sync behind as "last"
        refs = []
        for i, b in enumerate(buckets):
            seg = self._segments[i] if i < len(self._segments) else None
            if seg is None or b.data.data_ptr() != seg.buffer.data_ptr():
                self.alloc(i, b.nbytes)[:b.nbytes].copy_(b.data[:b.nbytes])
            refs.append(ShmBucketRef(self._segments[i].path, meta_tuples(b.metas), b.nbytes))
            yield refs[-1]
        for seg in self._segments[len(refs):]:
            if seg is not None:
                seg.remove()
        del self._segments[len(refs):]
        self.refs = refs

    @property
    def paths(self) -> List[str]:
        return [s.path for s in self._segments if s is not None]

    def discard(self) -> None:
        """Remove every segment; the staging stays usable (the next sync creates new ones)."""
        for seg in self._segments:
            if seg is not None:
                seg.remove()
        self._segments, self.refs = [], []

    def close(self) -> None:
        """Remove every segment (idempotent)."""
        self.discard()
        atexit.unregister(self.close)


class BucketLoadError(RuntimeError):
    """An engine failed to load one staged bucket (or to close the reload session after the last
    one). `index` is the bucket's (== `count` for the closing call); the cause is chained."""

    def __init__(self, message: str, index: int, count: int):
        super().__init__(message)
        self.index, self.count = index, count


def stage_then_load(staging: ShmStaging, buckets: Iterable[Bucket], load: Callable[[ShmBucketRef, bool], object],
                    finish: Callable[[], object], *, name: str = "rollout engine") -> List[ShmBucketRef]:
    """Stage `buckets` (packed with `staging.alloc`) to the end, then load them into the engine:
    `load(ref, first)` for every bucket in order, then `finish()` (module docstring). Returns the
    refs (the staging's last sync). A failure of `buckets` itself (the export) removes every staged
    file and is raised as is; the engine was not called and keeps its weights. A failed load stops
    the loads, closes the engine's reload session (`finish`) and raises BucketLoadError naming the
    bucket and `name`; the staging then holds the whole new sync, for a rebuilt engine."""
    try:
        refs = staging.stage(buckets)
    except BaseException:
        staging.discard()  # a half-new sync is of no use
        raise
    for index, ref in enumerate(refs):
        try:
            load(ref, index == 0)
        except BaseException as e:
            with contextlib.suppress(Exception):
                finish()  # the next sync opens a new session; a layer left half-loaded is repaired by it
            raise BucketLoadError(f"{name}: loading weight bucket {index} of {len(refs)} ({ref.path}: "
                                  f"{len(ref.rows)} tensors, {ref.rows[0][0]} .. {ref.rows[-1][0]}) failed: "
                                  f"{type(e).__name__}: {e}", index, len(refs)) from e
    if refs:
        try:
            finish()
        except BaseException as e:
            raise BucketLoadError(f"{name}: closing the reload session after the last of {len(refs)} weight buckets "
                                  f"failed: {type(e).__name__}: {e}", len(refs), len(refs)) from e
    return refs


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
