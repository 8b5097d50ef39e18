"""Where tensors live on their way into and out of the DeepSpeed engine.

The trainer builds microbatches as host (CPU) tensors; DeepSpeed never moves inputs, so under
CUDA a host batch would reach a GPU model and fail. `to_device` is the one place a microbatch is
moved to the engine's device (`engine.device`, which DeepSpeed sets from its accelerator API:
cuda:LOCAL_RANK on CUDA, cpu on CPU); `to_host` is the one place results the trainer keeps
(scored log-probs) come back. On CPU both are identity moves (no copy)."""
from __future__ import annotations

from typing import Any, Mapping

import torch


def to_device(mb: Mapping[str, Any], device) -> dict:
    """A copy of microbatch `mb` with every tensor (also inside lists/tuples) on `device`.
    Pinned host tensors are copied non-blocking (the copy overlaps the next kernel launch;
    CUDA orders it before any use on the same stream); ints, strings and other values pass
    untouched. Tensors already on `device` are returned as they are."""
    device = torch.device(device)
    return {k: _move(v, device) for k, v in mb.items()}


def to_host(value):
    """`value` (a tensor, or a list/tuple/dict of them) on the CPU; CPU tensors unchanged."""
    return _move(value, torch.device("cpu"))


def _move(value, device: torch.device):
    if torch.is_tensor(value):
        if value.device == device:
            return value
        non_blocking = value.device.type == "cpu" and device.type != "cpu" and value.is_pinned()
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, list):
        return [_move(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value
