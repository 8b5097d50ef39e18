"""Trainer ranks joining one Ray cluster (`rollout.ray_address`).

The ranks are started by the `deepspeed` launcher (or torchrun), not by Ray: each becomes a Ray
driver (engine logs stay in Ray's session folder, `log_to_driver=False`; an engine's error
reaches the trainer as an exception naming it). Rank 0 (the leader) connects first -- to a running cluster ("auto" or an address), or
to a private single-machine cluster it starts itself ("local", temp files in a fresh /tmp
folder, stopped with it) -- picks a namespace for this run and hands the cluster's address and
the namespace to the other ranks over torch.distributed, so every rank joins the same cluster
and finds the run's named actors, and two runs on one cluster never see each other's."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Optional

from dsrl.distributed.collectives import broadcast_from_rank0

log = logging.getLogger("dsrl")


class RayClusterError(RuntimeError):
    """Joining the Ray cluster failed (on this rank or on the leader)."""


@dataclass
class RayCluster:
    address: str      # the cluster's GCS address (host:port) every rank joined
    namespace: str    # this run's actors live here
    leader: bool      # global rank 0: creates and stops the run's actors
    started_local: bool  # this process started the cluster ("local"): ray.shutdown() stops it
    temp_dir: Optional[str] = None

    def shutdown(self) -> None:
        """Leave the cluster (the leader of a "local" cluster stops it and removes its temp
        folder: Ray's session logs live there)."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.started_local and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def join(address: str, *, leader: bool, num_cpus: Optional[int] = None) -> RayCluster:
    """Connect this rank to the run's Ray cluster (collective over the trainer ranks).

    `address`: "local" (the leader starts a private cluster with `num_cpus` logical CPUs), "auto"
    (the cluster `ray start` made on this machine, or RAY_ADDRESS; with neither, a private one as
    for "local"), or "host:port" / "ray://...".
    A failure on the leader is raised on every rank, so no rank waits for a cluster that never
    comes."""
    import ray

    if leader:
        try:
            cluster = _leader_connect(address, num_cpus)
            shared = ("ok", cluster.address, cluster.namespace)
        except Exception as e:  # handed to every rank below, then raised here too
            shared = ("error", f"{type(e).__name__}: {e}", "")
            broadcast_from_rank0(shared)
            raise RayClusterError(f"rollout.ray_address={address!r}: could not join a Ray cluster: "
                                  f"{type(e).__name__}: {e}") from e
        broadcast_from_rank0(shared)
        return cluster
    status, gcs, namespace = broadcast_from_rank0(None)
    if status != "ok":
        raise RayClusterError(f"rollout.ray_address={address!r}: rank 0 could not join a Ray cluster: {gcs}")
    try:
        ray.init(address=gcs, namespace=namespace, log_to_driver=False)
    except Exception as e:
        raise RayClusterError(f"could not join rank 0's Ray cluster at {gcs}: {type(e).__name__}: {e}") from e
    return RayCluster(address=gcs, namespace=namespace, leader=False, started_local=False)


def _leader_connect(address: str, num_cpus: Optional[int]) -> RayCluster:
    import ray

    namespace = f"dsrl-{uuid.uuid4().hex[:12]}"
    if address == "auto" and not os.environ.get("RAY_ADDRESS") and not _local_cluster_running():
        # As ray.init() does with no address: nothing to join here, so the run gets its own.
        log.info("rollout.ray_address=auto: no Ray cluster runs on this machine (no `ray start`, RAY_ADDRESS "
                 "unset): starting a private one for this run (rollout.ray_address=HOST:PORT joins another)")
        address = "local"
    if address == "local":
        # A private cluster: never attach to one named by the environment.
        if os.environ.pop("RAY_ADDRESS", None) is not None:
            log.info("rollout.ray_address=local: ignoring RAY_ADDRESS, starting a private Ray cluster")
        # Ray's memory monitor kills workers when the *machine* nears its memory limit, whoever
        # uses it; on a shared single machine that kills the engines for others' usage (the
        # kernel's OOM killer still guards the machine). Read by the raylet this call starts.
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        temp_dir = tempfile.mkdtemp(prefix="dsrl-ray-", dir="/tmp")  # short: Ray's socket paths are length-limited
        ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False, namespace=namespace,
                 _temp_dir=temp_dir, log_to_driver=False)
        started, tmp = True, temp_dir
    else:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        started, tmp = False, None
    gcs = ray.get_runtime_context().gcs_address
    log.info("Ray cluster %s (namespace %s%s)", gcs, namespace, ", private" if started else "")
    return RayCluster(address=gcs, namespace=namespace, leader=True, started_local=started, temp_dir=tmp)


def _local_cluster_running() -> bool:
    """A `ray start` on this machine left its address where `ray.init(address="auto")` reads it."""
    from ray._private.services import find_bootstrap_address, find_gcs_addresses

    return bool(find_gcs_addresses()) or find_bootstrap_address(None) is not None
