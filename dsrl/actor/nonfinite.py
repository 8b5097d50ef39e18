"""Non-finite training steps: find them, drop them, stop after too many in a row.

DeepSpeed checks for overflow only where fp16 loss scaling needs it (plus, in some versions and
stages, an invalid gradient norm); a NaN loss whose gradient happens to be finite, or ZeRO-0 with
a plain torch optimizer, steps regardless. dsrl decides itself, before `engine.step()`: the step
is skipped when any rank saw a non-finite loss or holds a non-finite gradient (one all-reduce,
so every rank skips together). Skipping means no optimizer step at all -- weights and optimizer
state (moments, step count) stay bit-identical -- and discarding the accumulated gradients where
the engine keeps them, exactly as DeepSpeed's own overflow branch of each optimizer's step()
does (deepspeed 0.19.8), so the next step starts clean."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class TrainingDiverged(RuntimeError):
    """`max_skipped_steps` optimizer steps in a row were non-finite. The weights and optimizer
    state are those of the last good step (skipped steps leave them untouched), so a checkpoint
    written now is the last good state. `step` is the RL step that raised (None outside the loop)."""

    def __init__(self, step: Optional[int], consecutive: int, total: int):
        where = f"at step {step}" if step is not None else "outside the RL loop"
        super().__init__(f"training diverged {where}: {consecutive} optimizer steps in a row had a non-finite "
                         f"loss or gradient and were skipped (trainer.max_skipped_steps={consecutive}; "
                         f"{total} skipped in this run)")
        self.step, self.consecutive, self.total = step, consecutive, total


class SkipCounter:
    """Counts skipped optimizer steps (`total`, cumulative, for `train/skipped_steps`) and the
    current run of consecutive ones; raises TrainingDiverged when that run reaches `limit`."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"trainer.max_skipped_steps={limit} must be >= 1")
        self.limit = int(limit)
        self.total = 0
        self.consecutive = 0

    def record(self, skipped: bool, step: Optional[int] = None) -> None:
        """Count one optimizer step of RL step `step` (None outside the loop; named in the error)."""
        if not skipped:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        if self.consecutive >= self.limit:
            raise TrainingDiverged(step, self.consecutive, self.total)

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.consecutive = int(state["total"]), int(state["consecutive"])


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (collective)."""
    from dsrl.distributed.collectives import all_reduce_

    t = all_reduce_(torch.tensor([1.0 if flag else 0.0], dtype=torch.float64), op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _fp32_copies(opt) -> Optional[list]:
    """A ZeRO-0 BF16_Optimizer's fp32 gradient accumulators, None for any other optimizer."""
    hp = getattr(opt, "fp32_groups_gradients_flat", None)
    return None if hp is None else list(hp)


def _module_grads(ds_engine) -> list:
    """The gradients on the engine's module parameters (ZeRO-0 keeps them there)."""
    return [p.grad for p in ds_engine.module.parameters() if p.grad is not None]


def _held_gradients(ds_engine) -> list:
    """The gradient tensors this rank holds after the accumulation boundary, where the engine's
    ZeRO stage keeps them: ZeRO-0 `param.grad` (bf16: BF16_Optimizer's fp32 copies), ZeRO-1/2/3
    this rank's partition (`averaged_gradients`)."""
    opt = ds_engine.optimizer
    if ds_engine.zero_optimization_stage() == 0:
        hp = _fp32_copies(opt)
        return hp if hp is not None else _module_grads(ds_engine)
    out = []
    for grads in getattr(opt, "averaged_gradients", {}).values():
        if torch.is_tensor(grads):
            out.append(grads)
        else:
            out.extend(g for g in (grads or []) if g is not None)
    return out


def fp32_grad_norm(grads: list) -> torch.Tensor:
    """The global L2 norm of `grads` (tensors of one dtype), accumulated in float32 in one pass:
    bf16 gradients are read as they are, with no float32 copy of them (540 MB for SmolLM2). Equal
    bit for bit to torch.nn.utils.get_total_norm over `[g.float() for g in grads]`, the norm dsrl
    logged before (tests/actor/test_optim.py)."""
    if not grads:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)), 2)


def grads_finite(grads: list, norm: Optional[torch.Tensor] = None) -> bool:
    """Every element of `grads` is finite. One fused pass first (or `norm`, their L2 norm, when the
    caller has it): a NaN or inf element makes the L2 norm NaN or inf, so a finite norm proves
    every element finite (0.025 s for SmolLM2's 135M fp32 gradients here, against 0.25 s for an
    isfinite pass per tensor). Only a non-finite norm, which may also be an overflow of the
    squares of finite elements, is settled element by element."""
    if not grads:
        return True
    if norm is None:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if bool(torch.isfinite(norm)):
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def local_grads_finite(ds_engine) -> bool:
    """Every gradient element this rank holds is finite (no collective)."""
    return grads_finite(_held_gradients(ds_engine))


def discard_gradients(ds_engine) -> None:
    """Drop the accumulated gradients without stepping, leaving the engine ready for the next
    step: what DeepSpeed's overflow branch of the optimizer's step() clears."""
    opt = ds_engine.optimizer
    stage = ds_engine.zero_optimization_stage()
    if stage == 0:
        if hasattr(opt, "clear_hp_grads"):  # BF16_Optimizer: fp32 accumulators + bf16 grads
            opt.clear_hp_grads()
            opt.clear_lp_grads(set_to_none=True)
        else:
            opt.zero_grad(set_to_none=True)
        ds_engine.zero_grad()
    elif stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        opt.micro_step_id = INITIAL_MICRO_STEP_ID
        opt.zero_grad(set_to_none=True)
        release = getattr(opt, "_release_preflattened_grad_buffers", None)
        if release is not None:
            release()
        for k in list(opt.averaged_gradients.keys()):
            opt.averaged_gradients[k] = None
            opt.all_grad_tensors[k] = None
    else:
        opt.zero_grad(set_to_none=True)  # also restarts its micro-step count
        opt.averaged_gradients = {}


def guarded_step(ds_engine, zero_stage: int, bad_loss: bool) -> "tuple[float, bool]":
    """The optimizer step of a DeepSpeed engine whose gradients are accumulated, or none when any
    rank saw a non-finite loss (`bad_loss` on this rank) or holds a non-finite gradient: then the
    gradients are discarded and weights and optimizer state stay as they are. Returns (global
    gradient norm before clipping, NaN when skipped or unknown; skipped). Collective."""
    ds_engine.set_gradient_accumulation_boundary(True)
    pre_norm = None
    if zero_stage == 0:  # DeepSpeed records the norm only for ZeRO optimizers
        module_grads = _module_grads(ds_engine)
        pre_norm = fp32_grad_norm(module_grads)
        hp = _fp32_copies(ds_engine.optimizer)  # a BF16_Optimizer holds them; else the module's are held
        finite = grads_finite(hp) if hp is not None else grads_finite(module_grads, pre_norm)
    else:
        finite = local_grads_finite(ds_engine)
    if any_rank(bad_loss or not finite):
        discard_gradients(ds_engine)
        return float("nan"), True
    ds_engine.step()
    norm = pre_norm if pre_norm is not None else ds_engine.get_global_grad_norm()
    if norm is None:
        return float("nan"), False
    return float(norm.item() if torch.is_tensor(norm) else norm), False
