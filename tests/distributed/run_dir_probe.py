"""Launched by test_run_dir.py under `deepspeed --num_gpus 2`: composes dsrl's real Hydra
config (no hydra.run.dir given), initialises torch.distributed the way dsrl does, and records
where this rank's Hydra put its run folder. Rank 1 starts 1.2 s late, so its own timestamp
would differ from rank 0's. Each rank also sums a tensor through DeepSpeed's shared-memory allreduce."""
import json
import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from dsrl.config.schema import register_configs

register_configs()
CONF = str(Path(__file__).resolve().parents[2] / "conf")


@hydra.main(version_base=None, config_path=CONF, config_name="config")
def main(cfg) -> None:
    import torch.distributed as dist

    from dsrl.actor.engine import close_distributed, init_distributed

    run_dir = HydraConfig.get().runtime.output_dir
    init_distributed()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, run_dir)  # the process group works on the shared store
    rank = dist.get_rank()
    # Under DeepSpeed's launcher (LOCAL_SIZE set: its CPU backend maps the shared-memory buffers),
    # its shared-memory allreduce still works with the buffers' names unlinked by init_distributed:
    # 1 + 2 on both ranks. (Its kernel without the buffers, under torchrun, crashes the rank.)
    import deepspeed.comm
    import torch

    summed = shm_op = None
    if os.environ.get("LOCAL_SIZE") == str(dist.get_world_size()):
        summed = deepspeed.comm.inference_all_reduce(torch.tensor([rank + 1.0] * 8)).tolist()
        shm_op = bool(getattr(torch.ops.deepspeed, "inference_all_reduce_", None))
    Path(run_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "run_dir": run_dir, "all": names,
                                                             "summed": summed, "shm_op": shm_op}))
    close_distributed()  # as dsrl.main ends a run: a barrier, then the group is destroyed


if __name__ == "__main__":
    sys.argv[1:] = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    if os.environ.get("RANK") == "1":
        time.sleep(1.2)
    main()
