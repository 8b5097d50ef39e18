"""Same seed, same run; SIGKILL and SIGTERM lose nothing; resume is exact (real vLLM + DeepSpeed,
tiny model, float32).

One uninterrupted run A is compared with a run B that is killed with SIGKILL after its step-2
checkpoint, resumed, stopped with SIGTERM after a later step, and resumed again: B's metrics (all
but timings) and final weights must equal A's bit for bit, and no process of a stopped trainer may
survive it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from dsrl.testing import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TINY = ["+exp=grpo_reuse", "model.path=tiny", "data.num_eval=8", "algo.rollout_batch_size=4",
        "algo.n_samples_per_prompt=4", "algo.global_batch_size=16", "rollout.max_new_tokens=8", "actor.lr=1e-4",
        "algo.entropy_coef=0.01", "model.dtype=float32", "rollout.dtype=float32", "trainer.eval_before=false",
        "trainer.eval_after=false", "logger.plot=false", "logger.tensorboard=false", "trainer.save_every=2",
        "trainer.keep_checkpoints=0"]
STEPS = 5


def _cmd(run_dir: Path, *extra: str) -> list:
    return [sys.executable, "-m", "dsrl.main", *TINY, f"trainer.total_steps={STEPS}", f"hydra.run.dir={run_dir}",
            *extra]


def _metrics(run_dir: Path) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]


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


def test_same_seed_same_run_and_exact_resume_through_sigkill_and_sigterm(tmp_path, tiny_model_path):
    env = subprocess_env(RAY_AUTH_MODE="disabled", HYDRA_FULL_ERROR="1")
    a, b = tmp_path / "a", tmp_path / "b"

    r = subprocess.run(_cmd(a), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    # B, killed with SIGKILL right after its step-2 checkpoint is complete.
    proc = subprocess.Popen(_cmd(b), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (b / "checkpoints" / "step-000002" / "COMPLETE.json").exists(), proc, 600, "checkpoint 2")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any("VLLM" in c.name() or "python" in c.name() for c in children)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _assert_no_survivors(children)

    # Resume (same run folder, trainer.resume=auto by default); SIGTERM once step 3 is logged.
    started = time.time()
    proc = subprocess.Popen(_cmd(b), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = b / "metrics.jsonl"  # rewritten from the checkpoint on resume, then appended to
    _wait_for(lambda: metrics.stat().st_mtime > started and len(metrics.read_text().splitlines()) >= 3,
              proc, 600, "step 3")
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = [line for line in err.splitlines() if line.startswith("dsrl: stopped by SIGTERM after step")]
    assert stopped, err[-3000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert step >= 3 and (b / "checkpoints" / f"step-{step:06d}" / "COMPLETE.json").exists()
    _assert_no_survivors(children)

    # Resume again to the end.
    r = subprocess.run(_cmd(b), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"continuing after step {step}" in r.stderr

    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    assert ma == mb
    wa, wb = load_file(str(a / "final_model" / "model.safetensors")), load_file(str(b / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_ranks_zero3_resume_equals_the_uninterrupted_run(tmp_path, tiny_model_path):
    """2 ranks (deepspeed launcher, gloo), ZeRO-3: resuming from run A's step-2 checkpoint into a new
    run folder reproduces A's step 3 and final weights exactly."""
    from dsrl.distributed.ports import free_port

    deepspeed = Path(sys.executable).parent / "deepspeed"
    env = subprocess_env(RAY_AUTH_MODE="disabled", HYDRA_FULL_ERROR="1")
    common = [*TINY, "actor.zero_stage=3", "actor.stage3_param_persistence_threshold=0", "trainer.total_steps=3"]

    def launch(run_dir, *extra):
        cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "dsrl.main",
               *common, f"hydra.run.dir={run_dir}", *extra]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        return r

    a, c = tmp_path / "a", tmp_path / "c"
    launch(a)
    assert sorted(os.listdir(a / "checkpoints")) == ["step-000002"]
    r = launch(c, f"trainer.resume_from={a}")
    assert "continuing after step 2" in r.stdout + r.stderr
    ma, mc = _metrics(a), _metrics(c)
    assert [m["step"] for m in mc] == [1, 2, 3] and ma == mc
    wa, wc = load_file(str(a / "final_model" / "model.safetensors")), load_file(str(c / "final_model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
