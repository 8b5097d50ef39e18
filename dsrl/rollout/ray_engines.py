"""vLLM engines as Ray actors (`rollout.placement=ray`), shared by all trainer ranks.

Placement: rank 0 (the leader) creates `rollout.num_engines` named actors in this run's
namespace (dsrl.distributed.ray_cluster), each in its own bundle of one placement group
({"CPU": k}, or {"GPU": tp, "CPU": k} when the cluster has GPUs), on whatever nodes Ray picks;
the other ranks look them up by name. One set of engines, not one per rank: the engine count is
chosen for generation throughput, independent of the trainer's world size, and one rank (the
leader) pushes the weights once per step instead of every rank pushing the same weights.

`RayEngines` has the rollout worker's interface (generate, push_weights, engine_alive,
pop_metrics, close). A generate call is split into chunks spread over the engines by least
outstanding work (dsrl.distributed.ray_dispatch); results come back in prompt order.

Failures: an engine whose actor died, or that gives no answer within `rollout.timeout_s`, is a
`RolloutEngineError` naming it (actor, namespace, node, pid). The engines are not restarted:
they are shared by every rank and a rebuilt one would need the trainer's weights from the
leader, so the run stops with the name (Ray placement's counterpart of ResilientWorker's
restarts is the job restart of the launcher)."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from dsrl.distributed.collectives import broadcast_from_rank0
from dsrl.distributed.ray_cluster import RayCluster
from dsrl.distributed.ray_dispatch import DispatchTimeout, dispatch_in_order, split_even
from dsrl.rollout.resilient import RolloutEngineError

log = logging.getLogger("dsrl")

CHUNKS_PER_ENGINE = 4  # a generate call is cut into about this many chunks per engine
MAX_INFLIGHT = 2       # chunks queued per engine: one running, one waiting (no idle gap)
_CLOSE_S = 60.0        # close(): how long the engines get to shut vLLM down before ray.kill
_LEAVE_S = 30.0        # close(): how long the leader waits for the other ranks to leave the cluster


class EngineActor:
    """Runs in a Ray actor process: one VLLMWorker, its engine in this process (the actor's own)."""

    def __init__(self, worker_kwargs: dict):
        from dsrl.rollout.vllm_engine import bind_engine_process, import_vllm_and_freeze
        from dsrl.rollout.vllm_worker import VLLMWorker

        # This actor's process is the engine's alone: bind it to the engine's core share (vLLM binds
        # only the worker processes it spawns itself; an inline engine inherits the raylet's cores).
        bind_engine_process(**{k: worker_kwargs.get(k) for k in ("local_rank", "local_world", "cores")})
        import_vllm_and_freeze()
        self.worker = VLLMWorker(**worker_kwargs, host="inline")

    def where(self) -> dict:
        import ray

        return {"host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "start_seconds": float(getattr(self.worker, "start_seconds", 0.0)),
                "cores": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")}  # CPU: this engine's core share

    def generate(self, prompt_ids, kwargs: dict):
        return self.worker.generate(prompt_ids, **kwargs)

    def push_buckets(self, bucket_refs: list, step: int) -> float:
        """Load weight buckets given as object-store references (in a list, so Ray does not
        resolve them all up front): each bucket is fetched when the worker consumes it, so the
        actor holds about one bucket at a time beyond the engine's own copy."""
        import ray

        return self.worker.push_weights((ray.get(ref) for ref in bucket_refs), step)

    def call(self, method: str, *args, **kwargs):
        """Any other worker method (weight loading, probes): forwarded as is."""
        return getattr(self.worker, method)(*args, **kwargs)

    def engine_alive(self) -> bool:
        return self.worker.engine_alive()

    def close(self) -> None:
        self.worker.close()


@dataclass
class EngineRef:
    index: int
    name: str        # the actor's name in the run's namespace
    namespace: str
    actor: object    # ray ActorHandle
    host: str = "?"
    ip: str = "?"
    pid: int = -1
    cores: str = ""  # CPU engines: the cores its vLLM threads are bound to

    def describe(self) -> str:
        return (f"vLLM engine {self.index} (Ray actor {self.name!r} in namespace {self.namespace!r}, "
                f"node {self.ip} / {self.host}, pid {self.pid})")


def engine_name(index: int) -> str:
    return f"engine-{index}"


def bundle_for_engine(*, gpu: bool, tensor_parallel_size: int, cpus_per_engine: int) -> dict:
    """One engine's placement-group bundle: CPUs, plus `tp` GPUs on a GPU cluster."""
    bundle = {"CPU": float(cpus_per_engine)}
    if gpu:
        bundle["GPU"] = float(tensor_parallel_size)
    return bundle


def node_local_slots(bundle_nodes: Sequence[str]) -> List[tuple]:
    """(index among the engines on its node, engines on that node) per bundle, for the CPU core
    split (VLLM_CPU_OMP_THREADS_BIND). Bundle order is not grouped by node (ray#51117), so count
    per node, not per position."""
    totals: Dict[str, int] = {}
    for node in bundle_nodes:
        totals[node] = totals.get(node, 0) + 1
    seen: Dict[str, int] = {}
    out = []
    for node in bundle_nodes:
        out.append((seen.get(node, 0), totals[node]))
        seen[node] = seen.get(node, 0) + 1
    return out


class RayEngines:
    """The run's Ray-placed engines, seen from one trainer rank."""

    def __init__(self, engines: List[EngineRef], cluster: RayCluster, *, rank: int, timeout_s: float,
                 placement_group=None):
        self.engines, self.cluster, self.rank, self.timeout_s = engines, cluster, rank, float(timeout_s)
        self.placement_group = placement_group
        self._served = [0] * len(engines)  # prompts per engine since the last pop_metrics()
        self._closed = False

    # ------------------------------------------------------------------ building
    @classmethod
    def start(cls, cluster: RayCluster, *, num_engines: int, worker_kwargs: dict, seed: int, weights_root: str,
              tensor_parallel_size: int, cpus_per_engine: int, timeout_s: float, rank: int) -> "RayEngines":
        """Collective over the trainer ranks: the leader places and starts the engines, the
        others look them up by name once they are up. An error on the leader (no room in the
        cluster, an engine that fails to start) is raised on every rank."""
        made = {}

        def create():
            made["engines"], made["pg"] = _create_engines(
                cluster.namespace, num_engines=num_engines, worker_kwargs=worker_kwargs, seed=seed,
                weights_root=weights_root, tensor_parallel_size=tensor_parallel_size,
                cpus_per_engine=cpus_per_engine, timeout_s=timeout_s)
            return [(e.name, e.host, e.ip, e.pid) for e in made["engines"]]

        info = _on_leader(cluster.leader, create, "start the Ray-placed engines")
        if cluster.leader:
            return cls(made["engines"], cluster, rank=rank, timeout_s=timeout_s, placement_group=made["pg"])
        import ray

        engines = [EngineRef(i, name, cluster.namespace, ray.get_actor(name, namespace=cluster.namespace),
                             host, ip, pid) for i, (name, host, ip, pid) in enumerate(info)]
        return cls(engines, cluster, rank=rank, timeout_s=timeout_s)

    # ------------------------------------------------------------------ the worker's interface
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens, show_progress: bool = False, seeds: Optional[Sequence[int]] = None,
                 stop: Optional[Sequence[Sequence[str]]] = None) -> list:
        """n completions per prompt (VLLMWorker.generate's contract: max_tokens and stop strings may
        be per prompt), the prompts spread over the engines; groups come back in prompt order."""
        from dsrl.rollout.vllm_engine import per_prompt

        self._check_open()
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        if not prompt_ids:
            return []
        caps, stops = per_prompt(len(prompt_ids), max_tokens, stop)
        kwargs = dict(n=n, temperature=temperature, top_p=top_p, show_progress=False)
        chunks = split_even(len(prompt_ids), CHUNKS_PER_ENGINE * len(self.engines))

        def submit(e: int, chunk):
            lo, hi = chunk
            kw = dict(kwargs, seeds=None if seeds is None else [int(s) for s in seeds[lo:hi]], max_tokens=caps[lo:hi],
                      stop=stops[lo:hi] if stop is not None else None)
            return self.engines[e].actor.generate.remote([list(p) for p in prompt_ids[lo:hi]], kw)

        from dsrl.tracking.progress import progress

        bar = progress(total=len(prompt_ids) * n, desc="generate", unit="sample", enabled=show_progress)

        def on_done(e: int, chunk):
            self._served[e] += chunk[1] - chunk[0]
            bar.update((chunk[1] - chunk[0]) * n)

        try:
            parts = dispatch_in_order(
                chunks, len(self.engines), submit=submit, wait=_ray_wait, fetch=self._fetch("generate"),
                cost=lambda c: c[1] - c[0], max_inflight=MAX_INFLIGHT, first=self.rank,
                timeout_s=self.timeout_s, on_done=on_done)
        except DispatchTimeout as e:
            raise self._timeout_error("generate", e.engines) from None
        finally:
            bar.close()
        return [group for part in parts for group in part]

    def push_weights(self, weights, step: int) -> float:
        """The trainer's weights into every engine: a state dict, or a list of Buckets
        (dsrl.rollout.buckets, from dsrl.rollout.weight_sync). Each bucket goes into the object
        store once and every engine reads that copy (one transfer per bucket per engine). Only the
        leader pushes (every rank holds the same weights); the others wait for it, so no rank
        generates with the old weights; a failed push is raised on every rank. Returns seconds."""
        import ray

        self._check_open()
        t0 = time.perf_counter()

        def push():
            if isinstance(weights, Mapping):
                self.call_all("push_weights", weights, step)
            else:
                refs = [ray.put(b) for b in weights]
                self._get_all([e.actor.push_buckets.remote(refs, step) for e in self.engines], "push_weights")

        _on_leader(self.cluster.leader, push, "push the weights to the Ray-placed engines")
        return time.perf_counter() - t0

    def probe_logprobs(self, token_id_lists) -> dict:
        """{engine description: its probe log-probs} for every engine (dsrl.rollout.weight_sync).
        The leader probes (the engines are shared: one probe per sync is enough) and every rank
        gets the answer, or the error."""
        def probe():
            results = self.call_all("probe_logprobs", [list(t) for t in token_id_lists])
            return {e.describe(): r for e, r in zip(self.engines, results)}

        return _on_leader(self.cluster.leader, probe, "probe the Ray-placed engines")

    def call_all(self, method: str, *args, **kwargs) -> list:
        """Run a worker method on every engine (leader only; e.g. a weight bucket load or a
        probe); each argument goes into the object store once and all engines read that copy.
        Returns the engines' results in engine order."""
        import ray

        self._check_open()
        args_refs = [ray.put(a) for a in args]
        kwargs_refs = {k: ray.put(v) for k, v in kwargs.items()}
        refs = [e.actor.call.remote(method, *args_refs, **kwargs_refs) for e in self.engines]
        return self._get_all(refs, method)

    def engine_alive(self) -> bool:
        """Every engine's actor answers and its vLLM processes run."""
        import ray

        if self._closed:
            return False
        try:
            return all(ray.get([e.actor.engine_alive.remote() for e in self.engines], timeout=self.timeout_s))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def pop_metrics(self) -> dict:
        """Prompts each engine served since the last call (summed over ranks by the trainer),
        and `rollout/restarts` (always 0: Ray-placed engines are not restarted, see above)."""
        out = {"rollout/restarts": 0.0}
        out.update({f"rollout/engine{i}_prompts": float(c) for i, c in enumerate(self._served)})
        self._served = [0] * len(self.engines)
        return out

    def close(self) -> None:
        """Leader: shut each engine's vLLM down, then kill the actors and free the placement
        group; every rank leaves the cluster, the leader last (a driver whose cluster vanished
        under it waits a minute for it to come back). The leader waits at most _LEAVE_S for the
        others, so a dead rank cannot hold it."""
        if self._closed:
            return
        self._closed = True
        import ray

        try:
            if self.cluster.leader and ray.is_initialized():
                refs = [e.actor.close.remote() for e in self.engines]
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_S)
                for ref in ready:
                    try:
                        ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - a dead engine has nothing left to close
                        log.debug("engine close: %s", e)
                for e in self.engines:
                    with contextlib.suppress(Exception):  # already gone
                        ray.kill(e.actor)
                if self.placement_group is not None:
                    ray.util.remove_placement_group(self.placement_group)
        finally:
            if not self.cluster.leader:
                self.cluster.shutdown()
            _bounded_barrier(_LEAVE_S)
            if self.cluster.leader:
                self.cluster.shutdown()

    # ------------------------------------------------------------------ errors
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Ray-placed rollout engines used after close()")

    def _fetch(self, method: str):
        import ray

        def fetch(e: int, ref):
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise RolloutEngineError(f"{self.engines[e].describe()}: died during {method}: "
                                         f"{_first_line(exc)}") from exc
            except ray.exceptions.RayTaskError as exc:
                raise RolloutEngineError(f"{self.engines[e].describe()}: {method} failed: "
                                         f"{_first_line(exc)}") from exc
        return fetch

    def _get_all(self, refs: list, method: str) -> list:
        """Results of one call per engine, in engine order; the first failure names its engine."""
        import ray

        index = {ref: i for i, ref in enumerate(refs)}
        out: List[object] = [None] * len(refs)
        fetch = self._fetch(method)
        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                raise self._timeout_error(method, [index[r] for r in pending])
            for ref in done:
                out[index[ref]] = fetch(index[ref], ref)
        return out

    def _timeout_error(self, method: str, engines: Sequence[int]) -> RolloutEngineError:
        names = "; ".join(self.engines[e].describe() for e in sorted(set(engines)))
        return RolloutEngineError(f"{method}: no answer within rollout.timeout_s={self.timeout_s:g} s from {names}")


def _ray_wait(refs: list, timeout: float) -> list:
    import ray

    done, _ = ray.wait(refs, num_returns=1, timeout=timeout)
    return done


def _first_line(exc: BaseException) -> str:
    """The error's first line, plus Ray's account of a dead worker (e.g. "killed by the OOM
    killer", "exit code 2") when it gives one."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    why = [ln for ln in lines[1:] if "dead because" in ln or "exit detail" in ln.lower()]
    text = " ".join(lines[:1] + why[:1])
    return f"{type(exc).__name__}: {text[:400]}"


def _bounded_barrier(timeout_s: float) -> None:
    """A barrier of the trainer ranks that gives up after `timeout_s` (a rank that died never
    arrives); nothing when there is one rank."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    try:
        dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        log.warning("rollout engines: not every rank left the Ray cluster within %.0f s (%s)", timeout_s, e)


def _on_leader(leader: bool, fn, what: str):
    """Run `fn` on the leader only and hand its result to every rank (collective: the others
    wait for it, so it also orders their next engine calls after it). An error on the leader is
    raised there and, as a RolloutEngineError saying what failed, on every other rank: no rank
    is left waiting in a later collective."""
    if leader:
        try:
            result = fn()
        except Exception as e:
            broadcast_from_rank0(("error", f"{type(e).__name__}: {e}"))
            raise
        broadcast_from_rank0(("ok", result))
        return result
    status, result = broadcast_from_rank0(None)
    if status != "ok":
        raise RolloutEngineError(f"rank 0 could not {what}: {result}")
    return result


def _create_engines(namespace: str, *, num_engines: int, worker_kwargs: dict, seed: int, weights_root: str,
                    tensor_parallel_size: int, cpus_per_engine: int, timeout_s: float):
    """Place and start the engines (leader). Returns (engines, placement group)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if tensor_parallel_size > 1:
        import inspect

        from dsrl.rollout.vllm_worker import VLLMWorker

        if "tensor_parallel_size" not in inspect.signature(VLLMWorker.__init__).parameters:
            raise RolloutEngineError(f"rollout.tensor_parallel_size={tensor_parallel_size}: VLLMWorker takes no "
                                     f"tensor_parallel_size argument yet (set it to 1)")
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    bundle = bundle_for_engine(gpu=gpu, tensor_parallel_size=tensor_parallel_size, cpus_per_engine=cpus_per_engine)
    pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy="PACK",
                         name=f"{namespace}-rollout-engines")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RolloutEngineError(
            f"rollout.num_engines={num_engines} engines of {bundle} each could not be placed within "
            f"rollout.timeout_s={timeout_s:g} s; the cluster has {ray.cluster_resources()} "
            f"({ray.available_resources()} free)") from None
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    slots = node_local_slots([nodes[i] for i in range(num_engines)])
    ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    actor_cls = ray.remote(EngineActor)
    engines: List[EngineRef] = []
    for i in range(num_engines):
        kwargs = dict(worker_kwargs, seed=seed + 1000 * i, weights_dir=os.path.join(weights_root, f"engine{i}"))
        if not gpu:  # CPU: this engine's share of its node's cores
            kwargs.update(local_rank=slots[i][0], local_world=slots[i][1])
        else:        # GPU: the actor sees exactly its bundle's GPUs
            kwargs.update(local_rank=0, local_world=1)
        if tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = tensor_parallel_size
        actor = actor_cls.options(
            name=engine_name(i), namespace=namespace, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=True),
        ).remote(kwargs)
        engines.append(EngineRef(i, engine_name(i), namespace, actor, ip=ips.get(nodes[i], "?")))
    # Waiting for `where` waits for each engine to start; a failed start names its engine.
    holder = RayEngines(engines, RayCluster("", namespace, True, False), rank=0, timeout_s=timeout_s)
    try:
        infos = holder._get_all([e.actor.where.remote() for e in engines], "start")
    except BaseException:
        for e in engines:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(e.actor)
        remove_placement_group(pg)
        raise
    for e, info in zip(engines, infos):
        e.host, e.ip, e.pid, e.cores = info["host"], info["ip"], int(info["pid"]), info["cores"]
    log.info("rollout engines up: %s", "; ".join(
        f"{e.name} on {e.ip} (start {info['start_seconds']:.1f} s{', cores ' + e.cores if e.cores else ''})"
        for e, info in zip(engines, infos)))
    return engines, pg
