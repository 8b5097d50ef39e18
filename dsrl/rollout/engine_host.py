"""One vLLM engine in one child process of dsrl's (the CPU rollout engine, `VLLMWorker` with
host `process`).

vLLM's CPU platform runs an engine in two spawned layers, the engine core and then its model
worker (it refuses the one-process executor under its own multiprocessing), and each layer
imports torch and vLLM again: a tiny model's engine took 20-22 s to start and 5 s to close.
Here the child is started once with `python -m dsrl.rollout.engine_host FD` and runs vLLM
in-process (`VLLMEngine(multiprocess=False)`): 8-9 s to start, about 1 s to close, and the
same tokens and log-probs bit for bit (same kernels, same thread binding). The child is named
`VLLM::EngineCore`, the name vLLM gives the process that runs its engine core, so process
listings and the engine's liveness checks read as before; it binds itself to the rank's cores
(`bind_engine_process`: rollout.engine_cores, else the rank's share), never the trainer's
(vLLM's own VLLM_CPU_OMP_THREADS_BIND binds only worker processes vLLM spawns).

Protocol: a socketpair's end is passed to the child (`pass_fds`); both sides speak
multiprocessing's `Connection` (pickled messages). The parent sends the engine's arguments; the
child answers `("ready", None)` or `("error", exception)`, then serves one `(method, args,
kwargs)` at a time with `("ok", result)` or `("error", exception)`. A child that dies closes
its end, so a call waiting on it fails at once with `EngineDeadError` (which the ResilientWorker
counts as an engine death); a hung child is the ResilientWorker's deadline to find. The child
exits when the parent's end closes (the parent died) and ignores SIGINT: a Ctrl-C to the
terminal's process group stops the trainer, which closes its engines itself."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

PROCESS_TITLE = "VLLM::EngineCore"
_CLOSE_S = 10.0  # close(): how long the child gets to shut vLLM down before SIGKILL
_START_POLL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine's process is gone (killed, crashed, or exited) while a call waited on it."""


class EngineStartError(RuntimeError):
    """The engine's process failed before it was ready; the message names the model and the cause."""


def _portable(exc: BaseException) -> BaseException:
    """`exc` as it can cross the pipe: itself when it pickles, else a RuntimeError that names its
    type; the child's traceback rides along as a note."""
    import pickle

    note = "in the engine process:\n" + "".join(traceback.format_exception(exc)).rstrip()
    try:
        out = pickle.loads(pickle.dumps(exc))
    except Exception:
        out = RuntimeError(f"{type(exc).__name__}: {exc}")
    out.add_note(note)
    return out


class EngineHost:
    """The parent's side: starts the child, forwards calls (one at a time), tells whether the
    child lives, kills or closes it. `engine_kwargs` are VLLMEngine's keyword arguments."""

    def __init__(self, model_path: str, engine_kwargs: dict):
        self.model_path = str(model_path)
        parent_end, child_end = socket.socketpair()
        fd = child_end.fileno()
        # The child imports this checkout's dsrl, whatever its working directory puts first.
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "dsrl.rollout.engine_host", str(fd)],
                                         pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
        finally:
            child_end.close()  # the child's copy is the only one: its death is the parent's EOF
        self.conn = Connection(parent_end.detach())
        self._lock = threading.Lock()
        try:
            self.conn.send((self.model_path, dict(engine_kwargs)))
            kind, payload = self._receive(starting=True)
        except BaseException:
            self.kill()
            raise
        if kind != "ready":
            self.kill()
            raise EngineStartError(f"vLLM engine for {self.model_path} failed to start: "
                                   f"{type(payload).__name__}: {payload}") from payload

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, method: str, *args, **kwargs):
        with self._lock:
            if self.conn is None:
                raise EngineDeadError(f"vLLM engine process {self.pid} ({self.model_path}) was closed")
            try:
                self.conn.send((method, args, kwargs))
            except OSError as e:
                raise EngineDeadError(self._gone(f"while sending {method}")) from e
            kind, payload = self._receive()
        if kind == "error":
            raise payload
        return payload

    def _receive(self, starting: bool = False):
        try:
            if starting:  # vLLM's start-up: poll, so a child that dies early is seen at once
                while not self.conn.poll(_START_POLL_S):
                    if self.proc.poll() is not None:
                        raise EngineStartError(self._gone("during start-up"))
            return self.conn.recv()
        except (EOFError, OSError) as e:
            err = EngineStartError if starting else EngineDeadError
            raise err(self._gone("during start-up" if starting else "while a call waited on it")) from e

    def _gone(self, when: str) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)
        code = self.proc.returncode
        how = "still running" if code is None else (f"killed by signal {-code}" if code < 0 else f"exit code {code}")
        return f"vLLM engine process {self.pid} ({self.model_path}) ended {when} ({how}; its log is on stderr)"

    def alive(self) -> bool:
        import psutil

        if self.proc.poll() is not None:
            return False
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def kill(self) -> None:
        """SIGKILL the child and reap it. A call still waiting on it gets EOF from the kernel and
        returns; its end of the pipe is closed here only once that call has let go of it (never
        under a reader, whose fd number could be reused)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        if self._lock.acquire(timeout=_CLOSE_S):
            try:
                self._drop_conn()
            finally:
                self._lock.release()
        else:  # the waiting call keeps its Connection; it is closed when that call lets it go
            self.conn = None

    def close(self) -> None:
        """Ask the child to shut vLLM down and exit; kill it if it has not within _CLOSE_S."""
        if self.proc.poll() is None and self._lock.acquire(timeout=_CLOSE_S):
            try:
                if self.conn is not None:
                    with contextlib.suppress(OSError, EOFError):
                        self.conn.send(("close", (), {}))
                        if self.conn.poll(_CLOSE_S):
                            self.conn.recv()
            finally:
                self._lock.release()
        with contextlib.suppress(subprocess.TimeoutExpired):  # not gone by then: killed below
            self.proc.wait(timeout=_CLOSE_S)
        self.kill()

    def _drop_conn(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()


def serve(conn: Connection) -> int:
    """The child: build the engine, then answer calls until `close` or the parent's end closes."""
    model_path, engine_kwargs = conn.recv()
    from dsrl.rollout.vllm_engine import VLLMEngine, bind_engine_process, import_vllm_and_freeze

    try:
        bind_engine_process(**{k: engine_kwargs.get(k) for k in ("local_rank", "local_world", "cores")})
        import_vllm_and_freeze()
        engine = VLLMEngine(model_path, **engine_kwargs, multiprocess=False)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", _portable(e)))
        return 1
    conn.send(("ready", None))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if method == "close":
            engine.close()
            with contextlib.suppress(OSError):
                conn.send(("ok", None))
            return 0
        try:
            reply = ("ok", getattr(engine, method)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the caller's error, raised there
            reply = ("error", _portable(e))
        conn.send(reply)
    engine.close()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import gc

    gc.disable()  # the imports before the engine (torch first): on again in import_vllm_and_freeze
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(PROCESS_TITLE)
    code = serve(Connection(int(argv[0])))
    # The engine is closed: skip the interpreter's teardown of torch and vLLM (seconds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
