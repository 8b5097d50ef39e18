"""GPU smoke, trainer level: needs torch (CUDA) + deepspeed + hydra-core + omegaconf + transformers,
no vLLM. Run by `launch/gpu_smoke.sh trainer` and tests/gpu/test_gpu_trainer.py (DS_ACCELERATOR=cuda).

1. ZeRO-2 and ZeRO-3 actors in bf16 on CUDA: engine.device is cuda:LOCAL_RANK, host microbatches
   are scored on the device (dsrl.actor.device) and come back on the host, both stages agree.
2. ZeRO-3 export (layer-group gathers) equals the ZeRO-2 weights bit for bit.
3. CUDA IPC round trip between two processes (dsrl.rollout.cuda_ipc: reduce_tensor, UUID-keyed
   handle, storage_device override, ipc_collect).
4. GRPO steps of the real loop (python -m dsrl.main) with rollout.backend=hf in bf16, ZeRO-2 and
   ZeRO-3, on the tiny model built offline: step time, tokens/s, sync time.
5. Every engine case of dsrl.testing.engine_cases (each objective x layout, what CI runs on the
   simulated accelerator) through ActorEngine.forward_backward on CUDA, fp32: each runs, with a
   finite loss on the device and finite gradients.
6. The Tinker service's LoRA pool on CUDA: a mixed-adapter forward_backward, the pool's step, a
   merged export and an adapter save/load round trip.
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


def engine_cases_on_cuda(model_path: str) -> None:
    from dsrl.actor.engine import ActorEngine
    from dsrl.testing import engine_cases as cases

    batch = cases.samples()
    torch.manual_seed(0)
    eng = ActorEngine(model_path, zero_stage=0, micro_batch_size=3, lr=1e-3, grad_clip=0.0)
    failed, n = [], 0
    for name in sorted(cases.CASES):
        for layout in cases.LAYOUTS:
            n += 1
            try:
                outs = cases.run_case(eng, name, layout, batch)
                grads = [p.grad for p in eng.module.parameters() if p.grad is not None]
                if not all(o.loss.device.type == "cuda" and bool(torch.isfinite(o.loss)) for o in outs):
                    failed.append(f"{name}/{layout}: loss not a finite cuda scalar")
                elif not grads or not all(bool(torch.isfinite(g).all()) for g in grads):
                    failed.append(f"{name}/{layout}: gradient missing or not finite")
            except Exception as e:  # the failure CI's simulated accelerator is there to prevent
                failed.append(f"{name}/{layout}: {type(e).__name__}: {e}")
            for p in eng.module.parameters():
                p.grad = None
    report("engine_cases_on_cuda", not failed, f"{n - len(failed)}/{n} cases; " + "; ".join(failed[:3]))


def lora_pool_on_cuda(model_path: str, out_dir: Path) -> None:
    from dsrl.loss import tinker
    from dsrl.loss.registry import get_objective
    from dsrl.serve.lora import LoraPool, LoraSpec

    pool = LoraPool(model_path, dtype=torch.float32, attn_implementation="eager", micro_batch_size=2, pad_id=0)
    for i, name in enumerate(("a", "b")):
        pool.add_slot(name, LoraSpec(rank=4, alpha=8.0, seed=i))
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(4):
        toks = torch.randint(10, 1000, (7,), generator=g).tolist()
        data.append({"model_input": toks[:-1], "loss_fn_inputs": {
            "target_tokens": toks[1:], "advantages": torch.randn(6, generator=g).tolist(),
            "logprobs": (-torch.rand(6, generator=g)).tolist()}})
    spec = get_objective(tinker.tinker_objective_name("ppo"))
    out = pool.session.run_prepared(pool.session.validate(data, "ppo"), spec, tinker.resolve_config("ppo", {}),
                                    forward_only=False, tags=["a", "b", "a", "b"])
    from dsrl.actor.work_units import AdamParams

    norms = pool.step({"a": AdamParams(learning_rate=1e-2), "b": AdamParams(learning_rate=1e-2)})
    merged = pool.merged_state("a")
    folder = out_dir / "lora_slot_a"
    folder.mkdir(parents=True, exist_ok=True)
    pool.save_slot("a", folder)
    pool.load_slot("a", folder, optimizer=True)
    on_gpu = all(p.device.type == "cuda" for p in pool.slot_parameters("a").values())
    ok = (str(pool.device).startswith("cuda") and on_gpu and all(v.device.type == "cpu" for v in merged.values())
          and all(n["grad_norm:mean"] > 0 for n in norms.values()) and len(out.loss_fn_outputs) == 4)
    report("lora_pool_on_cuda", ok, f"device={pool.device} grad norms={[round(n['grad_norm:mean'], 4) for n in norms.values()]}")


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
                  lambda: engine_cases_on_cuda(model_path), lambda: lora_pool_on_cuda(model_path, out_dir),
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
