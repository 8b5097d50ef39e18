"""May the trainer leave zero-advantage samples out of the forward?

A sample whose advantages are all zero (e.g. a GRPO group with equal rewards) still sits in the
aggregation denominators, so leaving it out of the forward keeps the gradient exactly when its own
contribution to the loss gradient is exactly zero. That holds for the clipped policy objectives
(every term is multiplied by A), but not when anything else acts on those tokens: an entropy
bonus, a KL loss, SFT's cross-entropy, DRO's quadratic term, or a correction whose weights depend
on the whole microbatch (MIS batch-normalization). Objectives declare it
(`ObjectiveSpec.skip_zero_advantage_exact`); corrections are listed here."""
from __future__ import annotations

from typing import Tuple

from dsrl.config.schema import Config
from dsrl.loss.registry import get_objective

# Built-in corrections that multiply the per-token policy loss (zero stays zero) and mask tokens.
_EXACT_CORRECTIONS = {None, "vanilla", "icepop"}


def zero_advantage_skip(cfg: Config) -> Tuple[bool, str]:
    """(skip, reason): whether skipping all-zero-advantage samples leaves the update unchanged."""
    a = cfg.algo
    if not a.skip_zero_variance_groups:
        return False, "algo.skip_zero_variance_groups=false"
    spec = get_objective(a.policy_loss)
    blockers = []
    if not spec.skip_zero_advantage_exact:
        blockers.append(f"algo.policy_loss={a.policy_loss} has a gradient on zero-advantage samples")
    if a.entropy_coef != 0:
        blockers.append("algo.entropy_coef != 0 (the entropy bonus acts on every token)")
    if a.use_kl_loss:
        blockers.append("algo.use_kl_loss (the KL loss acts on every token)")
    if a.use_tis and a.tis_function not in _EXACT_CORRECTIONS:
        if a.tis_function == "mis":
            if a.mis_batch_normalize:
                blockers.append("algo.mis_batch_normalize (MIS weights are normalized over the microbatch)")
        else:
            blockers.append(f"algo.tis_function={a.tis_function} (a user correction may act on zero-loss tokens)")
    if blockers:
        return False, "zero-advantage samples are trained: " + "; ".join(blockers)
    return True, "zero-advantage samples are skipped in the forward (exact: their gradient is zero)"
