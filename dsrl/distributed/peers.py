"""Which rank runs where, and which one a failed collective lost.

After the process group exists, `record()` gathers every rank's host name and address (the
address this host uses to reach MASTER_ADDR, i.e. the one its peers' connections come from).
When a collective fails because a peer went away (gloo: "Read error [10.77.0.2]:40580:
Connection reset by peer"; NCCL: "remote process exited"), `lost_rank_message` turns the
backend's error into one line naming the lost rank(s) and their hosts: the ranks at the
address the error names, or, where it names none (a timeout), every other rank as a suspect. Only an
error that came out of torch.distributed counts: a Ray engine's death can read "Connection reset
by peer" too, and it names its engine itself (dsrl.rollout.ray_engines)."""
from __future__ import annotations

import os
import re
import socket
import traceback
from typing import List, Optional, Tuple

import torch.distributed as dist

from dsrl.distributed.ranks import global_rank

_table: List[Tuple[int, str, str]] = []  # (rank, host name, address), by rank
_ADDR = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
# Errors of a collective whose peer is gone or silent (gloo, NCCL, the store).
_PEER_FAILURE = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out",
                 "remote process exited", "socket timeout", "no route to host")


def this_address() -> str:
    """The local address this host reaches MASTER_ADDR from (no packet is sent)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET6 if ":" in master else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT") or 9)))
            return s.getsockname()[0]
    except OSError:
        return "?"


def record() -> List[Tuple[int, str, str]]:
    """Gather (rank, host name, address) of every rank. Collective; a no-op with one rank."""
    global _table
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return _table
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (global_rank(), socket.gethostname(), this_address()))
    _table = sorted(rows)
    return _table


_TORCH_DIST = f"{os.sep}torch{os.sep}distributed{os.sep}"


def _from_a_collective(exc: BaseException) -> bool:
    """`exc`, or an error it was raised from, came out of torch.distributed (gloo, NCCL, the store):
    a frame of that package is in its traceback."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(_TORCH_DIST in f.filename for f in traceback.extract_tb(exc.__traceback__)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _describe(rows) -> str:
    return ", ".join(f"rank {r} on host {host} ({addr})" for r, host, addr in rows)


def describe() -> str:
    """Every rank's host and address as `record` gathered them ("" before it ran)."""
    return _describe(_table)


def lost_rank_message(exc: BaseException) -> Optional[str]:
    """One line naming the rank(s) a failed collective lost, or None when `exc` is not a peer
    failure of a multi-rank run (or `record` never ran)."""
    text = str(exc)
    if not _table or not isinstance(exc, RuntimeError) or not any(k in text.lower() for k in _PEER_FAILURE):
        return None
    if exc.__traceback__ is not None and not _from_a_collective(exc):
        return None  # e.g. a Ray engine's death ("... recvmsg:Connection reset by peer"): its own error
    me = global_rank()
    mine = next((row for row in _table if row[0] == me), (me, socket.gethostname(), "?"))
    addrs = set(_ADDR.findall(text))
    lost = [row for row in _table if row[2] in addrs and row[0] != me]
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    where = f"rank {me} on host {mine[1]} ({mine[2]})"
    # The innermost dsrl frame outside dsrl/distributed (the collective helpers): where in the step it was.
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}dsrl{os.sep}" in f.filename
              and f"{os.sep}dsrl{os.sep}distributed{os.sep}" not in f.filename]
    at = ""
    if frames:
        f = frames[-1]
        at = f" at {f.filename[f.filename.rindex(os.sep + 'dsrl' + os.sep) + 1:]}:{f.lineno} ({f.name})"
    if lost:
        return f"lost {_describe(lost)}: a collective on {where} failed{at}: {first}"
    others = [row for row in _table if row[0] != me]
    return f"a collective on {where} failed{at} waiting for another rank (one of: {_describe(others)}): {first}"
