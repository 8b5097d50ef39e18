"""Two hosts on this machine (launch/netns_two_nodes.sh): network namespaces joined by a veth pair
(node 0 at 10.77.0.1, node 1 at 10.77.0.2), a host name and a node-local disk each (the same path,
`nodes.local`, shows each node its own folder, `nodes.disk(n)`).

`two_nodes` gives a pair per test module, named dsrl2n-<pytest pid>-<n>; its finalizer kills
whatever still runs in the namespaces and deletes them, whatever the test did. Pairs left by a
crashed earlier session (their pytest is gone) are removed when the first pair of a session is
made, and so are their node folders (/tmp/dsrl2n-<pid>-<n>). Without root, or where `ip netns add`
fails, the tests skip with one line saying why."""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "netns_two_nodes.sh"
_count = itertools.count()
_swept = []


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add): two-node tests skipped"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2's `ip` or util-linux's `unshare` not found: two-node tests skipped"
    return None


class TwoNodes:
    """A pair of namespaces made by launch/netns_two_nodes.sh."""

    addrs = ("10.77.0.1", "10.77.0.2")

    def __init__(self, name: str, root: Path, ifaces=("?", "?")):
        self.name, self.root, self.ifaces = name, root, tuple(ifaces)  # each node's veth end
        self.local = root / "local"  # the node-local disk's path, as every node sees it
        self.namespaces = (f"{name}-0", f"{name}-1")
        self.hosts = self.namespaces  # each node's host name

    def disk(self, node: int) -> Path:
        """Node `node`'s local disk, as seen from outside the namespaces."""
        return self.root / f"node{node}"

    def on_node(self, node: int, path: Path) -> Path:
        """Where a path under `local` lies on node `node`'s disk."""
        return self.disk(node) / Path(path).relative_to(self.local)

    def popen(self, node: int, argv, **kw) -> subprocess.Popen:
        """`argv` on node `node`, in a session of its own (a signal to its group reaches it all)."""
        return subprocess.Popen([str(SCRIPT), "exec", self.name, str(node), *map(str, argv)],
                                start_new_session=True, **kw)

    def pids(self, node: int) -> list:
        r = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def wait_empty(self, timeout: float) -> list:
        """Wait until no process runs on either node; returns [pids of node 0, of node 1] left."""
        end = time.time() + timeout
        while time.time() < end and any(self.pids(n) for n in (0, 1)):
            time.sleep(0.2)
        return [self.pids(0), self.pids(1)]

    def link(self, node: int, up: bool) -> None:
        """Node `node`'s veth end up or down (down: the host vanishes from the network, its
        connections stay open)."""
        subprocess.run(["ip", "-n", self.namespaces[node], "link", "set", "dev", self.ifaces[node],
                        "up" if up else "down"], check=True, timeout=30)
        if up:  # back as it was for the module's next test, not only "up" on paper
            self._wait_reachable()

    def _wait_reachable(self, timeout_s: float = 30.0) -> None:
        """Both veth ends report carrier, and no node keeps the FAILED neighbour entry it made
        while the other was down (the kernel answers "No route to host" from it until it probes
        again: a later test's first ssh to the host failed exactly so)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [subprocess.run(["ip", "-n", ns, "-br", "link", "show", "dev", iface], capture_output=True,
                                     text=True, timeout=30).stdout.split()[1:2]
                      for ns, iface in zip(self.namespaces, self.ifaces)]
            if all(state == ["UP"] for state in states):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the two nodes' links are not up again after {timeout_s:.0f} s: {states}")
            time.sleep(0.2)
        for ns in self.namespaces:
            subprocess.run(["ip", "-n", ns, "neigh", "flush", "all"], check=True, timeout=30)

    def destroy(self) -> None:
        subprocess.run([str(SCRIPT), "destroy", self.name], capture_output=True, text=True, timeout=60)


def _sweep() -> None:
    """Namespaces and node folders of earlier sessions whose pytest is gone."""
    subprocess.run([str(SCRIPT), "sweep"], capture_output=True, text=True, timeout=120)
    for old in (Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())).glob("dsrl2n-*-*"):
        pid = old.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes():
    why = _unavailable()
    if why:
        pytest.skip(why)
    if not _swept:  # leftovers of a crashed earlier session
        _sweep()
        _swept.append(True)
    name = f"dsrl2n-{os.getpid()}-{next(_count)}"
    # A short path: Ray's Unix sockets live under a node's disk (at most 107 characters).
    root = (Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())) / name
    shutil.rmtree(root, ignore_errors=True)
    r = subprocess.run([str(SCRIPT), "create", name, str(root)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"network namespaces unavailable ({SCRIPT.name} create: "
                    f"{(r.stderr.strip().splitlines() or ['?'])[-1]}): two-node tests skipped")
    nodes = TwoNodes(name, root, ifaces=r.stdout.split()[2:4])
    try:
        yield nodes
    finally:
        nodes.destroy()
        shutil.rmtree(root, ignore_errors=True)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in left.split() for ns in nodes.namespaces), left
