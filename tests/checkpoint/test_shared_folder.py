"""Checkpoints need one folder all ranks share (rank 0 completes, renames and prunes it): two real
gloo ranks given different run folders, as on node-local disks, are refused before training,
naming the folder and the rank that cannot see it; the same folder passes."""
import os

from two_ranks import run_two_ranks


def _run(tmp_path, roots):
    return run_two_ranks(tmp_path, roots, "shared")


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
