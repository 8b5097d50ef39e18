"""GPU checks, trainer level (tests/gpu/trainer_smoke.py): skipped without CUDA."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_trainer_level_gpu_smoke(tmp_path):
    script = Path(__file__).with_name("trainer_smoke.py")
    env = dict(os.environ, DS_ACCELERATOR="cuda", OUT=str(tmp_path))
    r = subprocess.run([sys.executable, str(script)], cwd=script.parents[2], capture_output=True, text=True,
                       env=env, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "FAIL" not in r.stdout and "SUMMARY" in r.stdout
