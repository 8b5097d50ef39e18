"""LoRA on the actor (dsrl.actor.lora, actor.lora.rank > 0) on the real DeepSpeed engine (tiny
Llama, float32): only the adapter trains (base weights bit-identical after steps, every adapter
tensor moved, gradients only on adapter parameters), under ZeRO 0, 2 and 3; the saved output is a
merged HF folder whose logits equal the trained actor's plus a PEFT adapter that reproduces the
actor exactly on the base model; config errors name actor.lora.* before any model loads."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from dsrl.actor.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_targets, merge_group
from dsrl.config.schema import register_configs, to_config
from dsrl.errors import ConfigError
from dsrl.loss.registry import get_objective
from dsrl.loss.types import Reduction
from dsrl.testing import random_microbatch
from dsrl.validation.validate import validate

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
register_configs()
PPO = get_objective("ppo")


def _lora(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"), dropout=0.0):
    return SimpleNamespace(rank=rank, alpha=alpha, target_modules=list(targets), dropout=dropout)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        return to_config(compose(config_name="config", overrides=["+exp=grpo_reuse", *overrides]))


# ---------------------------------------------------------------------- config (no model weights)
def test_lora_dropout_under_reuse_on_is_rejected_by_name():
    validate(_cfg("actor.lora.rank=8", "actor.lora.dropout=0.0"))  # reuse on + LoRA without dropout: fine
    with pytest.raises(ConfigError, match=r"actor\.lora\.dropout"):
        validate(_cfg("actor.lora.rank=8", "actor.lora.dropout=0.1"))


@pytest.mark.parametrize("override,key", [
    ("actor.lora.rank=-1", "actor.lora.rank"),
    ("actor.lora.rank=1000", "actor.lora.rank"),
    ("actor.lora.alpha=0", "actor.lora.alpha"),
    ("actor.lora.target_modules=[]", "actor.lora.target_modules"),
    ("actor.lora.target_modules=[q_proj,lm_head]", "actor.lora.target_modules"),
])
def test_bad_lora_values_are_rejected_by_name(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(_cfg("actor.lora.rank=8", override))


def test_target_modules_matching_nothing_is_rejected_before_loading(tiny_model_path):
    check_targets(_lora(), str(tiny_model_path))  # matches: no error
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules=\['qkv'\] matches no Linear.*q_proj"):
        check_targets(_lora(targets=["qkv"]), str(tiny_model_path))


def test_merge_group_adds_scaled_b_at_a():
    g = torch.Generator().manual_seed(0)
    w, a, b = torch.randn(6, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    group = [("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", w),
             ("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight", a),
             ("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight", b),
             ("base_model.model.model.layers.0.input_layernorm.weight", torch.ones(5))]
    out = dict(merge_group(group, 0.5))
    assert list(out) == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"]
    expect = w.clone()
    for i in range(6):  # hand-written B @ A
        for j in range(5):
            expect[i, j] += 0.5 * sum(float(b[i, k]) * float(a[k, j]) for k in range(2))
    torch.testing.assert_close(out["model.layers.0.mlp.up_proj.weight"], expect, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- the engine
def _mb(seed: int) -> dict:
    """Three random samples with random advantages (dsrl.testing.random_microbatch)."""
    return random_microbatch(seed, [(5, 4), (7, 3), (4, 6)])


def _engine(path, zero_stage, lora=None):
    from dsrl.actor.engine import ActorEngine

    return ActorEngine(str(path), zero_stage=zero_stage, lr=1e-2, micro_batch_size=4, persistence_threshold=0,
                       lora=lora if lora is not None else _lora())


def _backward(eng, mb):
    eng.weights_pushed()  # a new rollout from these weights (reuse refuses steps since the last push)
    reduce = Reduction("token-mean", global_tokens=float(mb["loss_mask"].sum()))
    eng.forward_backward(mb, PPO, {}, reduce, reuse_training_logprobs=True, is_last=True)


def _named_full(eng) -> dict:
    """Every parameter of the PEFT-wrapped module (gathered under ZeRO-3), PEFT names."""
    with eng.full_parameters():
        return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_only_the_adapter_trains(tiny_model_path, zero_stage):
    eng = _engine(tiny_model_path, zero_stage)
    before = _named_full(eng)
    adapter = {n for n in before if ".lora_" in n}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert {n for n, p in eng.module.named_parameters() if p.requires_grad} == adapter
    # The optimizer holds the adapter only (its element count; ZeRO flattens the tensors).
    trainable = sum(before[n].numel() for n in adapter)
    opt = eng.engine.optimizer
    if zero_stage == 3:  # one rank: its fp32 partitions are the whole of what the optimizer steps
        held = sum(t.numel() for t in opt.fp32_partitioned_groups_flat)
    else:
        held = sum(p.numel() for g in getattr(opt, "optimizer", opt).param_groups for p in g["params"])
    assert held == trainable
    if zero_stage == 0:  # gradients are plain .grad here: only adapter tensors get one
        _backward(eng, _mb(0))
        grads = {n: p.grad for n, p in eng.module.named_parameters()}
        assert all(grads[n] is None for n in grads if n not in adapter)
        assert all(float(grads[n].abs().sum()) > 0 for n in adapter if ".lora_B." in n)
        assert all(float(grads[n].abs().sum()) == 0 for n in adapter if ".lora_A." in n)  # B = 0 at the start
        eng.optimizer_step()
    else:
        _backward(eng, _mb(0))
        eng.optimizer_step()
    _backward(eng, _mb(1))
    eng.optimizer_step()
    after = _named_full(eng)
    for n, t in before.items():
        if n in adapter:
            assert not torch.equal(t, after[n]), f"adapter tensor {n} did not move"
        else:
            assert torch.equal(t, after[n]), f"base weight {n} changed"


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_saved_merged_folder_and_adapter_reproduce_the_actor(tiny_model_path, tmp_path, zero_stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eng = _engine(tiny_model_path, zero_stage)
    for seed in (0, 1):
        _backward(eng, _mb(seed))
        eng.optimizer_step()
    ids = torch.randint(10, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    eng.module.eval()
    with torch.no_grad():
        actor = eng.engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    out = tmp_path / "final_model"
    eng.save_hf(str(out))
    assert (out / "adapter" / ADAPTER_WEIGHTS).exists() and (out / "adapter" / ADAPTER_CONFIG).exists()
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32,
                                                attn_implementation="eager").eval()
    with torch.no_grad():
        got = merged(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        untrained = base(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert float((untrained - actor).abs().max()) > 1e-3  # the adapter changed the model
        torch.testing.assert_close(got, actor, rtol=0, atol=2e-5)  # W + s*B@A vs x@W + s*(x@A)@B: rounding only
        peft = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        again = peft(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(again, actor)  # the same modules and weights as the trained actor: bit-exact


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_reference_with_the_adapter_disabled_equals_a_separate_base_model(tiny_model_path, zero_stage):
    from dsrl.actor.engine import ActorEngine
    from dsrl.actor.lora import AdapterOffReference

    eng = _engine(tiny_model_path, zero_stage)
    for seed in (0, 1):
        _backward(eng, _mb(seed))
        eng.optimizer_step()
    mbs = [_mb(5), _mb(6)]
    ref = AdapterOffReference(eng)
    got = ref.score(mbs)
    adapted = eng.score(mbs)  # the adapter is back on after the context
    base = ActorEngine(str(tiny_model_path), zero_stage=0, trainable=False, micro_batch_size=4, role="ref")
    want = base.score(mbs)
    for g, w, a in zip(got, want, adapted):
        assert torch.equal(g, w)  # same microbatches and shapes; a disabled adapter runs base_layer alone
        assert float((a - w).abs().max()) > 1e-4  # the trained adapter changes the log-probs
