"""All ranks of a launch share rank 0's run folder (dsrl.distributed.run_dir); a launch leaves no
shared-memory buffer of DeepSpeed's behind (dsrl.actor.engine.init_distributed)."""
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.distributed import run_dir
from dsrl.distributed.ports import free_port
from dsrl.distributed.shm_buffers import SHM_ALLREDUCE_PREFIX
from dsrl.testing import subprocess_env

PROBE = Path(__file__).with_name("run_dir_probe.py")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_two_ranks_share_one_hydra_run_folder(tmp_path, launcher):
    """Two ranks under the deepspeed launcher (rank 0 hosts the store) or torchrun (its agent
    does), the real conf/config.yaml, no hydra.run.dir: exactly one timestamped folder, holding
    both ranks' records, and the process group built on the rendezvous store works
    (all_gather_object returns both ranks' folders)."""
    exe = str(Path(sys.executable).parent / launcher)
    nproc = ["--num_gpus", "2"] if launcher == "deepspeed" else ["--nproc_per_node", "2"]
    env = subprocess_env(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=str(Path(__file__).parents[2]))
    port = free_port()
    r = subprocess.run([exe, *nproc, "--master_port", str(port), str(PROBE)],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    # DeepSpeed's launcher makes its CPU backend map a 69 MB /dev/shm buffer per rank, which it never
    # unlinks; dsrl's init_distributed does, once every rank has mapped every other's.
    left = glob.glob(f"{SHM_ALLREDUCE_PREFIX}_{os.getuid()}_*_{port}_*")
    assert left == [], left
    folders = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(folders) == 1, folders
    records = [json.loads((folders[0] / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert [rec["rank"] for rec in records] == [0, 1]
    assert records[0]["run_dir"] == records[1]["run_dir"]
    assert records[0]["all"] == records[1]["all"] == [records[0]["run_dir"]] * 2
    if launcher == "deepspeed":
        assert records[0]["summed"] == records[1]["summed"] == [3.0] * 8
        assert records[0]["shm_op"], "DeepSpeed's shm allreduce op was not loaded: the unlinking is not tested"
    assert Path(tmp_path, records[0]["run_dir"]).resolve() == folders[0].resolve()


def test_single_process_keeps_its_own_value(monkeypatch):
    monkeypatch.setattr(run_dir, "_values", {})
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert run_dir.rank0_value("outputs/a", "x") == "outputs/a"
    assert run_dir.rank0_value("outputs/b", "x") == "outputs/a"  # resolved once per process
    assert run_dir.take_store() is None


def test_a_launch_without_master_address_is_named(monkeypatch):
    monkeypatch.setattr(run_dir, "_values", {})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "1234")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        run_dir.rank0_value("outputs/a")


def test_rank0_value_travels_through_a_real_store(monkeypatch):
    """Rank 0 publishes, rank 1 (another store client on the same port) receives; both in one
    process here, as two TCPStore ends."""
    import torch.distributed as dist

    port = free_port()
    monkeypatch.setattr(run_dir, "_values", {})
    monkeypatch.setattr(run_dir, "_store", None)
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    assert run_dir.rank0_value("outputs/rank0-folder") == "outputs/rank0-folder"
    master = run_dir.take_store()
    try:
        monkeypatch.setattr(run_dir, "_values", {})
        monkeypatch.setenv("RANK", "1")
        assert run_dir.rank0_value("outputs/rank1-folder") == "outputs/rank0-folder"
        assert isinstance(run_dir.take_store(), dist.TCPStore)
    finally:
        del master
