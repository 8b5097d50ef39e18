"""Session-wide test set-up: CPU environment defaults and the model folders from
dsrl.setup_assets (tiny random Llama built on demand; SmolLM2 only if `make setup` ran)."""
from __future__ import annotations

import os

import pytest

from dsrl.testing import (configure_test_env, default_cache_dir, ensure_tiny_model,
                          smollm2_available)
from dsrl.setup_assets import smollm2_path as _smollm2_path

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
# Two workers (`make test` runs `pytest -n 2 --dist loadgroup`). Most real-engine tests keep one
# core busy (Python start-up, imports, engine set-up, a tiny model's small kernels), so two files
# run side by side. A file's tests stay on one worker (its module-scoped engines are built once);
# the files in one SHARED_WORKER group share a worker (a session fixture built once; one Ray
# cluster at a time on the machine, as `rollout.ray_address=auto` would find another worker's);
# the heaviest files start first (HEAVY_FIRST), so that no long file starts last.
SHARED_WORKER = {
    "ray": ("tests/e2e/test_e2e_ray.py", "tests/rollout/test_ray_engines.py", "tests/rollout/test_ray_dispatch.py",
            "tests/distributed/test_ray_cluster.py", "tests/multinode/test_two_nodes.py",
            "tests/rollout/test_hf_worker_build.py"),
    "tiny-uninterrupted-run": ("tests/e2e/test_e2e_resume.py", "tests/e2e/test_behaviour_kept.py"),
}
HEAVY_FIRST = ()


def _group(path: str) -> str:
    return next((name for name, files in SHARED_WORKER.items() if path in files), path)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    for item in items:
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(_group(path)))
    # Stable: within a rank the collection order stays.
    items.sort(key=lambda item: rank.get(_group(item.nodeid.split("::")[0]), len(rank)))
