"""The one writer of transformers-loadable model folders (config.json, model.safetensors, the
tokenizer files), used by the trainer's final export and checkpoints (`ActorEngine.save_hf`),
the Tinker service's sampler checkpoints and untied sampler base (dsrl.serve), and set-up's
model conversion (dsrl.setup_assets).

Untied folders (``untie=True``): the head is written as its own tensor with
``tie_word_embeddings: false``. A LoRA on the unembedding (or full-parameter training of a
tied model, whose head equals the embedding only at the start) leaves head and embedding
different, and a tied vLLM engine would ignore the head; the service's sampler therefore starts
from an untied copy of the base model and reloads untied sampler checkpoints in place.

Kept free of other dsrl imports (and of torch at import time): every layer may write a folder."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, Mapping, Union

if TYPE_CHECKING:  # torch and transformers load only when a folder is written
    import torch

WEIGHTS_FILE = "model.safetensors"
PathLike = Union[str, "os.PathLike[str]"]


def is_hf_folder(path: Path) -> bool:
    """A complete folder: config, safetensors weights and a tokenizer."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) \
        and (path / "tokenizer_config.json").is_file()


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


@contextlib.contextmanager
def atomic_folder(final: PathLike) -> Iterator[Path]:
    """A fresh temporary sibling of ``final`` to fill; renamed to ``final`` when the block ends
    without an error (files made readable by all: safetensors writes 0600 files, and other users
    and processes read these), removed in any case. If another process renamed its own complete
    folder into place first, theirs is kept."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_hf_folder(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_hf_folder(folder: PathLike, weights, hf_config=None, *, untie: bool = False, generation_config=None,
                    tokenizer=None, atomic: bool = False) -> Path:
    """Write a transformers-loadable folder and return its path.

    ``weights``: HF-named tensors (a mapping), written with ``hf_config`` as config.json +
    model.safetensors (+ ``generation_config``'s generation_config.json); ``untie``: the head
    written as its own tensor and the config untied (module docstring). Or a transformers model,
    which writes its own config, generation config and weights (``save_pretrained``).
    ``tokenizer``: a tokenizer, or the folder to load one from, whose files are copied in.
    ``atomic``: filled under a temporary name and renamed into place (`atomic_folder`)."""
    if atomic:
        with atomic_folder(folder) as tmp:
            write_hf_folder(tmp, weights, hf_config, untie=untie, generation_config=generation_config,
                            tokenizer=tokenizer)
        return Path(folder)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(weights, Mapping):
        from safetensors.torch import save_file

        state = with_head(weights, hf_config) if untie else weights
        (untied_config(hf_config) if untie else hf_config).save_pretrained(str(folder))
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(folder / WEIGHTS_FILE),
                  metadata={"format": "pt"})
        if generation_config is not None:
            generation_config.save_pretrained(str(folder))
    else:
        weights.save_pretrained(str(folder), safe_serialization=True)
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder
