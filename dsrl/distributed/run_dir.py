"""One run folder for all ranks of a launch: rank 0 decides, the others receive it.

Hydra computes its run folder (`hydra.run.dir`, timestamped) in every process on its own, before
torch.distributed exists, so two ranks started a second apart would write to two folders. The
default `hydra.run.dir` in conf/config.yaml is therefore wrapped in the `dsrl_rank0` resolver:

    hydra.run.dir: ${dsrl_rank0:'outputs/${now:...}-${name}'}

In a multi-rank launch (WORLD_SIZE > 1 with MASTER_ADDR/MASTER_PORT, as the deepspeed launcher
and torchrun set them) rank 0 starts torch.distributed's TCPStore at MASTER_ADDR:MASTER_PORT (under
torchrun its agent already hosts it) and publishes its value; every other rank connects and takes it. The same store later becomes the
default process group's rendezvous (`take_store`, used by dsrl.actor.engine.init_distributed),
so no second port is needed. An explicit `hydra.run.dir=...` bypasses all of this (every rank
already has the same value). A single process resolves to its own value."""
from __future__ import annotations

import datetime
import os
from typing import Optional

RESOLVER = "dsrl_rank0"
_KEY = "dsrl/rank0/"  # store keys; the process group's own keys live under its own prefix
_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("DSRL_RENDEZVOUS_TIMEOUT_S", "600")))

_store = None  # the TCPStore opened for the rendezvous, until init_distributed takes it
_values: dict = {}  # resolved values of this process (Hydra may resolve the same key twice)


def launch_env() -> Optional[tuple]:
    """(rank, world_size, master_addr, master_port) of a multi-rank launch, or None for a
    single process. Malformed variables raise, naming the variable."""
    world = _int_env("WORLD_SIZE", 1)
    if world <= 1:
        return None
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with deepspeed or torchrun")
    return _int_env("RANK", 0), world, os.environ["MASTER_ADDR"], _int_env("MASTER_PORT", 0)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from None


def rendezvous_store():
    """The launch's TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), opened once."""
    global _store
    if _store is None:
        import torch.distributed as dist

        rank, world, addr, port = launch_env()
        # Under torchrun the elastic agent already hosts the store at MASTER_PORT: every rank is a
        # client, and keys live under the restart attempt's prefix (as torch's env:// does).
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        _store = dist.TCPStore(addr, port, world, is_master=rank == 0 and not agent, timeout=_TIMEOUT,
                               wait_for_workers=False)
        if agent:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            _store = dist.PrefixStore(f"/worker/attempt_{attempt}", _store)
    return _store


def rank0_value(value: str, name: str = "run_dir") -> str:
    """Rank 0's `value` on every rank of the launch (this process's own value when alone)."""
    if name in _values:
        return _values[name]
    env = launch_env()
    if env is None:
        _values[name] = str(value)
        return _values[name]
    store = rendezvous_store()
    if env[0] == 0:
        store.set(_KEY + name, str(value))
        _values[name] = str(value)
    else:
        _values[name] = store.get(_KEY + name).decode()
    return _values[name]


def take_store():
    """The rendezvous store, handed over once (to become the process group's store); None when
    this process opened none (single process, or an explicit hydra.run.dir)."""
    global _store
    store, _store = _store, None
    return store


def register_resolver() -> None:
    """Make `${dsrl_rank0:...}` known to OmegaConf (before Hydra composes the config)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda value: rank0_value(value, "run_dir"))
