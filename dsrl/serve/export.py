"""Sampler checkpoints: full (merged) weights as an HF folder that vLLM reloads in place and that
``transformers`` loads directly.

The head is always written as its own tensor with ``tie_word_embeddings: false``: a LoRA on the
unembedding (or full-parameter training of a tied model, whose head equals the embedding only
at the start) leaves head and embedding different, and a tied vLLM engine would ignore the
head. The sampler's vLLM engine is therefore started from an untied copy of the base model."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import torch

WEIGHTS_FILE = "model.safetensors"


def with_head(state: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    """``state`` (HF names) with ``lm_head.weight`` present: a tied model's export omits it."""
    if "lm_head.weight" not in state and getattr(hf_config, "tie_word_embeddings", False):
        emb = next((v for k, v in state.items() if k.endswith("embed_tokens.weight")), None)
        if emb is None:
            raise ValueError("tied model without an embed_tokens weight: cannot write its head")
        state = dict(state)
        state["lm_head.weight"] = emb.clone()
    return state


def untied_config(hf_config):
    cfg = hf_config.__class__.from_dict(hf_config.to_dict())
    cfg.tie_word_embeddings = False
    if hasattr(cfg, "get_text_config"):
        cfg.get_text_config().tie_word_embeddings = False
    return cfg


def write_hf_folder(folder: "str | os.PathLike[str]", state: Dict[str, torch.Tensor], hf_config,
                    tokenizer_dir: "str | None" = None) -> Path:
    """config.json (untied) + model.safetensors (+ the tokenizer files of ``tokenizer_dir``)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = with_head(state, hf_config)
    untied_config(hf_config).save_pretrained(str(folder))
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(folder))
    return folder
