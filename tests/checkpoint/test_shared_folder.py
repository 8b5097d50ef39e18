"""Checkpoints need one folder all ranks share (rank 0 completes, renames and prunes it): two real
gloo ranks given different run folders, as on node-local disks, are refused before training,
naming the folder and the rank that cannot see it; the same folder passes."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.distributed.ports import free_port


def _rank(rank: int, port: int, roots: list, out_dir: str) -> None:
    from dsrl.checkpoint import check_shared_checkpoint_folder
    from dsrl.config.reuse import ConfigError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        check_shared_checkpoint_folder(roots[rank])
        result = "ok"
    except ConfigError as e:
        result = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"r{rank}.txt"), "w") as f:
        f.write(result)


def _run(tmp_path, roots):
    mp.spawn(_rank, args=(free_port(), [str(r) for r in roots], str(tmp_path)), nprocs=2, join=True)
    return [(tmp_path / f"r{r}.txt").read_text() for r in (0, 1)]


def test_one_shared_folder_passes_and_leaves_nothing_behind(tmp_path):
    run = tmp_path / "run"
    assert _run(tmp_path, [run, run]) == ["ok", "ok"]
    assert os.listdir(run / "checkpoints") == []  # the probe file is gone


def test_node_local_folders_are_refused_on_every_rank_naming_the_path(tmp_path):
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    got = _run(tmp_path, [node0, node1])
    for msg in got:  # every rank raises, so none waits in a later collective
        assert f"checkpoints: {node0 / 'checkpoints'} is not shared by every rank (rank 1 on " in msg
        assert f"({node1 / 'checkpoints'}) cannot see what rank 0 writes there" in msg
        assert "put hydra.run.dir (or trainer.resume_from) on a shared filesystem" in msg
