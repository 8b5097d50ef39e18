"""A free TCP port on the loopback interface (rendezvous for a process group, test servers)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS reports free right now (another process may still take it before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
