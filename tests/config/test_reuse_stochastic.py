"""Log-prob reuse is fail-closed on anything stochastic in the model: config fields and modules
named like dropout / jitter / noise with a non-zero value block it by name (`on` raises before
training, `auto` falls back and says why), dsrl's two dropout knobs change nothing else on the
HF config, and the runtime guards raise a named error that survives `python -O`."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config, LlamaConfig, MixtralConfig

from dsrl.actor.stochastic import (apply_dropout_knobs, is_stochastic_name, stochastic_config_fields,
                                   stochastic_modules)
from dsrl.config.schema import Config
from dsrl.errors import ConfigError, ReuseInvariantError
from dsrl.testing import subprocess_env
from dsrl.validation.reuse import (ReuseDecision, check_reuse_invariants, decide_reuse, reuse_for_model,
                                   reuse_for_model_config)

GPT2_DROPS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "summary_first_dropout")


def make(reuse="on", **algo):
    cfg = Config()
    cfg.algo = dataclasses.replace(cfg.algo, reuse_logprobs=reuse, **algo)
    return cfg


def gpt2_config(**drops):
    values = {k: 0.0 for k in GPT2_DROPS}
    values.update(drops)
    return GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32, **values)


def tiny_mixtral(jitter):
    return MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                         num_experts_per_tok=1, max_position_embeddings=32, router_jitter_noise=jitter)


def tiny_llama():
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


# ------------------------------------------------------------------ the naming rule
@pytest.mark.parametrize("name,stochastic", [
    ("attn_pdrop", True), ("activation_dropout", True), ("classifier_dropout", True), ("layerdrop", True),
    ("drop_path_rate", True), ("router_jitter_noise", True), ("noise_std", True),
    ("hidden_size", False), ("rms_norm_eps", False), ("router_aux_loss_coef", False), ("initializer_range", False),
])
def test_naming_rule(name, stochastic):
    assert is_stochastic_name(name) is stochastic


def test_false_positives_are_not_blockers():
    """Zero, None and bools never block, whatever the name; a non-zero number or a list holding
    one does, including inside nested sub-configs and dicts (dotted names)."""
    c = tiny_llama()
    c.use_noise_free_x = False
    c.use_noise = True
    c.dropout = 0.0
    c.classifier_dropout = None
    c.noise_schedule = "linear"
    assert stochastic_config_fields(c) == []
    c.layer_drops = [0.0, 0.2]
    c.text_config = gpt2_config(resid_pdrop=0.3)
    c.extra = {"attn_config": {"attn_pdrop": 0.25, "clip_qkv": 8}}
    assert stochastic_config_fields(c) == ["layer_drops=[0.0, 0.2]", "text_config.resid_pdrop=0.3",
                                           "extra.attn_config.attn_pdrop=0.25"]


# ------------------------------------------------------------------ GPT-2-style model
def test_gpt2_config_fields_and_modules_are_named():
    cfg = gpt2_config(attn_pdrop=0.1)
    assert stochastic_config_fields(cfg) == ["attn_pdrop=0.1"]
    model = AutoModelForCausalLM.from_config(cfg)
    found = stochastic_modules(model)
    assert found == ["transformer.h.0.attn.attn_dropout (Dropout p=0.1)"]


def test_gpt2_all_drops_named_in_config_and_modules():
    cfg = gpt2_config(attn_pdrop=0.1, resid_pdrop=0.2, embd_pdrop=0.3, summary_first_dropout=0.4)
    assert stochastic_config_fields(cfg) == ["resid_pdrop=0.2", "embd_pdrop=0.3", "attn_pdrop=0.1",
                                             "summary_first_dropout=0.4"]
    found = stochastic_modules(AutoModelForCausalLM.from_config(cfg))
    assert found == ["transformer.drop (Dropout p=0.3)",
                     "transformer.h.0.attn.attn_dropout (Dropout p=0.1)",
                     "transformer.h.0.attn.resid_dropout (Dropout p=0.2)",
                     "transformer.h.0.mlp.dropout (Dropout p=0.2)"]


def test_gpt2_with_all_drops_zero_is_clean():
    cfg = gpt2_config()
    assert stochastic_config_fields(cfg) == []
    assert stochastic_modules(AutoModelForCausalLM.from_config(cfg)) == []


def test_gpt2_defaults_are_not_reuse_safe():
    """GPT-2's stock config keeps four dropouts at 0.1: every one is named (none is overridden)."""
    assert sorted(stochastic_config_fields(GPT2Config())) == sorted(f"{k}=0.1" for k in GPT2_DROPS)


# ------------------------------------------------------------------ MoE with router jitter
def test_moe_router_jitter_is_named():
    cfg = tiny_mixtral(jitter=0.1)
    assert stochastic_config_fields(cfg) == ["router_jitter_noise=0.1"]
    found = stochastic_modules(AutoModelForCausalLM.from_config(cfg))
    assert found == ["model.layers.0.mlp (MixtralSparseMoeBlock jitter_noise=0.1)"]
    clean = tiny_mixtral(jitter=0.0)
    assert stochastic_config_fields(clean) == []
    assert stochastic_modules(AutoModelForCausalLM.from_config(clean)) == []


def test_jitter_makes_train_and_eval_forwards_differ_and_clean_model_does_not():
    """Why the jitter must block: with it the train-mode forward (the reused log-probs) differs
    from the eval-mode old pass; without it the two are bit-identical."""
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    for jitter, equal in ((0.1, False), (0.0, True)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_mixtral(jitter))
        model.eval()
        with torch.no_grad():
            old = model(input_ids=ids).logits
            model.train()
            train = model(input_ids=ids).logits
        assert torch.equal(old, train) is equal  # same ids and shapes: only the module mode differs


# ------------------------------------------------------------------ the decision, points 2 and 3
def test_on_fails_naming_the_model_config_field(tmp_path):
    gpt2_config(attn_pdrop=0.1).save_pretrained(tmp_path)
    cfg = make("on")
    with pytest.raises(ConfigError) as e:
        reuse_for_model_config(decide_reuse(cfg), cfg, str(tmp_path))
    assert "model config attn_pdrop=0.1" in str(e.value)
    assert str(tmp_path / "config.json") in str(e.value)


def test_auto_falls_back_naming_the_model_config_field(tmp_path):
    gpt2_config(resid_pdrop=0.1).save_pretrained(tmp_path)
    cfg = make("auto")
    before = decide_reuse(cfg)
    assert before.reuse
    d = reuse_for_model_config(before, cfg, str(tmp_path))
    assert not d.reuse and d.run_old_pass
    assert "model config resid_pdrop=0.1" in d.reason and "auto" in d.reason


def test_clean_model_config_keeps_reuse(tmp_path):
    gpt2_config().save_pretrained(tmp_path)
    for mode in ("on", "auto"):
        d0 = decide_reuse(make(mode))
        assert reuse_for_model_config(d0, make(mode), str(tmp_path)) == d0


def test_moe_jitter_blocks_at_both_points(tmp_path):
    mcfg = tiny_mixtral(jitter=0.1)
    mcfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model config router_jitter_noise=0.1"):
        reuse_for_model_config(decide_reuse(make("on")), make("on"), str(tmp_path))
    model = AutoModelForCausalLM.from_config(mcfg)
    with pytest.raises(ConfigError, match=r"model module model\.layers\.0\.mlp \(MixtralSparseMoeBlock jitter_noise=0\.1\)"):
        reuse_for_model(decide_reuse(make("on")), make("on"), model)
    d = reuse_for_model(decide_reuse(make("auto")), make("auto"), model)
    assert not d.reuse and d.run_old_pass and "jitter_noise=0.1" in d.reason


def test_module_only_dropout_is_caught_after_the_model_is_built(tmp_path):
    """Config clean, but a Dropout(p=0.2) added to the built model: point 2 passes, point 3
    names the module (`on` raises, `auto` falls back)."""
    lcfg = tiny_llama()
    lcfg.save_pretrained(tmp_path)
    d_on = reuse_for_model_config(decide_reuse(make("on")), make("on"), str(tmp_path))
    d_auto = reuse_for_model_config(decide_reuse(make("auto")), make("auto"), str(tmp_path))
    assert d_on.reuse and d_auto.reuse
    model = AutoModelForCausalLM.from_config(lcfg)
    assert reuse_for_model(d_on, make("on"), model) == d_on  # the stock tiny Llama is clean
    model.model.layers[0].extra_drop = torch.nn.Dropout(p=0.2)
    with pytest.raises(ConfigError) as e:
        reuse_for_model(d_on, make("on"), model)
    assert "model module model.layers.0.extra_drop (Dropout p=0.2)" in str(e.value)
    d = reuse_for_model(d_auto, make("auto"), model)
    assert not d.reuse and d.run_old_pass and "model.layers.0.extra_drop (Dropout p=0.2)" in d.reason


def test_model_blockers_leave_off_and_fallback_decisions_alone():
    model = AutoModelForCausalLM.from_config(gpt2_config(attn_pdrop=0.1))
    for cfg in (make("off"), make("auto", num_steps_per_rollout=2)):
        d = decide_reuse(cfg)
        assert not d.reuse
        assert reuse_for_model(d, cfg, model) is d


# ------------------------------------------------------------------ dsrl's two dropout knobs
def test_knobs_set_only_their_own_fields():
    """model.attention_dropout / model.hidden_dropout land on the HF fields of the same name;
    every other field (the model's own dropouts included) is left exactly as it was."""
    hf = FalconConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
    before = hf.to_dict()
    applied = apply_dropout_knobs(hf, attention_dropout=0.25, hidden_dropout=0.5)
    assert applied == ["attention_dropout=0.25", "hidden_dropout=0.5"]
    after = hf.to_dict()
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"attention_dropout", "hidden_dropout"}
    assert after["attention_dropout"] == 0.25 and after["hidden_dropout"] == 0.5

    g = gpt2_config(attn_pdrop=0.1, resid_pdrop=0.2)
    before = g.to_dict()
    assert apply_dropout_knobs(g, attention_dropout=0.0, hidden_dropout=0.0) == []
    assert g.to_dict() == before  # the fixed list (resid_pdrop, embd_pdrop, dropout) is gone


def test_knobs_reach_nested_sub_configs():
    hf = tiny_llama()
    hf.text_config = tiny_llama()
    assert apply_dropout_knobs(hf, attention_dropout=0.1, hidden_dropout=0.0) == [
        "attention_dropout=0.1", "text_config.attention_dropout=0.1"]
    assert stochastic_config_fields(hf) == ["attention_dropout=0.1", "text_config.attention_dropout=0.1"]


def test_knob_the_model_lacks_is_an_error_not_a_no_op(tmp_path):
    with pytest.raises(ConfigError, match="model.hidden_dropout=0.1.*no field 'hidden_dropout'"):
        apply_dropout_knobs(tiny_llama(), attention_dropout=0.0, hidden_dropout=0.1)
    tiny_llama().save_pretrained(tmp_path)
    cfg = make("off")
    cfg.model = dataclasses.replace(cfg.model, hidden_dropout=0.1)
    with pytest.raises(ConfigError, match="model.hidden_dropout"):
        reuse_for_model_config(decide_reuse(cfg), cfg, str(tmp_path))  # before any model loads


def test_knob_dropout_on_a_model_is_seen_by_the_module_scan(tmp_path):
    hf = tiny_llama()
    apply_dropout_knobs(hf, attention_dropout=0.3, hidden_dropout=0.0)
    found = stochastic_modules(AutoModelForCausalLM.from_config(hf))
    assert found == ["model.layers.0.self_attn (LlamaAttention attention_dropout=0.3)"]


# ------------------------------------------------------------------ runtime guards
def test_runtime_guards_raise_named_errors():
    assert issubclass(ReuseInvariantError, RuntimeError) and not issubclass(ReuseInvariantError, AssertionError)
    on = ReuseDecision(True, "x", run_old_pass=False)
    check_reuse_invariants(on, steps_per_rollout=1, batch_keys=["rewards", "rollout_log_probs"])
    with pytest.raises(ReuseInvariantError, match="exactly 1 optimizer step per rollout, got steps_per_rollout=2"):
        check_reuse_invariants(on, steps_per_rollout=2, batch_keys=[])
    with pytest.raises(ReuseInvariantError, match="without actor log-probs.*'old_log_probs'"):
        check_reuse_invariants(on, steps_per_rollout=1, batch_keys={"old_log_probs": 0}.keys())
    with pytest.raises(ReuseInvariantError, match="run_old_pass=True"):
        check_reuse_invariants(ReuseDecision(True, "x", run_old_pass=True), steps_per_rollout=1, batch_keys=[])
    off = ReuseDecision(False, "x", run_old_pass=True)
    check_reuse_invariants(off, steps_per_rollout=4, batch_keys=["old_log_probs"])  # no reuse: nothing to guard


def test_runtime_guard_survives_python_O():
    script = ("from dsrl.validation.reuse import ReuseDecision, check_reuse_invariants\n"
              "from dsrl.errors import ReuseInvariantError\n"
              "assert False, 'asserts are live'\n")
    r = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 0, r.stderr  # -O really drops asserts
    script = ("import sys\n"
              "from dsrl.validation.reuse import ReuseDecision, check_reuse_invariants\n"
              "from dsrl.errors import ReuseInvariantError\n"
              "try:\n"
              "    check_reuse_invariants(ReuseDecision(True, 'x', False), steps_per_rollout=3, batch_keys=[])\n"
              "except ReuseInvariantError as e:\n"
              "    print('raised:', e)\n"
              "    sys.exit(0)\n"
              "sys.exit(1)\n")
    r = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "raised: reuse_logprobs requires exactly 1 optimizer step" in r.stdout


# ------------------------------------------------------------------ the real CLI
def _cli(tmp_path, tag, *overrides):
    env = subprocess_env(HYDRA_FULL_ERROR="0")
    r = subprocess.run([sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", *overrides,
                        f"hydra.run.dir={tmp_path / tag}"], capture_output=True, text=True, env=env, timeout=180)
    return r, r.stdout + r.stderr


@pytest.mark.slow
def test_cli_fails_before_any_model_loads_on_stochastic_model(tmp_path):
    """`+exp=grpo_reuse` (reuse on) with a dsrl dropout knob, or with a model folder whose
    config.json keeps GPT-2 dropout: exit 2 naming the culprit, before any model, tokenizer or
    engine loads. The model folder holds only config.json: reaching any load would fail differently."""
    model_dir = tmp_path / "gpt2_dropout"
    gpt2_config(attn_pdrop=0.1).save_pretrained(model_dir)
    assert os.listdir(model_dir) == ["config.json"]
    cases = (("knob", ("model.hidden_dropout=0.1",), "model.hidden_dropout"),
             ("config", (f"model.path={model_dir}",), "model config attn_pdrop=0.1"))
    for tag, overrides, culprit in cases:
        r, out = _cli(tmp_path, tag, *overrides)
        assert r.returncode == 2, out
        assert culprit in out, out
        assert "Loading weights" not in out and "deepspeed" not in out.lower(), out
        assert not (tmp_path / tag / "metrics.jsonl").exists()
