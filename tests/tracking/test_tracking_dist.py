"""Two real ranks (gloo process group, spawned processes): only rank 0 draws and writes."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


def _worker(rank, init_file, out_dir):
    # Capture everything this rank prints to stderr (where tqdm draws).
    err = open(os.path.join(out_dir, f"rank{rank}.stderr"), "w", buffering=1)
    sys.stderr = err
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=WORLD)
        from dsrl.distributed.ranks import global_rank, is_main_rank, world_size
        from dsrl.tracking.metrics import MetricsLogger
        from dsrl.tracking.progress import microbatch_bar, progress

        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": global_rank(), "world": world_size(), "main": is_main_rank()}, f)

        with microbatch_bar(3, "actor train") as bar:
            for _ in range(3):
                bar.update(1)
        for _ in progress(range(2), desc="ref forward", unit="microbatch"):
            pass
        log = MetricsLogger(os.path.join(out_dir, "run"))  # default: rank 0 only
        log.log(1, {"reward/mean": float(rank)})
        log.close()
        dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stderr = sys.__stderr__
        err.close()


def test_only_rank0_prints_bars_and_writes(tmp_path, monkeypatch):
    # The launcher env claims rank 0 everywhere: the process group must take precedence.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    init_file = tmp_path / "pg_init"
    mp.spawn(_worker, args=(str(init_file), str(tmp_path)), nprocs=WORLD, join=True)

    info = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert info == [{"rank": 0, "world": 2, "main": True}, {"rank": 1, "world": 2, "main": False}]

    err0 = (tmp_path / "rank0.stderr").read_text()
    err1 = (tmp_path / "rank1.stderr").read_text()
    assert "actor train" in err0 and "ref forward" in err0
    assert "actor train" not in err1 and "ref forward" not in err1
    assert "%|" not in err1  # no tqdm bar of any kind on rank 1

    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.0}]  # rank 1 (reward 1.0) wrote nothing
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1
