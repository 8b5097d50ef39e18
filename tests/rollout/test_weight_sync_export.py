"""ActorEngine.export_named_tensors: under ZeRO-3 gathered one layer group at a time, bit-equal
to the ZeRO-0 export and to the checkpoint file (the independent reference)."""
from __future__ import annotations

import os

import pytest
import torch

from dsrl.actor.engine import ActorEngine, _layer_groups


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    z0 = ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=2)
    z3 = ActorEngine(str(tiny_model_path), zero_stage=3, persistence_threshold=0, micro_batch_size=2)
    return z0, z3


def test_layer_groups_split_embeddings_layers_and_the_rest():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.10.input_layernorm.weight", "model.norm.weight",
             "lm_head.weight"]
    groups = _layer_groups([(n, None) for n in names])
    assert [[n for n, _ in g] for g in groups] == [
        names[:1], names[1:3], names[3:4], names[4:5], names[5:6], names[6:7]]


def test_zero3_export_is_bit_exact_and_gathers_layer_by_layer(engines, tiny_model_path, monkeypatch):
    import deepspeed
    from safetensors.torch import load_file

    z0, z3 = engines
    gathered = []
    real = deepspeed.zero.GatheredParameters

    def spy(params, *args, **kwargs):
        gathered.append(len(list(params)))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", spy)
    out3 = list(z3.export_named_tensors())
    out0 = list(z0.export_named_tensors())
    n_params = sum(1 for _ in z3.module.parameters())
    # Never the whole model at once: one gather per group, each at most one decoder layer's worth.
    layers = z3.hf_config.num_hidden_layers
    assert len(gathered) >= layers + 2 and max(gathered) < n_params and sum(gathered) == n_params
    assert [n for n, _ in out3] == [n for n, _ in out0]
    for (n, a), (_, b) in zip(out3, out0):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    # Independent reference: the checkpoint file itself (the tiny model has a tied head: no lm_head).
    ref = load_file(os.path.join(str(tiny_model_path), "model.safetensors"))
    ref.pop("lm_head.weight", None)
    assert set(ref) == {n for n, _ in out3}
    for n, t in out3:
        assert torch.equal(t, ref[n]), n
    # After the export every ZeRO-3 parameter is partitioned again (nothing left gathered).
    assert all(p.numel() == 0 for p in z3.module.parameters())


def test_export_copies_unless_asked_not_to(engines):
    z0, _ = engines
    name, p = next(iter(z0.module.named_parameters()))
    copied = dict(z0.export_named_tensors())[name]
    live = dict(z0.export_named_tensors(copy=False))[name]
    assert copied.data_ptr() != p.data_ptr() and live.data_ptr() == p.data_ptr()
    assert z0.state_dict_for_export().keys() == dict(z0.export_named_tensors()).keys()
