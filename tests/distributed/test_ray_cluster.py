"""rollout.ray_address=auto with no cluster on the machine: the run starts a private one, as
ray.init() does with no address, and says so (before: a ConnectionError traceback)."""
import os
import subprocess
import sys

import pytest

from dsrl.testing import subprocess_env

SCRIPT = """
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
import ray
from dsrl.distributed.ray_cluster import join
cluster = join("auto", leader=True, num_cpus=1)
print("STARTED_LOCAL", cluster.started_local, int(ray.cluster_resources().get("CPU", 0)), flush=True)
cluster.shutdown()
"""


@pytest.mark.slow
def test_auto_without_a_cluster_starts_a_private_one_and_says_so():
    from dsrl.distributed.ray_cluster import _local_cluster_running

    if _local_cluster_running():
        pytest.skip("a Ray cluster runs on this machine: auto joins it")
    env = subprocess_env(RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=180,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "STARTED_LOCAL True 1" in r.stdout
    assert "rollout.ray_address=auto: no Ray cluster runs on this machine" in r.stdout + r.stderr
