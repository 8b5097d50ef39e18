"""The vLLM-CPU engine settings chosen by measurement (bench/bench_rollout.py bench.knobs=1,
docs/benchmarks.md "Rollout speed"): each rank's engine binds its OpenMP threads to an explicit, even share of the
cores (vLLM's `auto` and `nobind` were 1.19x and 1.67x slower on the default job), reserves none,
runs in its own process (dsrl's engine host, vLLM in-process there), and keeps chunked prefill off
(per-request seeds). The bench's "old
settings" arm must stay what dsrl shipped before the engine settings were tuned, so its ratio means what it says."""
from __future__ import annotations

import sys
from pathlib import Path

from dsrl.rollout.vllm_engine import cpu_llm_kwargs, engine_env
from dsrl.rollout.vllm_worker import resolve_host

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_engine_binds_an_explicit_core_share_per_rank():
    assert resolve_host("auto") == "process"  # the engine's own process, vLLM in-process there
    env = engine_env(1, 0, 1, multiprocess=False)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] not in ("auto", "nobind")
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert engine_env(1, 0, 1, multiprocess=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    # Two local ranks: disjoint halves of the usable cores (one core: both share it).
    assert [engine_env(1, r, 2, multiprocess=False)["VLLM_CPU_OMP_THREADS_BIND"] for r in (0, 1)] == _expected_halves()
    # rollout.engine_cores: the cores named, whatever the share would be
    assert engine_env(1, 0, 1, multiprocess=False, cores="1")["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def _expected_halves():
    """Two local ranks: each the next half of the cores this process may use (its affinity:
    `taskset -c 1` leaves core 1 alone, and both ranks share it; docs/concepts/exactness.md, the suite on one core)."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // 2)
    out = []
    for start in (0, per % len(cores)):
        share = cores[start:start + per]
        out.append(str(share[0]) if len(share) == 1 else f"{share[0]}-{share[-1]}")
    return out


def test_chunked_prefill_stays_off_on_cpu():
    assert cpu_llm_kwargs()["enable_chunked_prefill"] is False


def test_default_job_prompt_spans_a_whole_kv_block(smollm2_path):
    """Prefix caching shares whole blocks only: the n samples of a group reuse their prompt's KV in
    the engine step that computes it only if the prompt fills at least one block (vLLM-CPU's
    default block of 128 tokens left the default job's 43-token prompts prefilled 8 times)."""
    import random

    from transformers import AutoTokenizer

    from dsrl.data.registry import make_source
    from dsrl.rollout.vllm_engine import CPU_BLOCK_SIZE

    block = cpu_llm_kwargs()["block_size"]
    assert block == CPU_BLOCK_SIZE and block % 32 == 0  # vLLM-CPU attention takes multiples of 32
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    for p in make_source("arith").sample_train(16, random.Random(0)):
        text = tok.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        assert len(tok.encode(text, add_special_tokens=False)) >= block


def test_bench_old_settings_are_the_pre_issue_9_ones():
    import bench_rollout

    assert bench_rollout.OLD_ENV["VLLM_CPU_OMP_THREADS_BIND"] == "0-{last}"
    assert bench_rollout.OLD_KWARGS["enforce_eager"] is True
    assert bench_rollout.OLD_KWARGS["enable_prefix_caching"] is True
    assert bench_rollout.OLD_KWARGS["enable_chunked_prefill"] is False
    assert "block_size" not in bench_rollout.OLD_KWARGS  # vLLM-CPU's default (128) before the engine settings were tuned


def test_the_engine_process_binds_itself_to_its_cores():
    """vLLM applies VLLM_CPU_OMP_THREADS_BIND only to worker processes it spawns; the engine host's
    child runs vLLM in-process, so it binds itself (bind_engine_process): its affinity becomes the
    cores named (rollout.engine_cores) or the rank's share, whatever it inherited, and torch's pool
    matches. Run in a fresh interpreter that inherits every core this test may use."""
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    code = ("import os, torch; from dsrl.rollout.vllm_engine import bind_engine_process as b; "
            "import sys; ids = b(**eval(sys.argv[1])); print(ids, sorted(os.sched_getaffinity(0)), torch.get_num_threads())")
    def run(kwargs, inherit):
        out = subprocess.run([sys.executable, "-c", code, repr(kwargs)], capture_output=True, text=True, timeout=120,
                             preexec_fn=lambda: os.sched_setaffinity(0, inherit))
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("\n")[0]
    last = cores[-1]
    assert run({"cores": str(last)}, set(cores)) == f"[{last}] [{last}] 1"
    if len(cores) >= 2:  # two local ranks: rank 1 gets the second half, not what it inherited
        half = cores[len(cores) // 2:]
        assert run({"local_rank": 1, "local_world": 2, "cores": ""}, set(cores)) == f"{half} {half} {len(half)}"
