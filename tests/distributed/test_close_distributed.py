"""A run ends its process group in step with its peers (dsrl.actor.engine.close_distributed),
and dsrl.main.run does so only where every rank reached the same end."""
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsrl.errors import RunStopped
from dsrl.testing import subprocess_env

# Two gloo ranks in fresh interpreters (spawn): rank 1 is late to the end and leaves a mark just
# before it closes; rank 0 must still see that mark only after its own close returned, and
# neither keeps a process group afterwards.
TWO_RANKS = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, folder, port):
        from dsrl.actor.engine import close_distributed
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        if rank == 1:
            time.sleep(1.0)
            Path(folder, "rank1-closing").write_text("x")
        close_distributed()
        assert not dist.is_initialized(), rank
        if rank == 0:
            assert Path(folder, "rank1-closing").exists(), "rank 0 left before rank 1 reached the end"
        close_distributed()  # a second call (no group left) is a no-op

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(sys.argv[1], int(sys.argv[2])), nprocs=2, join=True)
""")


def test_close_waits_for_every_rank_then_destroys_the_group(tmp_path):
    from dsrl.distributed.ports import free_port

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    r = subprocess.run([sys.executable, str(script), str(tmp_path), str(free_port())], capture_output=True,
                       text=True, timeout=240, env=subprocess_env(PYTHONPATH=str(Path(__file__).parents[2])))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


class _Worker:
    closed = False

    def close(self):
        self.closed = True


class _Trainer:
    stop_signal = None

    def __init__(self, end):
        self.end, self.worker = end, _Worker()

    def close(self):  # Trainer.close: the rollout side (agent endpoint, worker)
        self.worker.close()

    def fit(self):
        if isinstance(self.end, BaseException):
            raise self.end
        return self.end


@pytest.mark.parametrize("end, together", [
    ({"steps": 2}, True),  # the last step: every rank is there
    (RunStopped(signal.SIGTERM, 1, "/ckpt/step_1"), True),  # a stop the ranks agreed on (all_reduce_max)
    (RuntimeError("Connection closed by peer"), False),  # a lost peer: a barrier would wait for it
    (KeyboardInterrupt(), False),
])
def test_run_closes_the_group_only_when_every_rank_reached_the_same_end(monkeypatch, end, together):
    import dsrl.actor.engine as engine
    import dsrl.distributed.reaper as reaper
    import dsrl.main as main

    closes, reaped, trainer = [], [], _Trainer(end)
    monkeypatch.setattr(engine, "close_distributed", lambda: closes.append(trainer.worker.closed))
    monkeypatch.setattr(main, "build", lambda cfg, run_dir: trainer)

    class _Reaper:
        @classmethod
        def start(cls):
            return cls()

        def close(self):
            reaped.append(list(closes))  # the group (where closed) is closed before the watchdog goes

    monkeypatch.setattr(reaper, "Reaper", _Reaper)
    if isinstance(end, BaseException):
        with pytest.raises(type(end)):
            main.run(None, "unused")
    else:
        assert main.run(None, "unused") == end
    assert trainer.worker.closed
    assert closes == ([True] if together else [])  # after the rollout worker stopped
    assert reaped == [closes]  # the watchdog is stopped once, however the run ended
