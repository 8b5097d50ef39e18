"""The launch/ scripts: each parses (`bash -n`), starts with a usage comment and
`set -euo pipefail`, and rejects bad arguments with a message and exit code 2 before doing
anything (nothing is started: every case below fails in argument checking). The hostfile
example parses with DeepSpeed's own hostfile reader."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).parents[2] / "launch"
SCRIPTS = ["multinode_deepspeed.sh", "ray_cluster.sh", "slurm_example.sbatch"]


def _run(*args, env=None):
    import os

    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    e.update(env or {})
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=60, env=e)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses_and_has_usage_and_strict_mode(name):
    path = LAUNCH / name
    assert _run("-n", path).returncode == 0, _run("-n", path).stderr
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert lines[1].startswith("# Usage:"), lines[1]
    assert "set -euo pipefail" in lines


@pytest.mark.parametrize("args, message", [
    (["multinode_deepspeed.sh"], "Usage: launch/multinode_deepspeed.sh HOSTFILE"),
    (["multinode_deepspeed.sh", "/nonexistent/hostfile"], "hostfile '/nonexistent/hostfile' not found"),
    (["ray_cluster.sh"], "Usage: launch/ray_cluster.sh head"),
    (["ray_cluster.sh", "bogus"], "unknown command 'bogus'"),
    (["ray_cluster.sh", "worker"], "worker needs the head node's address"),
    (["ray_cluster.sh", "head", "--num-gpus", "x"], "--num-gpus needs a number, got 'x'"),
    (["ray_cluster.sh", "head", "--gpus", "2"], "expected '--num-gpus N'"),
    (["ray_cluster.sh", "head", "--num-gpus"], "expected '--num-gpus N', got: --num-gpus"),
    (["ray_cluster.sh", "worker", "10.0.0.1", "--blocking"], "expected '--num-gpus N' or '--block', got: --blocking"),
    (["ray_cluster.sh", "wait"], "wait needs the head node's address"),
    (["ray_cluster.sh", "wait", "10.0.0.1", "0"], "wait needs the number of nodes, got '0'"),
    (["ray_cluster.sh", "wait", "10.0.0.1", "2", "soon"], "wait's TIMEOUT_S must be a number of seconds, got 'soon'"),
    (["ray_cluster.sh", "submit", "10.0.0.1"], "unknown command 'submit' (head | worker | wait | stop)"),  # not supported
    (["slurm_example.sbatch"], "run this with sbatch"),
])
def test_bad_arguments_fail_with_a_message(args, message):
    r = _run(LAUNCH / args[0], *args[1:])
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert message in r.stdout + r.stderr, r.stdout + r.stderr


def test_hostfile_rejects_a_malformed_line(tmp_path):
    bad = tmp_path / "hostfile"
    bad.write_text("# comment\nnode-a slots=2\nnode-b 4\n")
    r = _run(LAUNCH / "multinode_deepspeed.sh", bad)
    assert r.returncode == 2 and "got: node-b 4" in r.stderr, r.stderr


def test_example_hostfile_parses_with_deepspeed():
    from deepspeed.launcher.runner import fetch_hostfile

    assert dict(fetch_hostfile(str(LAUNCH / "hostfile"))) == {"localhost": 2}
