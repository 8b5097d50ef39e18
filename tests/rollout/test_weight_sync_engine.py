"""Weight sync into a REAL vLLM engine (tiny Llama, float32) through shared memory: after the
trainer's weights change, a sync makes vLLM's log-probs match the trainer's and an independent
HF model's; small buckets split layers across engine calls (one layerwise-reload session), staged
then loaded, with exactly the result of the engine's own reload; a sync that
misses a bucket trips the tolerance error naming the engine; a bucket the engine fails to load is
named with the engine, and no staged file is left; the staged segments stay until close and
/dev/shm holds none of them after. (A rebuilt engine reloading them:
tests/rollout/test_engine_restart.py, whose pushes take this path.)"""
from __future__ import annotations

import dataclasses
import functools
import os

import re

import pytest
import torch

from dsrl.actor.engine import ActorEngine
from dsrl.config.schema import RolloutConfig
from dsrl.rollout.resilient import ResilientWorker
from dsrl.rollout.shm_transport import leftover_segments
from dsrl.rollout.vllm_worker import VLLMWorker
from dsrl.rollout.weight_sync import (PROBE_REFRESH, WeightSync, WeightSyncError, probe_tokens,
                                      trainer_greedy_probe)

pytestmark = pytest.mark.slow

NAME = "sync test engine (tiny)"
BUCKET_MB = 0.1  # ~100 KB: the tiny model's q/k/v and gate/up land in different buckets


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    return ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=2)


@pytest.fixture(scope="module")
def rw(tiny_model_path):
    worker = ResilientWorker(functools.partial(VLLMWorker, str(tiny_model_path), dtype="float32", kv_cache_gib=1),
                             name=NAME, max_restarts=1, timeout_s=300.0, poll_s=0.2)
    yield worker
    worker.close()
    assert leftover_segments(os.getpid()) == []  # close() removed every staged segment


def _cfg(**kw):
    return dataclasses.replace(RolloutConfig(), dtype="float32", sync_bucket_mb=BUCKET_MB, **kw)


def _perturb(actor, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _hf_probe(actor, tokens):
    """Independent reference: a plain transformers model holding the trainer's current weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(actor.hf_config, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(actor.state_dict_for_export(), strict=False)
    model.tie_weights()
    model.eval()
    ids = torch.tensor(tokens)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def test_sync_makes_engine_logprobs_match_the_trainer(actor, rw):
    sync = WeightSync(actor, rw, _cfg())
    assert sync.tolerance == 1e-3  # the float32 default
    _perturb(actor, 0)
    with pytest.raises(WeightSyncError, match=re.escape(NAME)):  # the engine still serves the folder's weights
        sync.check(0)
    m = sync.push(1)
    n_bytes = sum(t.numel() * t.element_size() for _, t in actor.export_named_tensors(copy=False))
    assert m["rollout/sync_bytes"] == n_bytes
    assert m["rollout/sync_buckets"] > 4  # layers split over buckets
    assert 0.0 <= m["rollout/sync_logprob_diff"] < 1e-4, m
    tokens = probe_tokens(actor.hf_config.vocab_size, n=4, length=16)  # random tokens: every position scored
    engine = torch.tensor(rw.probe_logprobs(tokens))
    assert (engine - _hf_probe(actor, tokens)).abs().max() < 1e-4
    # A second sync after another change (segments reused) still matches.
    _perturb(actor, 1)
    m2 = sync.push(2)
    assert m2["rollout/sync_logprob_diff"] < 1e-4 and m2["rollout/sync_bytes"] == n_bytes
    assert len(leftover_segments(os.getpid())) == m2["rollout/sync_buckets"]  # kept for a rebuilt engine
    print(f"\nfloat32 tiny sync: diff {m['rollout/sync_logprob_diff']:.2e} / {m2['rollout/sync_logprob_diff']:.2e}, "
          f"{m['rollout/sync_buckets']:.0f} buckets, {m2['timing/sync_seconds']:.3f} s")


def test_a_missing_bucket_trips_the_tolerance_naming_the_engine(actor, rw):
    sync = WeightSync(actor, rw, _cfg())
    _perturb(actor, 2)
    real_push = rw.push_weights

    def push_without_the_embedding(buckets, step):
        # Bucket 0 holds the embedding (and, through the re-tie, the head): left out, the engine
        # keeps the last sync's copy. (Leaving out part of a fused layer, e.g. gate_proj without
        # up_proj, leaves that part uninitialised in vLLM: not a deterministic test.)
        buckets = list(buckets)  # streamed into a worker that stages them (one pass)
        assert [m.name for m in buckets[0].metas] == ["model.embed_tokens.weight"]
        return real_push(buckets[1:], step)

    rw.push_weights = push_without_the_embedding
    try:
        with pytest.raises(WeightSyncError, match=re.escape(NAME) + r": mean \|log-prob diff\| .*rollout\.sync_tolerance=0\.001"):
            sync.push(3)
    finally:
        del rw.push_weights
    assert sync.push(4)["rollout/sync_logprob_diff"] < 1e-4  # a full sync repairs it


def test_probe_prefixes_are_fixed_and_the_continuation_is_the_trainers_greedy_choice(actor, rw):
    assert probe_tokens(1000) == probe_tokens(1000) and probe_tokens(1000) != probe_tokens(1000, seed=1)
    assert len(probe_tokens(1000)) == 8 and all(len(s) == 4 for s in probe_tokens(1000))
    prefixes = probe_tokens(actor.hf_config.vocab_size)
    tokens = trainer_greedy_probe(actor, prefixes, length=12)
    assert [t[:4] for t in tokens] == prefixes and all(len(t) == 12 for t in tokens)
    # Each continuation token is the argmax after the ones before it, by an independent
    # uncached forward of a plain transformers model holding the same weights.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(actor.hf_config, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(actor.state_dict_for_export(), strict=False)
    model.tie_weights()
    with torch.no_grad():
        ref = model.eval()(input_ids=torch.tensor(tokens)).logits.float()
    assert torch.equal(ref[:, 3:-1].argmax(-1), torch.tensor(tokens)[:, 4:])
    # The sync reuses them until its refresh, then recomputes them from the current weights.
    sync = WeightSync(actor, rw, _cfg())
    first = sync.probe_sequences()
    _perturb(actor, 9)
    assert all(sync.probe_sequences() == first for _ in range(PROBE_REFRESH - 1))
    assert sync.probe_sequences() == trainer_greedy_probe(actor, [p[:4] for p in sync.prefixes]) != first


def test_bucketed_push_gives_the_engine_exactly_what_its_own_reload_of_the_trainers_weights_gives(actor, rw,
                                                                                                tmp_path):
    """The push stages many small buckets, then loads them one call each
    (dsrl.rollout.shm_transport.stage_then_load); afterwards the engine's log-probs equal, bit for
    bit, those after vLLM's own reload of a safetensors file of the trainer's weights."""
    from safetensors.torch import save_file

    sync = WeightSync(actor, rw, _cfg(sync_probe=False))
    _perturb(actor, 5)
    m = sync.push(5)
    assert m["rollout/sync_buckets"] > 10
    tokens = probe_tokens(actor.hf_config.vocab_size, n=4, length=16)
    pushed = rw.probe_logprobs(tokens)
    save_file(actor.state_dict_for_export(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    rw.worker.reload_folder(str(tmp_path))
    assert rw.probe_logprobs(tokens) == pushed


def test_a_failed_bucket_load_names_the_bucket_and_the_engine_and_leaves_no_segment(actor, rw):
    """An engine error on bucket 3 of a push: the export has run to the end (under
    ZeRO-3 it is collective), the error names the engine and the bucket, and no staged file is
    left (the engine holds a half-loaded sync nothing could load back). The next push repairs it."""
    from dsrl.rollout.buckets import Bucket
    from dsrl.rollout.shm_transport import BucketLoadError

    sync = WeightSync(actor, rw, _cfg())
    _perturb(actor, 6)
    real_push, drawn = rw.push_weights, []

    def push_with_a_bad_bucket(buckets, step):
        def renamed():
            for i, b in enumerate(buckets):
                drawn.append(i)
                if i == 3:  # a tensor the model does not have: vLLM's load_weights raises
                    b = Bucket(b.data, [dataclasses.replace(b.metas[0], name="model.layers.0.no_such.weight")]
                               + b.metas[1:])
                yield b
        return real_push(renamed(), step)

    rw.push_weights = push_with_a_bad_bucket
    try:
        with pytest.raises(BucketLoadError, match=re.escape(NAME) + r": loading weight bucket 3 of \d+ .*"
                                                  r"model\.layers\.0\.no_such\.weight") as e:
            sync.push(6)
    finally:
        del rw.push_weights
    assert e.value.index == 3 and drawn == list(range(e.value.count)) and e.value.count > 10
    assert leftover_segments(os.getpid()) == []
    assert sync.push(7)["rollout/sync_logprob_diff"] < 1e-4  # probed: the engine serves the trainer's weights
