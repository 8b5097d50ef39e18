"""Weight sync without disk vs the file-based push it replaced, on real vLLM engines.

For each dtype (float32, bfloat16) of SmolLM2-135M (or `bench.model=tiny`): a frozen ActorEngine
(ZeRO-0) with perturbed weights and two vLLM engines of that dtype. Timed, alternating ABBA
within each round (one process):
- shm:  dsrl.rollout.weight_sync.WeightSync.push (export -> buckets packed into /dev/shm ->
        one RPC per bucket per engine), probe off for the timing;
- file: the old push, kept below as `file_push`: full state dict -> one safetensors file ->
        every engine `reload_weights` from it (+ re-tie of the head);
for 1 and 2 engines, against the model's bytes and the machine's memcpy of those bytes
(one torch copy_ of a flat buffer, median). Also the probe's mean |log-prob diff| after a sync
(`rollout/sync_logprob_diff`), the evidence for rollout.sync_tolerance's defaults.

Then, one engine, side by side (ABBA): the engine's own weight reload (vLLM `reload_weights` from
the safetensors file, already in the page cache), the sync without its check (every bucket
staged, then loaded: dsrl.rollout.shm_transport.stage_then_load), and the probe check alone; with
the greedy refresh (every PROBE_REFRESH-th probe) and the train step's check of its samples (the
reduction over a default batch's sampled tokens, and `check_samples`), the sync + check per push
under the probe on every push (rollout.sync_probe_every=1) and under auto (null, the default: the
probe every AUTO_PROBE_EVERY-th push, the train step's check between), as multiples of the
engine's own reload.

    make bench-sync [ARGS="bench.rounds=3 bench.model=smollm2 bench.dtypes=float32,bfloat16 bench.engines=1,2"]
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch


def file_push(actor, workers, folder: str) -> None:
    """The pre-bucket push: the whole state dict into one safetensors file, each engine reloads it."""
    from safetensors.torch import save_file

    state = actor.state_dict_for_export()
    path = os.path.join(folder, "model.safetensors")
    save_file(state, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
    for w in workers:
        w.reload_folder(folder)  # reload_and_retie in the engine, then its prefix cache is dropped


class Engines:
    """Several VLLMWorkers fed from ONE shared-memory staging: the buckets are packed once and
    each engine loads them (what a multi-engine worker on one machine does), staged to the end,
    then loaded bucket by bucket (dsrl.rollout.shm_transport.stage_then_load, as the rollout
    workers push)."""

    def __init__(self, workers, name="bench engines"):
        from dsrl.rollout.shm_transport import ShmStaging

        self.workers, self.name, self.staging = workers, name, ShmStaging()
        self.load_seconds = []  # engine calls of each push (the rest is the trainer's export + pack)

    def bucket_allocator(self):
        return self.staging.alloc

    def push_weights(self, buckets, step):
        from dsrl.rollout.shm_transport import stage_then_load

        busy = []

        def load(ref, first):
            busy.extend(w.load_shared_bucket(ref, first) for w in self.workers)

        stage_then_load(self.staging, buckets, load, lambda: busy.extend(w.finish_shared_load() for w in self.workers),
                        name=self.name)
        self.load_seconds.append(sum(busy))

    def probe_logprobs(self, tokens):
        return {f"engine {i}": w.probe_logprobs(tokens) for i, w in enumerate(self.workers)}

    def close(self):
        self.staging.close()


def memcpy_seconds(nbytes: int, reps: int = 7) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sample_check_seconds(sync, reps: int = 20) -> float:
    """The train step's check of its samples on the default batch (64 samples of 16 tokens): the
    masked |trainer - engine| reduction the training forward adds (dsrl.actor.engine) and
    WeightSync.check_samples (median seconds)."""
    g = torch.Generator().manual_seed(0)
    lp, q = -torch.rand(64, 16, generator=g), -torch.rand(64, 16, generator=g)
    mask = torch.ones(64, 16)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        diff = ((lp - q).abs() * mask).sum()
        sync.tolerance, saved = float("inf"), sync.tolerance  # the timing, not the verdict
        sync.check_samples(float(diff), float(mask.sum()), 0)
        sync.tolerance = saved
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_costs(actor, worker, folder: str, dtype: str, bucket_mb: float, rounds: int) -> dict:
    """One engine: its own reload, the sync without its check and the probe check alone, ABBA per
    round; the greedy refresh and the train step's sample check (medians, seconds)."""
    from dsrl.config.schema import RolloutConfig
    from dsrl.rollout.weight_sync import PROBE_PREFIX, WeightSync, trainer_greedy_probe

    engines = Engines([worker], name="rollout engine")
    cfg = dataclasses.replace(RolloutConfig(), dtype=dtype, sync_bucket_mb=bucket_mb, sync_probe=True)
    sync = WeightSync(actor, engines, cfg, probe_every=1)
    try:
        sync.push(0)  # pushed and probed once: the greedy sequences exist
        file_push(actor, [worker], folder)  # the file the engine's own reload reads
        sync.probe = False

        steps = {"reload": lambda: worker.reload_folder(folder), "sync": lambda: sync.push(0),
                 "check": lambda: sync.check(0, count=False)}
        times = {k: [] for k in steps}
        for _ in range(rounds):
            order = list(steps)
            for k in order + order[::-1]:
                t0 = time.perf_counter()
                steps[k]()
                times[k].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer_greedy_probe(actor, [p[:PROBE_PREFIX] for p in sync.prefixes])
        refresh = time.perf_counter() - t0
        out = {k: statistics.median(v) for k, v in times.items()}
        out.update(refresh=refresh, samples=sample_check_seconds(sync))
        return out
    finally:
        engines.close()


def per_push(c: dict, every: int) -> float:
    """Sync + check per push when the probe runs on every `every`-th push (the greedy
    refresh on every PROBE_REFRESH-th probe) and, for every > 1, the train step checks the pushes
    between."""
    from dsrl.rollout.weight_sync import PROBE_REFRESH

    probe = c["check"] + c["refresh"] / PROBE_REFRESH
    return c["sync"] + probe / every + (c["samples"] * (every - 1) / every if every > 1 else 0.0)


def run_dtype(model_path: str, dtype: str, rounds: int, bucket_mb: float, engines=(1, 2)) -> dict:
    from dsrl.actor.engine import ActorEngine
    from dsrl.config.schema import RolloutConfig
    from dsrl.rollout.vllm_worker import VLLMWorker
    from dsrl.rollout.weight_sync import WeightSync, probe_tokens, trainer_probe_logprobs

    actor = ActorEngine(model_path, zero_stage=0, dtype=dtype, trainable=False, micro_batch_size=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in actor.module.parameters():
            p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
    nbytes = sum(t.numel() * t.element_size() for _, t in actor.export_named_tensors(copy=False))
    workers = [VLLMWorker(model_path, dtype=dtype, kv_cache_gib=1, local_rank=0, local_world=1)
               for _ in range(max(engines))]
    cfg = dataclasses.replace(RolloutConfig(), dtype=dtype, sync_bucket_mb=bucket_mb, sync_probe=False)
    groups = {k: Engines(workers[:k]) for k in engines}
    syncs = {k: WeightSync(actor, e, cfg) for k, e in groups.items()}
    folder = tempfile.mkdtemp(prefix="bench_sync_")
    methods = {f"shm x{k}": (lambda k=k: syncs[k].push(0)) for k in engines}
    methods.update({f"file x{k}": (lambda k=k: file_push(actor, workers[:k], folder)) for k in engines})
    times = {m: [] for m in methods}
    try:
        for m in methods.values():  # warm-up: segments created, files cached, engines touched
            m()
        for e in groups.values():
            e.load_seconds.clear()
        for r in range(rounds):
            for k in engines:
                order = [f"shm x{k}", f"file x{k}"]
                for m in order + order[::-1]:  # ABBA
                    t0 = time.perf_counter()
                    methods[m]()
                    times[m].append(time.perf_counter() - t0)
        # Probe of each engine after a sync: mean |diff| against the trainer's log-probs.
        last = max(engines)
        syncs[last].push(0)
        tokens = probe_tokens(actor.hf_config.vocab_size)
        mine = trainer_probe_logprobs(actor, tokens)
        diffs = {n: float((torch.tensor(v) - mine).abs().mean())
                 for n, v in groups[last].probe_logprobs(tokens).items()}
        costs = check_costs(actor, workers[0], folder, dtype, bucket_mb, rounds)
    finally:
        for e in groups.values():
            e.close()
        for w in workers:
            w.close()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    loads = {k: statistics.median(e.load_seconds[:2 * rounds]) for k, e in groups.items()}
    return {"bytes": nbytes, "memcpy": memcpy_seconds(nbytes), "times": times, "diffs": diffs, "loads": loads,
            "costs": costs}


def parse_options(argv, defaults: dict) -> dict:
    """`bench.key=value` arguments over `defaults`; an unknown key exits naming the known ones."""
    opts = dict(defaults)
    for a in argv:
        k, _, v = a.partition("=")
        if k not in opts:
            raise SystemExit(f"unknown option {k!r}; known: {sorted(opts)}")
        opts[k] = v
    return opts


def main(argv) -> int:
    from dsrl import hardware
    from dsrl.setup_assets import smollm2_path
    from dsrl.testing import configure_test_env, ensure_tiny_model

    configure_test_env()  # DeepSpeed on CPU, its JIT op cache

    opts = parse_options(argv, {"bench.rounds": "3", "bench.model": "smollm2", "bench.dtypes": "float32,bfloat16",
                                "bench.bucket_mb": "256", "bench.engines": "1,2"})
    model = str(smollm2_path() if opts["bench.model"] == "smollm2" else ensure_tiny_model())
    print(hardware.describe(hardware.probe(1)))
    print(f"model {model}, bucket {opts['bench.bucket_mb']} MiB, {opts['bench.rounds']} ABBA rounds")
    from dsrl.rollout.weight_sync import PROBE_REFRESH
    from dsrl.validation.validate import AUTO_PROBE_EVERY

    engines = tuple(sorted({int(k) for k in opts["bench.engines"].split(",")}))
    for dtype in opts["bench.dtypes"].split(","):
        res = run_dtype(model, dtype, int(opts["bench.rounds"]), float(opts["bench.bucket_mb"]), engines)
        mb, cp = res["bytes"] / 1e6, res["memcpy"]
        print(f"[{dtype}] model {mb:.0f} MB; memcpy {cp * 1e3:.1f} ms ({mb / 1e3 / cp:.1f} GB/s)")
        for k in engines:
            shm, fil = statistics.median(res["times"][f"shm x{k}"]), statistics.median(res["times"][f"file x{k}"])
            print(f"[{dtype}] {k} engine(s): shm sync {shm:.3f} s ({shm / cp:.1f}x memcpy), file push {fil:.3f} s "
                  f"({fil / cp:.1f}x memcpy); file/shm {fil / shm:.2f}x  (medians of {len(res['times'][f'shm x{k}'])}); "
                  f"shm = trainer export+pack {shm - res['loads'][k]:.3f} s + engine loads {res['loads'][k]:.3f} s")
        print(f"[{dtype}] probe mean |log-prob diff|: " + ", ".join(f"{n} {d:.2e}" for n, d in res["diffs"].items()))
        c = res["costs"]
        reload = c["reload"]
        print(f"[{dtype}] 1 engine, medians of {2 * int(opts['bench.rounds'])} (ABBA): the engine's own reload "
              f"{reload:.3f} s; sync {c['sync']:.3f} s ({c['sync'] / reload:.2f}x); probe check {c['check']:.3f} s; "
              f"greedy refresh {c['refresh']:.3f} s (every {PROBE_REFRESH}-th probe); the train step's sample check "
              f"{c['samples'] * 1e3:.3f} ms")
        for every, what in ((1, "probe on every sync (rollout.sync_probe_every=1)"),
                            (AUTO_PROBE_EVERY, f"auto: the probe on every {AUTO_PROBE_EVERY}-th sync, the train step's "
                                               "check between (sync_probe_every=null)")):
            total = per_push(c, every)
            print(f"[{dtype}] sync + check per push, {what}: {total:.3f} s = {total / reload:.2f}x the engine's own "
                  f"reload (goal <= 1.3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
