"""Rank padding (dsrl.actor.batch.rank_padding, pad_to_largest_rank): a rank with fewer
microbatches runs empty ones up to the largest count of any rank, at least `at_least` (one for the
policy and critic updates; none for a work unit with no datum anywhere), on 2 real gloo ranks and
in one process."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.actor.batch import pad_to_largest_rank, rank_padding
from dsrl.distributed.ports import free_port


def _ranks(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mine = [{"x": k} for k in range(3 if rank == 0 else 1)]
        got = {"padding": rank_padding(len(mine)), "none_anywhere": rank_padding(0, at_least=0),
               "padded": [mb.get("x", "empty") for mb in pad_to_largest_rank(mine, pad_id=0)]}
        torch.save(got, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_pad_to_the_larger_count(tmp_path):
    mp.spawn(_ranks, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{rank}.pt") for rank in (0, 1))
    assert (r0["padding"], r1["padding"]) == (0, 2)
    assert r0["none_anywhere"] == r1["none_anywhere"] == 0
    assert r0["padded"] == [0, 1, 2] and r1["padded"] == [0, "empty", "empty"]


def test_one_process_pads_only_to_at_least():
    assert rank_padding(3) == 0 and rank_padding(0) == 1 and rank_padding(0, at_least=0) == 0
    (empty,) = pad_to_largest_rank([], pad_id=5, fields=("returns",))
    assert empty["input_ids"].tolist() == [[5, 5]] and empty["loss_mask"].sum() == 0
    assert empty["returns"].shape == (1, 1)
