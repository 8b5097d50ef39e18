"""dsrl.setup_assets: model path resolution and the tiny model folder."""
import json

import pytest

from dsrl.setup_assets import (default_cache_dir, resolve_model_path, smollm2_path,
                               tiny_model_path, torch_extensions_dir)


def test_resolve_named_models(tiny_model_path, cache_dir):
    assert resolve_model_path("tiny", cache_dir) == str(tiny_model_path)
    assert resolve_model_path(str(tiny_model_path), cache_dir) == str(tiny_model_path)
    assert smollm2_path(cache_dir) == cache_dir / "models" / "SmolLM2-135M-Instruct"
    assert torch_extensions_dir(cache_dir) == cache_dir / "torch_extensions"


def test_resolve_missing_names_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path") as e:
        resolve_model_path("smollm2", tmp_path / "empty-cache")
    assert "make setup" in str(e.value)
    with pytest.raises(FileNotFoundError, match="model.path"):
        resolve_model_path("tiny", tmp_path / "empty-cache")
    with pytest.raises(FileNotFoundError, match=r"model.path=.*/no/such/model"):
        resolve_model_path(str(tmp_path / "no/such/model"), tmp_path)


def test_default_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DSRL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path.resolve()
    monkeypatch.delenv("DSRL_CACHE")
    assert default_cache_dir().name == ".cache"


def test_tiny_model_folder(tiny_model_path):
    cfg = json.loads((tiny_model_path / "config.json").read_text())
    assert cfg["vocab_size"] == 49152 and cfg["hidden_size"] == 128
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 32 and cfg["num_hidden_layers"] == 2
    assert cfg["intermediate_size"] == 256 and cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 512
    assert (tiny_model_path / "model.safetensors").is_file()


def test_tiny_model_build_is_seeded(tmp_path, cache_dir, tiny_model_path):
    import torch
    from safetensors.torch import load_file
    from dsrl.setup_assets import make_tiny_model
    a = make_tiny_model(tmp_path / "a", cache_dir, seed=0)
    b = make_tiny_model(tmp_path / "b", cache_dir, seed=1)
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in sa.values())
    k = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sa[k], sb[k])
    # Rebuilding with the same seed reproduces the cached folder.
    s0 = load_file(str(tiny_model_path / "model.safetensors"))
    assert torch.equal(sa[k], s0[k])
    # Second call on an existing folder is a no-op.
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "a", cache_dir, seed=5) == tmp_path / "a"
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_model_forward(tiny_model_path, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    ids = torch.tensor([tiny_tokenizer("What is 1 + 1?")["input_ids"]])
    with torch.no_grad():
        out = m(ids).logits
    assert out.shape == (1, ids.shape[1], 49152) and torch.isfinite(out).all()
