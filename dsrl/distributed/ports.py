"""A free TCP port on the loopback interface (rendezvous for a process group, test servers)."""
from __future__ import annotations

import random
import socket

_LOWEST = 20000  # picked ports lie in [_LOWEST, the ephemeral range's start)
_rng = random.SystemRandom()


def ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the range the OS hands out for port-0 binds and outgoing connections."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(tries: int = 64) -> int:
    """A port free right now, below the OS's ephemeral range: a port-0 bind or an outgoing connection
    of another process (a gloo peer, an HTTP client) cannot take it between this pick and its use,
    which a port the OS picked itself could not promise (a test server lost its port that way). Falls
    back to an OS-picked port when none below the range binds."""
    top = ephemeral_start()
    for _ in range(tries if top > _LOWEST + 1 else 0):
        port = _rng.randrange(_LOWEST, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
