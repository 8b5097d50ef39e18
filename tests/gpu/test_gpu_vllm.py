"""GPU checks, vLLM level (tests/gpu/vllm_smoke.py; docs/guides/gpu.md): skipped without CUDA or vLLM."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM for CUDA")]


def test_vllm_level_gpu_smoke():
    script = Path(__file__).with_name("vllm_smoke.py")
    env = dict(os.environ, DS_ACCELERATOR="cuda")
    r = subprocess.run([sys.executable, str(script)], cwd=script.parents[2], capture_output=True, text=True,
                       env=env, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "FAIL" not in r.stdout and "SUMMARY" in r.stdout
