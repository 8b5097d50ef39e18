"""On-policy distillation (OPD): fold the student→teacher reverse KL into the advantages.

A_t ← A_t − opd_kl_coef · (student_old_t − teacher_t). Student and teacher scores are fixed
inputs: both are detached here too (a direct caller may bypass `compute_advantages`), and the
teacher scores are written back detached on their original device. A precomputed per-token reverse
KL in `rollout_data["opd_reverse_kl"]` (e.g. top-k OPD scored by the rollout engine) is used
instead of teacher log-probs. Shapes are checked per sample: a scalar or broadcastable advantage
would silently apply one sample's KL to the wrong tokens.
"""
from __future__ import annotations

from typing import Any, MutableMapping, Optional, Sequence, Union

import torch

from dsrl.loss.options import opt

Rows = Union[torch.Tensor, Sequence[torch.Tensor]]


def _rows(x: Rows) -> list:
    return list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)


def _like(rows: list, template: Rows) -> Rows:
    return torch.stack(rows) if isinstance(template, torch.Tensor) else rows


def apply_opd_kl_to_advantages(config: Any, rollout_data: MutableMapping[str, Any], advantages: Rows,
                               student_log_probs: Optional[Rows]) -> Rows:
    """Return OPD-adjusted advantages (a list is also updated in place) and store the reverse KL
    used, detached, in `rollout_data["opd_reverse_kl"]`. No-op when `student_log_probs` is None."""
    if student_log_probs is None:
        return advantages
    coef = float(opt(config, "opd_kl_coef"))
    advs = _rows(advantages)
    precomputed = rollout_data.get("opd_reverse_kl")
    rkls = []
    if precomputed is not None:
        pre = _rows(precomputed)
        if len(pre) != len(advs):
            raise ValueError(f"OPD length mismatch: {len(pre)} precomputed opd_reverse_kl vs {len(advs)} advantages")
        for i, adv in enumerate(advs):
            r = pre[i] if torch.is_tensor(pre[i]) else torch.tensor(pre[i], dtype=torch.float32)
            r = r.detach().to(device=adv.device)
            if r.shape != adv.shape:
                raise ValueError(f"OPD shape mismatch: sample {i} opd_reverse_kl {tuple(r.shape)} vs "
                                 f"advantage {tuple(adv.shape)}")
            rkls.append(r)
    else:
        teacher = rollout_data.get("teacher_log_probs")
        if teacher is None:
            raise ValueError("OPD requires teacher_log_probs (or a precomputed opd_reverse_kl), "
                             "but rollout_data has neither")
        teacher_rows = [t.detach() for t in _rows(teacher)]
        rollout_data["teacher_log_probs"] = _like(teacher_rows, teacher)
        student_rows = _rows(student_log_probs)
        if not len(advs) == len(student_rows) == len(teacher_rows):
            raise ValueError(f"OPD length mismatch: {len(advs)} advantages, {len(student_rows)} student "
                             f"and {len(teacher_rows)} teacher log-prob rows")
        for i, adv in enumerate(advs):
            s = student_rows[i].detach()
            t = teacher_rows[i].to(device=s.device)
            if s.shape != t.shape:
                raise ValueError(f"OPD shape mismatch: sample {i} student {tuple(s.shape)} vs teacher {tuple(t.shape)}")
            if adv.shape != s.shape:
                raise ValueError(f"OPD shape mismatch: sample {i} advantage {tuple(adv.shape)} vs student "
                                 f"{tuple(s.shape)}; OPD expects per-token advantages")
            rkls.append(s - t)
    new = [adv - coef * r.to(adv.dtype) for adv, r in zip(advs, rkls)]
    rollout_data["opd_reverse_kl"] = _like(rkls, advantages)
    if isinstance(advantages, list):
        advantages[:] = new
        return advantages
    return _like(new, advantages)
