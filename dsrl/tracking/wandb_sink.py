"""Weights & Biases as a second home for the step metrics (rank 0 only, through wandb's library).

Mode ``auto`` goes online only when an API key is configured and the W&B host answers within a
few seconds; otherwise the run is written offline under ``<run_dir>/wandb`` (``wandb sync``
uploads it later). No network call is made when no key is configured, so nothing hangs offline.
"""
from __future__ import annotations

import netrc
import os
import socket
import threading
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

__all__ = ["WandbSink", "resolve_wandb_mode", "wandb_api_key_configured", "wandb_host_reachable"]

DEFAULT_BASE_URL = "https://api.wandb.ai"
MODES = ("auto", "online", "offline")


def _base_url() -> str:
    return os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL


def wandb_api_key_configured(base_url: Optional[str] = None) -> bool:
    """A key in the environment, or a .netrc entry for the W&B host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(base_url or _base_url()).hostname or ""
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_host_reachable(base_url: Optional[str] = None, timeout: float = 3.0) -> bool:
    """A TCP connection to the W&B host within `timeout` seconds (DNS included: a thread, so a
    resolver that hangs cannot hold the run)."""
    parts = urlsplit(base_url or _base_url())
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    ok = []

    def attempt():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=attempt, daemon=True, name="wandb-reachability")
    t.start()
    t.join(timeout)
    return bool(ok)


def resolve_wandb_mode(mode: str, *, timeout: float = 3.0) -> tuple[str, str]:
    """(online | offline, why)."""
    if mode not in MODES:
        raise ValueError(f"logger.wandb_mode={mode!r} is not one of {list(MODES)}")
    if mode != "auto":
        return mode, "set in config"
    if not wandb_api_key_configured():
        return "offline", "no W&B API key configured (WANDB_API_KEY or `wandb login`)"
    if not wandb_host_reachable(timeout=timeout):
        return "offline", f"W&B host {_base_url()} not reachable"
    return "online", "API key configured and W&B host reachable"


class WandbSink:
    """One W&B run: `open` starts it (a new run, or the run a checkpoint names, continued), config
    attached at start, one `log` per step, `close` finishes it."""

    def __init__(self, run_dir: "str | os.PathLike[str]", *, project: str, mode: str = "auto",
                 config: Optional[Mapping[str, Any]] = None, name: Optional[str] = None, quiet: bool = True):
        self.mode, self.reason = resolve_wandb_mode(mode)
        self.root = Path(run_dir)
        self.project, self.config, self.name, self.quiet = project, dict(config or {}), name, quiet
        self.run = None  # started by open()

    def open(self, resume_id: Optional[str] = None) -> None:
        """Start the run. `resume_id`: continue the W&B run of that id (resume="allow": W&B
        appends to it, and starts it under that id when it never reached W&B). Offline, the
        continuation is a folder of its own under the same id, which `wandb sync` appends."""
        import wandb

        if self.run is not None:
            raise RuntimeError("the W&B run is already open")
        self.root.mkdir(parents=True, exist_ok=True)
        # console="off": wandb must not wrap stdout/stderr (the console belongs to dsrl's logging).
        settings = wandb.Settings(console="off", silent=self.quiet, quiet=self.quiet)
        # dsrl makes no LLM-API calls to trace: no Weave auto-init (nor its advert when vLLM
        # imports openai). wandb prints its own notices per setup, so quiet goes there as well.
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        wandb.setup(settings=wandb.Settings(silent=self.quiet, quiet=self.quiet))
        self.run = wandb.init(project=self.project, mode=self.mode, dir=str(self.root), config=self.config,
                              name=self.name, settings=settings, reinit="create_new", id=resume_id,
                              resume="allow" if resume_id is not None else None)

    @property
    def run_dir(self) -> Path:
        """The open run's folder: <run_dir>/wandb/<offline-run-...>."""
        return Path(self.run.dir).parent

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=int(step))

    def close(self) -> None:
        """Finish the run and wait until W&B's service has written it out (finish alone can
        return before an offline run's file is complete)."""
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            wandb.teardown()
