"""The CPU engine's own process (dsrl.rollout.engine_host) with the REAL vLLM engine on the tiny
Llama: one child named VLLM::EngineCore and nothing under it (vLLM in-process there), no vLLM in
the caller's process, a bad request raised in the caller with the engine's traceback and the
engine still serving, a model that cannot load named before anything runs, and a child that
outlives its parent by at most a few seconds. Kills, hangs and restarts through ResilientWorker:
tests/rollout/test_engine_restart.py; the same tokens as vLLM's own multiprocess engine, bit for
bit in bf16: tests/e2e/test_behaviour_kept.py (its reference tree keeps vLLM's two layers). A CPU
engine's sampler runs eagerly (nothing compiled at its first generate) and samples what the
compiled sampler samples, bit for bit."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from dsrl.rollout.engine_host import PROCESS_TITLE, EngineStartError
from dsrl.rollout.vllm_worker import VLLMWorker, resolve_host
from dsrl.testing import subprocess_env

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_auto_is_the_process_host_on_cpu_and_unknown_hosts_are_named():
    assert resolve_host("auto") == "process"  # this suite runs without CUDA
    assert [resolve_host(h) for h in ("process", "inline", "vllm")] == ["process", "inline", "vllm"]
    with pytest.raises(ValueError, match=r"engine host 'subprocess': expected one of \('auto', 'process'"):
        resolve_host("subprocess")


def test_a_model_that_cannot_load_is_named_and_leaves_no_process(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(EngineStartError, match=r"vLLM engine for .*not-a-model failed to start"):
        VLLMWorker(str(bad), dtype="float32", kv_cache_gib=1)
    left = [p for p in psutil.Process().children() if p.pid not in before and _alive(p.pid)]
    assert left == []


def test_one_child_no_vllm_in_the_caller_bad_requests_raised_there_and_no_orphan(tiny_model_path):
    """A fresh interpreter builds a worker and reports what it sees: one child named VLLM::EngineCore
    with nothing under it (vLLM's engine core and model runner are in it), no vLLM imported in the
    caller, a bad request raised in the caller with the engine's traceback as a note and the engine
    serving the same tokens after it. Then it SIGKILLs itself without closing the worker (no reaper
    here): the child sees its end of the pipe close and exits."""
    script = textwrap.dedent(f"""
        import json, os, signal, sys
        import psutil
        from dsrl.rollout.vllm_worker import VLLMWorker
        w = VLLMWorker({str(tiny_model_path)!r}, dtype="float32", kv_cache_gib=1)
        child = psutil.Process(w._engine.pid)
        kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=6)
        first = w.generate([[1, 2, 3]], seeds=[7], **kw)
        try:
            w.generate([[1, 2, 3]], seeds=[7, 8], **kw)
            error = None
        except ValueError as e:
            error = [str(e), list(getattr(e, "__notes__", []))]
        again = w.generate([[1, 2, 3]], seeds=[7], **kw)
        print(json.dumps(dict(pid=child.pid, ppid=child.ppid(), me=os.getpid(), name=child.name(),
                              grandchildren=len(child.children(recursive=True)), vllm="vllm" in sys.modules,
                              error=error, same=[c.token_ids for c in again[0]] == [c.token_ids for c in first[0]],
                              alive=w.engine_alive())), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=subprocess_env())
    assert r.returncode == -9, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["ppid"] == seen["me"] and seen["name"].startswith(PROCESS_TITLE[:15])  # comm holds 15 chars
    assert seen["grandchildren"] == 0 and seen["vllm"] is False and seen["alive"] is True
    message, notes = seen["error"]
    assert message == "2 seeds for 1 prompts" and any("in the engine process" in n and "generate" in n for n in notes)
    assert seen["same"] is True  # same seed, same tokens, after the bad request
    deadline = time.monotonic() + 30
    while _alive(seen["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(seen["pid"]), f"engine process {seen['pid']} outlived its parent by 30 s"


def test_a_cpu_engine_compiles_nothing_and_samples_what_the_compiled_sampler_samples(tiny_model_path):
    """vLLM compiles the sampler's rank count with inductor at an engine's first generate (4-5 s of
    every engine start on CPU); dsrl's CPU engines run it eagerly (vllm_engine.eager_sampler_ops).
    Two fresh interpreters, each with an engine in its own process: dsrl's, whose first generate
    and prompt-logprob probe compile no frame, and one with compiling allowed again before its
    first generate, as vLLM has it (dynamo's frame count shows the compiled path ran). The same
    seeded requests give the same tokens and log-probs, and the probe the same values, bit for bit."""
    def run(compiled: bool) -> dict:
        script = textwrap.dedent(f"""
            import json
            import torch._dynamo
            from torch._dynamo.utils import counters
            from dsrl.rollout.vllm_engine import VLLMEngine
            e = VLLMEngine({str(tiny_model_path)!r}, dtype="float32", multiprocess=False)
            if {compiled}:  # as vLLM has it; else dsrl's own setting, untouched
                torch._dynamo.config.disable = False
            out = e.generate([[1, 2, 3, 4, 5, 6, 7, 8] * 4, [9, 10, 11] * 5], n=3, temperature=1.0, top_p=1.0,
                             max_tokens=6, seeds=[3, 4])
            print(json.dumps(dict(samples=[[(c.token_ids, c.logprobs) for c in g] for g in out],
                                  probe=e.probe_logprobs([list(range(1, 40))]),
                                  frames=sum(counters["frames"].values()))))
        """)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                           env=subprocess_env())
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    eager, compiled = run(compiled=False), run(compiled=True)
    assert eager["frames"] == 0 and compiled["frames"] > 0, (eager["frames"], compiled["frames"])
    assert eager["samples"] == compiled["samples"] and eager["probe"] == compiled["probe"]
