"""A console a person can read.

By default the console shows dsrl's own lines (INFO and up) and the libraries' warnings and
errors (each call site's warning once); everything is also written to the run folder:
``run.log`` (this process: dsrl + libraries) and ``vllm.log`` (vLLM, including its engine
processes, which log to their own stderr and are configured through VLLM_LOGGING_CONFIG_PATH).
``verbose=True`` puts the libraries' INFO lines back on the console. Console lines go through
``tqdm.write`` so they never break the (single) progress bar.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
from pathlib import Path
from typing import IO, Dict, Iterator, Optional

from tqdm import tqdm

__all__ = ["setup_console", "adopt_library_loggers", "prints_to_log", "ConsoleFilter", "ConsoleHandler",
           "ConsoleFormatter", "vllm_logging_config", "KNOWN_NOISE"]

DSRL = "dsrl"
FILE_FORMAT = "%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s"


# Library warnings that dsrl causes on purpose or that no user can act on: log files only
# (shown with verbose). Matched as substrings of the message; never applied to errors.
KNOWN_NOISE = (
    "Allowing insecure serialization",  # dsrl sends its weight-reload function through collective_rpc
    "Enforce eager set, disabling",  # rollout.enforce_eager, decided (and logged) by dsrl.hardware
    "Inductor compilation was disabled by user settings",  # same
    "VLLM_CPU_NUM_OF_RESERVED_CPU is less than",  # no core reserved: the trainer waits while vLLM generates
    "is set; leaving Torch threads at",  # dsrl budgets the threads (actor.num_threads, vLLM core binding)
    "with dtype torch.float32 into parameter with dtype torch.bfloat16",  # fp32 checkpoint, bf16 engine
    "Triton is installed, but doesn't include CPU backend",  # CPU build without triton-cpu: harmless
    "Triton is not installed. triton-cpu is expected",  # same
    "Model Runner V2 requires Triton",  # same
    "Reset SSM cache type",  # Mamba-only setting
    "RotaryEmbedding: Failed to load weights",  # has no weights; reload_weights reports it on every push
    "ParallelLMHead: Failed to load weights",  # tied head: dsrl re-ties it after each push (reload_and_retie)
    "does not officially support disabling chunked prefill",  # on CPU on purpose: dsrl.rollout.seeds
)


def _is_dsrl(name: str) -> bool:
    return name == DSRL or name.startswith(DSRL + ".")


def _known_noise(record: logging.LogRecord) -> bool:
    try:
        text = record.getMessage()
    except Exception:  # a record with bad arguments is not noise we know
        return False
    return any(marker in text for marker in KNOWN_NOISE)


class ConsoleFilter(logging.Filter):
    """dsrl at INFO+, libraries at WARNING+ (INFO+ when verbose). Below ERROR, a library's
    warning is shown once per call site and message template (repeats stay in the log files),
    and not at all when it is in KNOWN_NOISE."""

    def __init__(self, verbose: bool = False):
        super().__init__()
        self.verbose = bool(verbose)
        self._seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.__dict__.get("console") is False:  # log.x(..., extra={"console": False}): run.log only
            return False
        if _is_dsrl(record.name):
            return record.levelno >= logging.INFO
        if record.levelno < (logging.INFO if self.verbose else logging.WARNING):
            return False
        if self.verbose or record.levelno >= logging.ERROR:
            return True
        if _known_noise(record):
            return False
        site = (record.name, record.pathname, record.lineno, str(record.msg))
        if site in self._seen:
            return False
        self._seen.add(site)
        return True


class ConsoleFormatter(logging.Formatter):
    """``12:03:41 step 3 | reward ...`` for dsrl's INFO lines; level and source for the rest."""

    def __init__(self):
        super().__init__()
        self.plain = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        self.tagged = logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        plain = _is_dsrl(record.name) and record.levelno == logging.INFO
        return (self.plain if plain else self.tagged).format(record)


class ConsoleHandler(logging.Handler):
    """Writes through ``tqdm.write``: the active progress bar is cleared and redrawn around the line."""

    def __init__(self, stream: Optional[IO[str]] = None):
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream or sys.stderr)
        except Exception:  # logging must never raise into the program
            self.handleError(record)


def _log_name(stem: str, rank: int) -> str:
    return f"{stem}.log" if rank == 0 else f"{stem}.rank{rank}.log"


def vllm_logging_config(log_file: str, verbose: bool) -> dict:
    """``dictConfig`` for the ``vllm`` logger in every vLLM process: all of it to ``log_file``,
    the console filtered like this process's console."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"file": {"format": FILE_FORMAT},
                       "console": {"()": f"{__name__}.ConsoleFormatter"}},
        "filters": {"console": {"()": f"{__name__}.ConsoleFilter", "verbose": bool(verbose)}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": log_file, "mode": "a", "encoding": "utf-8",
                     "formatter": "file"},
            "console": {"()": f"{__name__}.ConsoleHandler", "formatter": "console", "filters": ["console"]},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": level, "propagate": False}},
    }


def _quiet_child_env(verbose: bool) -> None:
    """Settings read by libraries at import / by processes started from here."""
    if verbose:
        return
    # transformers' and huggingface_hub's loading bars (dsrl draws its own bar, one at a time).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Deprecation notices printed by child processes (vLLM's engine) are for library developers.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")


def adopt_library_loggers() -> int:
    """Make libraries that print through their own stdout/stderr handler (DeepSpeed,
    transformers, ...) log through the root handlers instead (console filter + run.log).
    Call again after importing such a library; returns how many loggers were changed."""
    changed = 0
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or _is_dsrl(name) or name == "vllm" or name.startswith("vllm."):
            continue  # vLLM logs through its own dictConfig (vllm_logging_config)
        # A plain StreamHandler writes to a console stream: the one at the library's import time,
        # which need not be today's sys.stdout/stderr (e.g. under output capture).
        own = [h for h in logger.handlers if type(h) is logging.StreamHandler]
        if not own:
            continue
        for h in own:
            logger.removeHandler(h)
        logger.propagate = True
        changed += 1
    if "transformers" in sys.modules:
        # transformers re-adds its handler on demand unless told its default handler is off.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    return changed


class _LineLogger(io.TextIOBase):
    def __init__(self, logger: logging.Logger):
        self.logger, self.buf = logger, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            if line.strip():
                self.logger.info(line.rstrip())
        return len(text)

    def flush(self) -> None:
        if self.buf.strip():
            self.logger.info(self.buf.rstrip())
        self.buf = ""


@contextlib.contextmanager
def prints_to_log(name: str, verbose: bool = False) -> Iterator[None]:
    """Turn a library's ``print`` output (e.g. DeepSpeed's op-build notices) into INFO records of
    logger ``name`` while the block runs (so they land in run.log, not on the console)."""
    if verbose:
        yield
        return
    adopt_library_loggers()  # the library may have (re)installed its own console handler
    logger = logging.getLogger(name)
    saved = (logger.level, logger.propagate)
    # These lines are INFO for run.log whatever level the library's logger was left at.
    logger.setLevel(logging.INFO)
    logger.propagate = True
    sink = _LineLogger(logger)
    try:
        with contextlib.redirect_stdout(sink):
            try:
                yield
            finally:
                sink.flush()
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


_vllm_config_set: Optional[str] = None  # the VLLM_LOGGING_CONFIG_PATH this process set


def _point_vllm_at(config_path: Path) -> None:
    """vLLM reads VLLM_LOGGING_CONFIG_PATH when an engine starts, in this process and in its
    engine processes (which inherit the environment). A user's own setting is kept, and so is
    VLLM_CONFIGURE_LOGGING=0 (vLLM rejects a config file together with it)."""
    global _vllm_config_set
    current = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if current is not None and current != _vllm_config_set:
        return
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    _vllm_config_set = os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)


def setup_console(run_dir: "str | os.PathLike[str]", verbose: bool = False, *, rank: Optional[int] = None,
                  stream: Optional[IO[str]] = None) -> Dict[str, Path]:
    """Install the console and the run-folder log files (replaces Hydra's handlers); returns
    the log paths. ``rank`` defaults to $RANK; ranks > 0 write ``run.rank<N>.log``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank is None:
        raw = os.environ.get("RANK", "0").strip() or "0"
        rank = int(raw) if raw.isdigit() else 0
    paths = {"run_log": run_dir / _log_name("run", rank), "vllm_log": run_dir / _log_name("vllm", rank),
             "vllm_config": run_dir / f".vllm_logging{'' if rank == 0 else f'.rank{rank}'}.json"}

    root = logging.getLogger()
    for h in list(root.handlers):  # Hydra's console + <job>.log handlers, or ours from a previous call
        root.removeHandler(h)
        h.close()
        old = getattr(h, "baseFilename", None)  # Hydra's <job>.log would stay empty: run.log replaces it
        if old and Path(old) != paths["run_log"]:
            # Only an empty regular file (a handler may write to /dev/null or another device); the
            # ranks of a launch share the folder: one of them removes it.
            with contextlib.suppress(FileNotFoundError):
                if os.path.isfile(old) and os.path.getsize(old) == 0:
                    os.remove(old)
    console = ConsoleHandler(stream)
    console.setFormatter(ConsoleFormatter())
    console.addFilter(ConsoleFilter(verbose))
    logfile = logging.FileHandler(paths["run_log"], mode="a", encoding="utf-8")
    logfile.setFormatter(logging.Formatter(FILE_FORMAT))
    logfile.setLevel(logging.INFO)
    root.addHandler(console)
    root.addHandler(logfile)
    root.setLevel(logging.INFO)
    logging.getLogger(DSRL).setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings -> "py.warnings" logger -> filtered like the rest

    paths["vllm_config"].write_text(json.dumps(vllm_logging_config(str(paths["vllm_log"]), verbose), indent=1))
    _point_vllm_at(paths["vllm_config"])
    _quiet_child_env(verbose)
    adopt_library_loggers()
    return paths
