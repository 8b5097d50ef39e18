"""Two real gloo ranks (torch.multiprocessing), each given its own run folder, running one
checkpoint-folder job: `check` (check_shared_checkpoint_folder) or `find` (find_latest, then
read_shared_state, with the warnings logged). Each rank's result or ConfigError message comes back
as a string (a JSON object for `find`)."""
import json
import logging
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.distributed.ports import free_port


def _rank(rank: int, port: int, roots: list, out_dir: str, job: str, storage: str) -> None:
    from dsrl.checkpoint import check_shared_checkpoint_folder, find_latest, read_shared_state
    from dsrl.errors import ConfigError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0")  # one rank per node
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("dsrl").addHandler(handler)
    try:
        if job == "check":
            check_shared_checkpoint_folder(roots[rank], storage)
            result = "ok"
        else:
            found = find_latest(roots[rank], storage)
            result = json.dumps({"found": found, "state": read_shared_state(found), "warnings": warnings})
    except ConfigError as e:
        result = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"r{rank}.txt"), "w") as f:
        f.write(result)


def run_two_ranks(tmp_path, roots, storage: str, job: str = "check") -> list:
    mp.spawn(_rank, args=(free_port(), [str(r) for r in roots], str(tmp_path), job, storage), nprocs=2, join=True)
    return [(tmp_path / f"r{r}.txt").read_text() for r in (0, 1)]
