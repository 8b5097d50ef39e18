"""Same seed, same run; SIGKILL and SIGTERM lose nothing; resume is exact (real vLLM + DeepSpeed,
tiny model, float32).

One uninterrupted run A (a checkpoint every step) is compared with a run B that is killed with
SIGKILL after its step-2 checkpoint, resumed, and stopped with SIGTERM after a later step s: B's
step-s checkpoint (HF weights, DeepSpeed's weights and optimizer state, each rank's RNG and loop
state, the metrics) must equal A's step-s checkpoint bit for bit, timings aside, and no process of
a stopped trainer may survive it. That the SIGTERM checkpoint itself resumes exactly is the same
code path as the SIGKILL one (the newest complete checkpoint; tests/checkpoint covers the save
side). Two ranks under ZeRO-3: a resumed launch reproduces the uninterrupted launch's last step and
final weights."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from e2e_jobs import STEPS, TINY, UNINTERRUPTED, job_cmd, job_env, metric_rows, untimed, untimed_metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _equal(a, b, where: str) -> None:
    """Bit-for-bit equality of two loaded checkpoint objects (tensors, containers, numbers)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _same_checkpoint(ca: Path, cb: Path) -> None:
    """Every file of the two checkpoint folders holds the same state: weights, DeepSpeed's states,
    each rank's RNG and loop state, and the metrics so far (timings aside; the config differs only
    by its run folder)."""
    files = sorted(str(p.relative_to(ca)) for p in ca.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(cb)) for p in cb.rglob("*") if p.is_file())
    checked = 0
    for rel in files:
        fa, fb = ca / rel, cb / rel
        if rel.endswith(".safetensors"):
            _equal(load_file(str(fa)), load_file(str(fb)), rel)
        elif rel.endswith(".pt"):
            sa, sb = torch.load(fa, weights_only=False), torch.load(fb, weights_only=False)
            if rel.startswith("rank-"):
                # Python's and numpy's global generators are drawn by library code on paths the two
                # runs do not share (process start-up, the resume's weight push); no dsrl number
                # comes from them (the prompt stream is LoopState's own Random, sampling seeds are
                # per request). torch's generator (dropout) and the loop state must be equal.
                for s in (sa, sb):
                    s["rng"].pop("python"), s["rng"].pop("numpy")
            _equal(sa, sb, rel)
        elif rel == "trainer_state.json":
            sa, sb = json.loads(fa.read_text()), json.loads(fb.read_text())
            assert untimed(sa.pop("metrics")) == untimed(sb.pop("metrics"))
            sa.pop("config"), sb.pop("config")
            assert sa == sb
        else:
            continue
        checked += 1
    assert checked >= 4, files  # HF weights, DeepSpeed's model and optimizer states, rank state


def _wait_for(pred, proc: subprocess.Popen, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before {what}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def _assert_no_survivors(procs: list, timeout: float = 20.0) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"orphans survived the trainer: {[(p.pid, p.name()) for p in alive]}"


def test_same_seed_same_run_and_exact_resume_through_sigkill_and_sigterm(tmp_path, uninterrupted_tiny_run):
    env = job_env()
    a, b = uninterrupted_tiny_run, tmp_path / "b"

    # B, killed with SIGKILL right after its step-2 checkpoint is complete.
    proc = subprocess.Popen(job_cmd(b, *UNINTERRUPTED), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (b / "checkpoints" / "step-000002" / "COMPLETE.json").exists(), proc, 600, "checkpoint 2")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any("VLLM" in c.name() or "python" in c.name() for c in children)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _assert_no_survivors(children)

    # Resume (same run folder, trainer.resume=auto by default); SIGTERM once step 3 is logged.
    started = time.time()
    proc = subprocess.Popen(job_cmd(b, *UNINTERRUPTED), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics = b / "metrics.jsonl"  # rewritten from the checkpoint on resume, then appended to
    _wait_for(lambda: metrics.stat().st_mtime > started and len(metrics.read_text().splitlines()) >= 3,
              proc, 600, "step 3")
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    stopped = [line for line in err.splitlines() if line.startswith("dsrl: stopped by SIGTERM after step")]
    if stopped:
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        step = int(stopped[0].split("after step ")[1].split(";")[0])
    else:  # the signal came as the last step ended: a normal finish, whose last step is saved
        assert proc.returncode == 0, err[-3000:]
        step = STEPS
    assert "continuing after step 2" in err and step >= 3
    _assert_no_survivors(children)

    name = f"step-{step:06d}"
    assert (b / "checkpoints" / name / "COMPLETE.json").exists()
    _same_checkpoint(a / "checkpoints" / name, b / "checkpoints" / name)
    assert untimed_metrics(b) == untimed_metrics(a)[:step]


def test_two_ranks_zero3_launch_and_resume_equals_the_uninterrupted_run(tmp_path, tiny_model_path):
    """2 ranks (deepspeed launcher, gloo), ZeRO-3. Launch A: rollouts split across ranks, identical
    parameters on every rank after each step (trainer.check_rank_sync raises otherwise), full
    weights (gathered under ZeRO-3) pushed and probed on every rank's sampler. Launch C, resumed from
    A's step-2 checkpoint into a new run folder, reproduces A's step 3 and final weights exactly.
    The samplers are the in-process HF ones (rollout.backend=hf): what is checked is the ranks'
    training and resume, and each vLLM worker would add two processes' start-up per launch; two
    ranks with vLLM engines sharing ZeRO-3's gathered weights run in tests/e2e/test_e2e_ray.py."""
    from dsrl.distributed.ports import free_port

    deepspeed = Path(sys.executable).parent / "deepspeed"
    env = job_env()
    common = [*TINY, "rollout.backend=hf", "actor.zero_stage=3", "actor.stage3_param_persistence_threshold=0", "trainer.total_steps=3",
              "trainer.save_every=2", "trainer.check_rank_sync=true", "trainer.eval_after=true"]

    def launch(run_dir, *extra):
        cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "dsrl.main",
               *common, f"hydra.run.dir={run_dir}", *extra]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        return r.stdout + r.stderr

    a, c = tmp_path / "a", tmp_path / "c"
    out = launch(a)
    assert "ranks: 2" in out
    assert sorted(os.listdir(a / "checkpoints")) == ["step-000002"]
    ma = untimed_metrics(a)
    assert [m["step"] for m in ma] == [1, 2, 3]
    for m in metric_rows(a):
        assert m["rollout/logprob_diff"] < 1e-3  # ZeRO-3 gathered full weights reached both workers
        assert m.get("rollout/sync_logprob_diff", 0.0) < 1e-4  # every rank's engine passed the probe (first push)
        assert m["timing/old_logprobs"] == 0.0
    out = launch(c, f"trainer.resume_from={a}")
    assert "continuing after step 2" in out
    assert untimed_metrics(c) == ma
    wa, wc = load_file(str(a / "final_model" / "model.safetensors")), load_file(str(c / "final_model" / "model.safetensors"))
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
