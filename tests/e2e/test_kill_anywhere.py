"""Kill anywhere, resume, and get the uninterrupted run (real vLLM + DeepSpeed, tiny model, float32).

Each launch of a run B is killed with SIGKILL to its whole process group (trainer and engines) at a
seeded moment inside one phase (DSRL_KILL_AT, dsrl/rollout/faults.py: the kill lands inside the
phase, at the seeded delay or at the phase's end if it is shorter), then launched again with
trainer.resume=auto, until a launch finishes. Its metrics (timings aside) and final weights must
equal the uninterrupted run A's bit for bit:
- the synchronous loop (A: the session's uninterrupted run): killed in the rollout of step 2, the
  optimizer step of step 3, and while writing the checkpoint of step 3 (the half-written folder is
  never taken: the resume goes back to step 2's);
- the deterministic asynchronous schedule (k = 2; its run A also checks the schedule: staleness per
  step, the batches a checkpoint's buffer holds): killed in the scoring of step 2, then its vLLM
  engine process killed as the resumed launch generates (rollout.max_restarts=0: the run stops
  naming the engine), then killed in the weight push of step 3;
- the clock schedule (k = 1): killed in the rollout of step 2, then while writing the checkpoint of
  step 3; lossless, not exact (test_clock_async_killed_anywhere_loses_and_repeats_no_prompt).
A kill during a resumed launch re-runs the steps after the checkpoint it resumed from; the rows
those steps logged before the kill are rewritten, so each step appears once."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from dsrl.data import build_source
from e2e_jobs import STEPS, TINY, UNINTERRUPTED, job_cmd, job_env, metric_rows, untimed_metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SEED = 41
RESUME = ["trainer.resume=auto"]
DETERMINISTIC = [*TINY, f"trainer.total_steps={STEPS}", "trainer.save_every=1", "algo.off_policy_steps=2",
                 "algo.async_schedule=deterministic", "algo.use_tis=true", "algo.reuse_logprobs=auto",
                 "rollout.chunk_tokens=3", "rollout.max_restarts=0"]
CLOCK = [*TINY, f"trainer.total_steps={STEPS}", "trainer.save_every=1", "algo.off_policy_steps=1",
         "algo.async_schedule=clock", "algo.stale_groups=drop", "algo.use_tis=true", "algo.reuse_logprobs=auto",
         "rollout.chunk_tokens=2"]


def _kill(phase: str, step: int, rng: random.Random, longest: float) -> str:
    return f"{phase}@{step}:{rng.uniform(0.0, longest):.3f}"


def _group(pgid: int) -> list:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _launch_killed(run_dir, overrides, kill: str) -> None:
    """One launch, killed by its own kill point: SIGKILL to its process group (its own session),
    and no process of the group survives."""
    proc = subprocess.Popen(job_cmd(run_dir, *overrides, *RESUME), env=job_env(DSRL_KILL_AT=kill),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, (kill, proc.returncode, err[-3000:])
    end = time.time() + 20
    while _group(proc.pid) and time.time() < end:
        time.sleep(0.2)
    assert not _group(proc.pid), (kill, [p.name() for p in _group(proc.pid)])


def _finish(run_dir, overrides) -> str:
    r = subprocess.run(job_cmd(run_dir, *overrides, *RESUME), env=job_env(), capture_output=True, text=True,
                       timeout=600, start_new_session=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stderr + r.stdout


def _weights(run_dir):
    return load_file(str(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "hf" / "model.safetensors"))


def _same_run(a, b) -> None:
    assert [row["step"] for row in metric_rows(b)] == list(range(1, STEPS + 1))
    assert untimed_metrics(b) == untimed_metrics(a)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sync_loop_killed_in_rollout_optimizer_and_checkpoint_write_resumes_bit_exact(tmp_path,
                                                                                      uninterrupted_tiny_run):
    rng = random.Random(SEED)
    b = tmp_path / "b"
    kills = [_kill("rollout", 2, rng, 1.0), _kill("optimizer", 3, rng, 0.5), _kill("checkpoint", 3, rng, 0.5)]
    for kill in kills:
        _launch_killed(b, UNINTERRUPTED, kill)
        if kill.startswith("checkpoint"):  # killed mid-write: a temporary folder, never a step-3 checkpoint
            assert not (b / "checkpoints" / "step-000003").exists()
            assert (b / "checkpoints" / ".tmp-step-000003").exists()
    out = _finish(b, UNINTERRUPTED)
    assert "continuing after step 2" in out
    _same_run(uninterrupted_tiny_run, b)


def _engine_processes(pid: int) -> list:
    try:
        return [c for c in psutil.Process(pid).children(recursive=True) if "EngineCore" in c.name()
                or any("EngineCore" in part for part in c.cmdline()[:3])]
    except psutil.Error:
        return []


def test_deterministic_async_killed_anywhere_and_its_engine_killed_resumes_bit_exact(tmp_path, tiny_model_path):
    a, b = tmp_path / "a", tmp_path / "b"
    r = subprocess.run(job_cmd(a, *DETERMINISTIC), env=job_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    # the schedule itself, on run A: version v loads when batch v + 2 closes, so step s trains tokens
    # of version max(0, s - 3)
    rows = metric_rows(a)
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [row["async/token_lag_mean"] for row in rows] == [0.0, 1.0, 2.0, 2.0]
    lags = [[row[f"async/tokens_lag/{j}"] for j in range(4)] for row in rows]
    assert [[j for j, n in enumerate(lag) if n] for lag in lags] == [[0], [1], [2], [2]]
    # the checkpoint of step 2 holds the closed batches 3 and 4 (trained later) in its buffer
    state = torch.load(a / "checkpoints" / "step-000002" / "rank-0.pt", weights_only=False)["trainer"]["async_buffer"]
    assert (state["taken"], state["closed"], state["version"]) == (2, 4, 2)
    assert [batch.index for batch in state["ready"]] == [3, 4]
    rng = random.Random(SEED + 1)

    _launch_killed(b, DETERMINISTIC, _kill("scoring", 2, rng, 0.3))
    assert (b / "checkpoints" / "step-000001").exists() and not (b / "checkpoints" / "step-000002").exists()

    # the vLLM engine process killed as the resumed launch starts generating batch 4 (a seeded moment
    # after its resume): with rollout.max_restarts=0 the run stops, naming the engine
    proc = subprocess.Popen(job_cmd(b, *DETERMINISTIC, *RESUME), env=job_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = b / "run.log"
    end = time.time() + 600
    while not (log.exists() and "continuing after step 1" in log.read_text()):
        assert proc.poll() is None and time.time() < end, "the launch ended or hung before its resume"
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.5))
    engines = _engine_processes(proc.pid)
    assert engines, [c.name() for c in psutil.Process(proc.pid).children(recursive=True)]
    for e in engines:
        e.kill()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode not in (0, None), err[-3000:]
    assert "vLLM engine of rank 0" in err and "rollout.max_restarts=0" in err, err[-3000:]

    _launch_killed(b, DETERMINISTIC, _kill("weight_push", 3, rng, 0.3))
    out = _finish(b, DETERMINISTIC)
    assert "continuing after step" in out
    _same_run(a, b)


def _in_flight_at_the_end(run_dir) -> dict:
    """The groups the finished run drew and never trained nor dropped: those its last checkpoint's
    buffer still holds (in flight, or finished after the last batch closed), by draw number -> uid."""
    state = torch.load(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "rank-0.pt", weights_only=False)
    buf = state["trainer"]["async_buffer"]
    groups = [g for name in ("active", "open_batch", "open_dropped", "waiting") for g in buf[name]]
    return {"admitted": buf["admitted"], "left": {g.index: g.prompt.uid for g in groups}}


def _replayed_stream(run_dir, count: int) -> list:
    """The uids of the first `count` prompts of rank 0's stream, drawn as the asynchronous generator
    draws them (one at a time from random.Random(data.seed * 1000 + rank)), from the run's config."""
    data = json.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())["config"]["data"]
    source, rng = build_source(data), random.Random(data["seed"] * 1000)
    return [source.sample_train(1, rng)[0].uid for _ in range(count)]


def test_clock_async_killed_anywhere_loses_and_repeats_no_prompt(tmp_path, tiny_model_path):
    """The clock schedule (k = 1, stale groups dropped) killed in the rollout of step 2 and while
    writing the checkpoint of step 3, then finished with trainer.resume=auto. Which chunk a push
    lands between depends on timing, so the samples are no uninterrupted run's; what an
    uninterrupted run guarantees is that each prompt drawn is trained once or dropped once (or is
    still in flight when the run ends), and that is what the killed run must keep (no separate
    uninterrupted run is needed to compare with). From prompts.jsonl over the final history: each
    step once, the batch's 4 groups trained per step, no draw number twice, and every number below
    the run's draw count trained or dropped, except the groups still in flight at the end (those
    the last checkpoint's buffer holds); each number's prompt is the stream's draw of that number."""
    b = tmp_path / "b"
    rng = random.Random(SEED + 2)
    _launch_killed(b, CLOCK, _kill("rollout", 2, rng, 1.0))
    assert (b / "checkpoints" / "step-000001").exists() and not (b / "checkpoints" / "step-000002").exists()
    _launch_killed(b, CLOCK, _kill("checkpoint", 3, rng, 0.5))
    assert not (b / "checkpoints" / "step-000003").exists() and (b / "checkpoints" / ".tmp-step-000003").exists()
    assert [r["step"] for r in _prompt_rows(b)] == [1, 2, 3]  # step 3's row is logged before its checkpoint
    out = _finish(b, CLOCK)
    assert "continuing after step 2" in out

    rows = _prompt_rows(b)
    assert [(r["step"], r["rank"]) for r in rows] == [(s, 0) for s in range(1, STEPS + 1)]
    assert all(len(r["trained"]) == 4 for r in rows)  # algo.rollout_batch_size groups, one rank
    numbers = [d for r in rows for d in r["trained"] + r["dropped"]]
    assert len(set(numbers)) == len(numbers), f"a prompt trained or dropped twice: {rows}"
    end = _in_flight_at_the_end(b)
    left = end["left"]
    assert not set(left) & set(numbers), (left, rows)
    missing = sorted(set(range(max(numbers) + 1)) - set(numbers) - set(left))
    assert not missing, f"draws lost by the resumes: {missing} (rows {rows}, in flight at the end {sorted(left)})"
    assert sorted([*numbers, *left]) == list(range(end["admitted"]))
    stream = _replayed_stream(b, end["admitted"])
    for r in rows:
        assert r["trained_prompts"] == [stream[d] for d in r["trained"]], (r, "a prompt redrawn or skipped")
        assert r["dropped_prompts"] == [stream[d] for d in r["dropped"]], r
    assert all(stream[d] == uid for d, uid in left.items())
    assert [row["step"] for row in metric_rows(b)] == list(range(1, STEPS + 1))


def _prompt_rows(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
