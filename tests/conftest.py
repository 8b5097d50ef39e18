"""Session-wide test set-up: CPU environment defaults and the model folders from
dsrl.setup_assets (tiny random Llama built on demand; SmolLM2 only if `make setup` ran)."""
from __future__ import annotations

import os

import pytest



def _pin_this_worker() -> None:
    """Under `make test` (N pytest-xdist workers, N <= cores) each worker, and every process it
    starts (CLI jobs, engines, ranks, Ray), runs on its own 1/N of the cores: dsrl sizes its
    threads from the affinity (dsrl.hardware.usable_core_ids), so two workers no longer run four
    spinning OpenMP thread pools on two cores. Set before torch starts its thread pool. TEST_PIN=0
    (the Makefile's knob) leaves the affinity alone; one process (TEST_WORKERS=0) is never pinned."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or os.environ.get("TEST_PIN", "1") == "0":
        return
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // count
    if per < 1:
        return
    index = int(worker[2:]) % count
    os.sched_setaffinity(0, cores[index * per:(index + 1) * per])


_pin_this_worker()

# The cyclic garbage collector stays off while the test modules import torch, DeepSpeed, vLLM's
# config and transformers; once they are collected every object alive leaves its scans (gc.freeze)
# and it runs again (pytest_collection_finish below). The ~0.6M imported objects live as long as the
# worker anyway, and the automatic full passes over them while the suite's in-process engines
# build, step and save took ~6% of those tests' time (2.5 s of 44 s in three engine-heavy files).
# dsrl's own processes do the same at their start (dsrl/heap.py).
import gc  # noqa: E402

gc.disable()

from dsrl.testing import (configure_test_env, default_cache_dir, ensure_tiny_model,  # noqa: E402
                          smollm2_available)
from dsrl.setup_assets import smollm2_path as _smollm2_path  # noqa: E402

# Before any test imports ray / deepspeed / torch extensions.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
configure_test_env(default_cache_dir())


@pytest.fixture(scope="session")
def cache_dir():
    d = default_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def tiny_model_path(cache_dir):
    """Folder of the random-init tiny Llama (SmolLM2 tokenizer); built if absent."""
    return ensure_tiny_model(cache_dir)


@pytest.fixture(scope="session")
def smollm2_path(cache_dir):
    """Folder of the converted SmolLM2-135M-Instruct; skips the test if not converted."""
    if not smollm2_available(cache_dir):
        pytest.skip("SmolLM2 not converted: run `make setup` (python -m dsrl.setup_assets)")
    return _smollm2_path(cache_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


# ---------------------------------------------------------------------------------------------
# Two workers (`make test` runs `pytest -n 2 --dist loadfile`, refined below). Most real-engine tests keep one
# core busy (Python start-up, imports, engine set-up, a tiny model's small kernels), so two files
# run side by side. A file's tests stay on one worker (its module-scoped engines are built once);
# the files in one SHARED_WORKER group share a worker (a session fixture built once; one Ray
# cluster at a time on the machine, as `rollout.ray_address=auto` would find another worker's);
# the heaviest files start first (HEAVY_FIRST), so that no long file starts last.
SHARED_WORKER = {
    "ray": ("tests/e2e/test_e2e_ray.py", "tests/rollout/test_ray_engines.py", "tests/rollout/test_ray_dispatch.py",
            "tests/distributed/test_ray_cluster.py", "tests/multinode/test_two_nodes.py",
            "tests/multinode/test_agent_two_hosts.py", "tests/rollout/test_hf_worker_build.py"),
    "tiny-uninterrupted-run": ("tests/e2e/test_e2e_resume.py", "tests/e2e/test_behaviour_kept.py",
                               "tests/e2e/test_kill_anywhere.py"),
}
HEAVY_FIRST = (  # measured seconds per file, largest first (a full run's --durations, 2 pinned workers)
    "tests/agent/test_agent_frameworks.py",  # two SmolLM2 runs: both frameworks 2 steps, the learning 3 steps (~560 + ~600 s)
    "tests/e2e/test_kill_anywhere.py",  # ~520 s alone besides the shared uninterrupted run (9 launches)
    "tests/multinode/test_two_nodes.py",
    "tests/e2e/test_behaviour_kept.py",
    "tests/e2e/test_e2e_resume.py",
    "tests/rollout/test_engine_restart.py",
    "tests/e2e/test_e2e_async.py",
    "tests/agent/test_verifiers_env.py",
    "tests/e2e/test_e2e_agent_endpoint.py",
    "tests/docs/test_doc_commands.py",
    "tests/e2e/test_e2e_ray.py",
    "tests/rollout/test_ray_engines.py",
    "tests/serve/test_serve_soak.py",
    "tests/serve/test_serve_entry.py",
    "tests/rollout/test_vllm_schedule.py",
    "tests/serve/test_cookbook.py",
    "tests/rollout/test_weight_sync_stale.py",
    "tests/rollout/test_engine_host.py",
    "tests/rollout/test_lora_sync.py",
    "tests/e2e/test_e2e_agent.py",
    "tests/agent/test_agent_trainer.py",
    "tests/actor/test_engine_nonfinite.py",
    "tests/e2e/test_e2e_grpo.py",
    "tests/trainer/test_overlap_e2e.py",
    "tests/actor/test_lora_cli.py",
    "tests/config/test_config_errors.py",
    "tests/serve/test_serve_sampling.py",
    "tests/fuzz/test_fuzz_inputs.py",
    "tests/actor/test_simulated_device.py",
    "tests/serve/test_serve_limits.py",
    "tests/distributed/test_run_dir.py",
    "tests/rollout/test_weight_sync_engine.py",
    "tests/tinker/test_tinker_engine.py",
    "tests/agent/test_episodes_vllm.py",
)


# ---------------------------------------------------------------------------------------------
# The suite's wall time follows the machine's single-core speed, which differed ~2x between the
# 2-core sessions' machines (same tests, same CPU model name) and up to 3x within one session (the
# loop below: 65, 104 and 200 ms on one idle machine within 20 minutes, 2026-12-03): a fixed
# pure-Python loop, timed at the start in the controller and printed at the end, says how fast the
# machine was when a reported time was taken.
_CALIBRATION = {}


def _python_loop_seconds() -> float:
    import time
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i * i
        best = min(best, time.perf_counter() - t0)
    return best


def pytest_sessionstart(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or the only process)
        _CALIBRATION["python_loop_s"] = _python_loop_seconds()


def pytest_terminal_summary(terminalreporter):
    if "python_loop_s" in _CALIBRATION:
        terminalreporter.write_line(
            f"machine speed: 1e6-iteration Python loop {_CALIBRATION['python_loop_s'] * 1000:.0f} ms "
            f"(best of 3, at the start; docs/benchmarks.md \"Test suite timings\")")


def _group(path: str) -> str:
    return next((name for name, files in SHARED_WORKER.items() if path in files), path)


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()


def pytest_collection_modifyitems(config, items):
    rank = {}  # a group starts as early as its heaviest file
    for i, path in enumerate(HEAVY_FIRST):
        rank.setdefault(_group(path), i)
    # Stable: the rest keep the collection order, after the heavy files.
    items.sort(key=lambda item: rank.get(_group(item.nodeid.split("::")[0]), len(HEAVY_FIRST)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` refined: a work unit is a file or a SHARED_WORKER group, in collection order
    (heaviest first). Not xdist's `loadgroup`: under pytest 9 it cannot rename a test's node id, so
    its xdist_group marks group nothing (measured: one file's tests ran on both workers)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::")[0])

    return FileGroups(config, log)
