"""Functions that run INSIDE a vLLM worker process (sent through `llm.collective_rpc`, which
passes the worker as the first argument): load one weight bucket per call.

Why not `worker.reload_weights(weights_iterator=bucket)` per bucket: in vLLM 0.32 (checked in
`model_executor/model_loader/reload/{inplace,layerwise}.py`) each reload_weights call is a whole
layerwise-reload session: `initialize_layerwise_reload` moves EVERY layer onto the meta device,
`model.load_weights` buffers the given tensors per layer, and `finalize_layerwise_reload` puts the
old kernel tensors back for layers that got nothing ("Failed to load weights" warning), but a
layer that got only part of its weights (q_proj without k_proj/v_proj of a fused qkv_proj, split
across two buckets) is processed with the missing part uninitialised. So a partial iterator is
only safe when buckets never split a layer. Instead a sync is ONE session spread over the bucket
calls: the first call opens it (initialize_layerwise_reload), every call runs `model.load_weights`
on its bucket (HF names; vLLM fuses qkv/gate_up and repacks for the CPU kernels once a layer is
complete), the last call closes it (finalize_layerwise_reload), re-ties the head and drops the
runner's derived caches, exactly as `reload_weights` does in one call. vLLM's loaders keep views
of a bucket until every layer with a tensor in it is complete; those views keep the buffer alive,
and nothing here holds it longer, so a bucket is released as soon as its layers are loaded (the
CUDA IPC path's memory bound, dsrl.rollout.cuda_ipc). While a session is open the model cannot
run: a sync is never interleaved with generation (the caller does both from one thread)."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from dsrl.rollout.buckets import TensorMeta, unpack_buffer


MetaTuple = Tuple[str, str, Tuple[int, ...], int, int]  # TensorMeta as plain data (msgpack-able)


def meta_tuples(metas: Sequence[TensorMeta]) -> List[MetaTuple]:
    return [(m.name, m.dtype, tuple(m.shape), m.offset, m.nbytes) for m in metas]


def metas_from_tuples(rows: Sequence[MetaTuple]) -> List[TensorMeta]:
    return [TensorMeta(str(n), str(d), tuple(int(x) for x in s), int(o), int(b)) for n, d, s, o, b in rows]


def retie_head(model) -> int:
    """A tied `lm_head` is not in the pushed weights, and on CPU the head computes logits from a
    copy prepacked at load time: copy the new embedding into it and re-run its post-load
    processing (which repacks it). Returns 1 if re-tied."""
    head = getattr(model, "lm_head", None)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if head is None or not tied:
        return 0
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        if head.weight is not emb:
            head.weight.data.copy_(emb.data)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
    return 1


def load_bucket(worker, data: torch.Tensor, metas: Sequence[TensorMeta], first: bool, last: bool) -> int:
    """Load one bucket (a uint8 buffer in this process) into the worker's model, inside the sync's
    layerwise-reload session (`first` opens it, `last` closes it: `finish_reload`); returns the
    number of tensors loaded."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        if first:
            initialize_layerwise_reload(model)
        model.load_weights(iter(unpack_buffer(data, metas)))
    if last:
        finish_reload(worker)
    return len(metas)


def finish_reload(worker) -> int:
    """Close the sync's layerwise-reload session (after its last bucket): layers that got nothing
    keep their old tensors, the tied head is re-tied, the runner's derived caches are dropped.
    Also a collective_rpc target of its own (a sync loaded bucket by bucket closes it after the
    last one). Returns 1 if the head was re-tied."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        tied = retie_head(model)
        runner = worker.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, reset, None)
            if fn is not None:
                fn()
    return tied


def load_shm_bucket(worker, path: str, rows: Sequence[MetaTuple], first: bool, last: bool) -> int:
    """collective_rpc target: map the bucket's shared-memory file (no copy) and load it."""
    metas = metas_from_tuples(rows)
    nbytes = max((m.offset + m.nbytes for m in metas), default=0)
    data = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return load_bucket(worker, data, metas, first, last)

