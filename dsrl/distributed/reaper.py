"""No orphan survives the trainer, whatever the signal.

The rollout engines run in child processes (vLLM's engine core and its workers). A signal handler
can stop them on SIGTERM/SIGINT, but nothing runs in the trainer on SIGKILL or a hard crash. So a
tiny watchdog process holds the read end of a pipe whose write end only the trainer holds. While
the trainer lives, the watchdog keeps a fresh list of the trainer's descendants (pid and start
time, so a recycled pid is never hit); when the pipe reaches EOF without a clean goodbye -- the
kernel closes it however the trainer ends -- it terminates them (SIGTERM, then SIGKILL after a
grace period) and exits. It ignores SIGINT/SIGTERM so that a signal to the whole process group
(Ctrl-C in a terminal) cannot take it down before it has done its job."""
from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys

_GOODBYE = "bye"
_GRACE_S = 5.0
_POLL_S = 0.5


class Reaper:
    """`Reaper.start()` once, early; `close()` on a clean exit (the children are then the
    caller's to stop, e.g. by closing the rollout worker)."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc

    @classmethod
    def start(cls) -> "Reaper":
        proc = subprocess.Popen([sys.executable, "-m", "dsrl.distributed.reaper", str(os.getpid())],
                                stdin=subprocess.PIPE, text=True)
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        """Clean exit: the watchdog stops without killing anything."""
        stdin = self._proc.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):  # BrokenPipeError: the watchdog is already gone
                stdin.write(_GOODBYE + "\n")
                stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _descendants(parent: int) -> list:
    """[(process, start time)] of every descendant of `parent` except this watchdog."""
    import psutil

    out = []
    with contextlib.suppress(psutil.Error):  # the parent is gone: nothing new to track
        for p in psutil.Process(parent).children(recursive=True):
            if p.pid != os.getpid():
                out.append((p, p.create_time()))
    return out


def _terminate(tracked: list) -> None:
    import psutil

    alive = []
    for p, created in tracked:
        try:
            if abs(p.create_time() - created) < 1e-3:  # not a recycled pid
                alive.append(p)
        except psutil.Error:
            continue
    for p in alive:
        with contextlib.suppress(psutil.Error):  # already gone
            p.terminate()
    _, still = psutil.wait_procs(alive, timeout=_GRACE_S)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _watch(parent: int) -> int:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole group: the trainer handles it
        signal.signal(sig, signal.SIG_IGN)
    fd = sys.stdin.fileno()
    tracked = _descendants(parent)
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], _POLL_S)
        if not ready:
            tracked = _descendants(parent) or tracked
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # EOF: the trainer is gone (or closed without a goodbye)
            _terminate(tracked)
            return 0
        buf += chunk
        if _GOODBYE.encode() in buf:
            return 0


if __name__ == "__main__":
    sys.exit(_watch(int(sys.argv[1])))
