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
