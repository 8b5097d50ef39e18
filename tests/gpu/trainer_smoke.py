"""GPU smoke, trainer level: needs torch (CUDA) + deepspeed + hydra-core + omegaconf + transformers,
no vLLM. Run by `launch/gpu_smoke.sh trainer` and tests/gpu/test_gpu_trainer.py (DS_ACCELERATOR=cuda).

1. ZeRO-2 and ZeRO-3 actors in bf16 on CUDA: engine.device is cuda:LOCAL_RANK, host microbatches
   are scored on the device (dsrl.actor.device) and come back on the host, both stages agree.
2. ZeRO-3 export (layer-group gathers) equals the ZeRO-2 weights bit for bit.
3. CUDA IPC round trip between two processes (dsrl.rollout.cuda_ipc: reduce_tensor, UUID-keyed
   handle, storage_device override, ipc_collect).
4. GRPO steps of the real loop (python -m dsrl.main) with rollout.backend=hf in bf16, ZeRO-2 and
   ZeRO-3, on the tiny model built offline: step time, tokens/s, sync time.
Prints one PASS/FAIL line per check and FIGURE lines; exits 1 when any check failed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def figure(name: str, value: float, unit: str) -> None:
    print(f"FIGURE {name} {value:.4g} {unit}", flush=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _microbatch(tokenizer):
    from dsrl.actor.batch import Sample, collate

    samples = [Sample(prompt_ids=tokenizer.encode("What is 3 + 4?"), response_ids=tokenizer.encode(" It is 7."),
                      rollout_log_probs=[0.0] * len(tokenizer.encode(" It is 7.")), group=0),
               Sample(prompt_ids=tokenizer.encode("Name a prime."), response_ids=tokenizer.encode(" 11"),
                      rollout_log_probs=[0.0] * len(tokenizer.encode(" 11")), group=1)]
    return collate(samples, tokenizer.pad_token_id or 0)


def actors_on_cuda(model_path: str, local_rank: int) -> None:
    from transformers import AutoTokenizer

    from dsrl.actor.engine import ActorEngine

    tok = AutoTokenizer.from_pretrained(model_path)
    mb = _microbatch(tok)
    scored, exported = {}, {}
    for stage in (2, 3):
        actor = ActorEngine(model_path, zero_stage=stage, dtype="bfloat16", micro_batch_size=2,
                            persistence_threshold=0)
        want = torch.device("cuda", local_rank)
        report(f"zero{stage}_device", actor.engine.device == want, f"engine.device={actor.engine.device}")
        lp = actor.score([mb])[0]
        report(f"zero{stage}_score_on_host", lp.device.type == "cpu" and bool(torch.isfinite(lp).all()),
               f"device={lp.device}")
        scored[stage] = lp
        _sync()
        t0 = time.perf_counter()
        exported[stage] = actor.state_dict_for_export()
        _sync()
        figure(f"zero{stage}_export_s", time.perf_counter() - t0, "s")
        del actor
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    diff = float((scored[2] - scored[3]).abs().max())
    report("zero2_vs_zero3_scores", diff < 0.05, f"max|diff|={diff:.3g}")
    same = exported[2].keys() == exported[3].keys() and all(torch.equal(exported[2][k], exported[3][k])
                                                             for k in exported[2])
    report("zero3_export_bit_exact", same, f"{len(exported[3])} tensors")


def _ipc_consumer(handle, expected_sum, queue) -> None:
    from dsrl.rollout.cuda_ipc import rebuild_from_handle

    t = rebuild_from_handle(handle)
    queue.put((float(t.double().sum()), str(t.device)))
    t.add_(1.0)  # the producer must see the write: same memory, not a copy
    torch.cuda.synchronize()
    queue.put("done")


def ipc_round_trip() -> None:
    import torch.multiprocessing as mp

    from dsrl.rollout.cuda_ipc import ipc_handle

    data = torch.arange(1 << 20, dtype=torch.float32, device="cuda") / 1024.0
    expected = float(data.double().sum())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.perf_counter()
    proc = ctx.Process(target=_ipc_consumer, args=(ipc_handle(data), expected, queue))
    proc.start()
    got_sum, device = queue.get(timeout=120)
    queue.get(timeout=120)
    proc.join(timeout=60)
    figure("ipc_round_trip_s", time.perf_counter() - t0, "s (incl. process start)")
    torch.cuda.ipc_collect()
    written = float(data.double().sum())
    report("cuda_ipc_round_trip", got_sum == expected and written == expected + (1 << 20) and proc.exitcode == 0,
           f"consumer sum {got_sum} on {device}, producer sees the consumer's write: {written == expected + (1 << 20)}")


def grpo_hf(model_path: str, stage: int, out_dir: Path) -> None:
    run_dir = out_dir / f"grpo_hf_zero{stage}"
    cmd = [sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", "rollout.backend=hf", "trainer.total_steps=3",
           "algo.rollout_batch_size=8", "algo.n_samples_per_prompt=8", "algo.global_batch_size=64",
           "rollout.max_new_tokens=32", "model.dtype=bfloat16", "rollout.dtype=bfloat16", f"actor.zero_stage={stage}",
           "actor.stage3_param_persistence_threshold=0", f"model.path={model_path}", "trainer.eval_before=false",
           "trainer.eval_after=false", "logger.progress=false", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, DS_ACCELERATOR="cuda", PYTHONUNBUFFERED="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=420)
    (out_dir / f"grpo_hf_zero{stage}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        report(f"grpo_hf_zero{stage}", False, (r.stdout + r.stderr)[-3000:])
        return
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    step_s = sum(r["timing/step"] for r in later) / len(later)
    tokens = [r["rollout/response_length"] * 64 for r in later]
    tok_s = sum(tokens) / sum(r["timing/rollout"] for r in later)
    sync_s = sum(r["timing/weight_sync"] for r in later) / len(later)
    figure(f"grpo_hf_zero{stage}_step_time", step_s, "s")
    figure(f"grpo_hf_zero{stage}_rollout_tokens_per_s", tok_s, "tok/s")
    figure(f"grpo_hf_zero{stage}_sync_time", sync_s, "s")
    diffs = [r.get("rollout/logprob_diff", float("nan")) for r in rows]
    report(f"grpo_hf_zero{stage}", len(rows) == 3 and all(d < 0.05 for d in diffs),
           f"steps={len(rows)} rollout/logprob_diff={['%.3g' % d for d in diffs]}")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    from dsrl.testing import configure_test_env, ensure_tiny_model

    os.environ["DS_ACCELERATOR"] = "cuda"
    configure_test_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    model_path = str(ensure_tiny_model())
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="dsrl-gpu-smoke-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"GPU {torch.cuda.get_device_name(local_rank)} | torch {torch.__version__} | out {out_dir}", flush=True)
    for check in (lambda: actors_on_cuda(model_path, local_rank), ipc_round_trip,
                  lambda: grpo_hf(model_path, 2, out_dir), lambda: grpo_hf(model_path, 3, out_dir)):
        try:
            check()
        except Exception as e:  # one broken check must not hide the others' results
            import traceback

            traceback.print_exc()
            report(getattr(check, "__name__", "check"), False, f"{type(e).__name__}: {e}")
    print(f"SUMMARY {sum(RESULTS)}/{len(RESULTS)} checks passed", flush=True)
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
