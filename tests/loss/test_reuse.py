"""Training log-prob reuse: using the detached training log-probs as the old policy must give
bit-identical loss, gradient and metrics to an explicit old-policy pass that computed the same
numbers (semantics §3.3 test 1-3)."""
import pytest
import torch

from dsrl.loss.objectives import cispo, gspo, ppo
from dsrl.loss.types import Aggregator, LossInputs

from ._helpers import policy_problem, score

CASES = {
    "ppo(grpo)": (ppo, {}),
    "gspo": (gspo, {}),
    "ppo+tis": (ppo, {"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.5}),
    "cispo": (cispo, {}),
}


def _run(objective, config, logits0, targets, mask, adv, rollout_fn, reuse):
    logits = logits0.clone().requires_grad_(True)
    lp, ent = score(logits, targets)
    batch = {"advantages": adv}
    if rollout_fn is not None:
        batch["rollout_log_probs"] = rollout_fn(lp.detach())
    if not reuse and not config.get("use_rollout_logprobs"):
        batch["old_log_probs"] = lp.detach()
    agg = Aggregator.build("token-mean", mask, global_tokens=float(mask.sum()))
    out = objective(LossInputs(log_probs=lp, mask=mask, batch=batch, config=config, reduce=agg,
                               entropy=ent, reuse_training_logprobs=reuse))
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("case", list(CASES))
def test_reuse_is_bit_identical_to_explicit_detached_baseline(case):
    objective, config = CASES[case]
    logits, targets, mask, adv, noise = policy_problem(1234)
    rollout_fn = (lambda lp: lp + noise) if config.get("use_tis") else None
    a, grad_a = _run(objective, config, logits, targets, mask, adv, rollout_fn, reuse=True)
    b, grad_b = _run(objective, config, logits, targets, mask, adv, rollout_fn, reuse=False)
    assert torch.equal(a.loss, b.loss)
    assert torch.equal(grad_a, grad_b)
    assert grad_a.abs().sum() > 0
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        assert torch.equal(a.metrics[key], b.metrics[key]), key
    assert {"loss", "pg_loss", "entropy", "logprob"} <= a.metrics.keys()
    if config.get("use_tis"):
        assert {"tis", "tis_clipfrac", "tis_abs", "ois", "train_rollout_logprob_abs_diff",
                "train_rollout_kl"} <= a.metrics.keys()
        assert a.metrics["tis_clipfrac"].item() > 0  # the noise pushes some ratios out of [0.5, 1.5]


def test_use_rollout_logprobs_keeps_rollout_as_old_policy_under_reuse():
    logits, targets, mask, adv, _ = policy_problem(17, B=2, T=9, V=16, starts=(4, 5), lengths=(3, 4))
    config = {"use_rollout_logprobs": True}
    shift = lambda lp: lp + 0.25  # noqa: E731
    a, grad_a = _run(ppo, config, logits, targets, mask, adv, shift, reuse=True)
    b, grad_b = _run(ppo, config, logits, targets, mask, adv, shift, reuse=False)
    assert torch.equal(a.loss, b.loss) and torch.equal(grad_a, grad_b)
    for key in a.metrics:
        assert torch.equal(a.metrics[key], b.metrics[key]), key
    assert a.metrics["ppo_kl"].item() == pytest.approx(0.25, abs=1e-6)
    assert a.metrics["train_rollout_logprob_abs_diff"].item() == 0.0  # old *is* the rollout policy


def _minimal(batch, config, reuse=False):
    lp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.float64)
    return LossInputs(log_probs=lp, mask=mask, batch={"advantages": torch.ones(1, 2), **batch}, config=config,
                      reduce=Aggregator.build("token-mean", mask, global_tokens=2.0),
                      reuse_training_logprobs=reuse)


def test_missing_old_policy_is_an_error():
    with pytest.raises(ValueError, match="old-policy log-probs"):
        ppo(_minimal({}, {}))


@pytest.mark.parametrize("reuse", [False, True])
def test_missing_rollout_log_probs_under_use_rollout_logprobs_is_named(reuse):
    with pytest.raises(ValueError, match="rollout_log_probs must be provided when use_rollout_logprobs is set"):
        gspo(_minimal({}, {"use_rollout_logprobs": True}, reuse=reuse))


def test_reuse_rejects_a_batch_that_carries_old_log_probs():
    with pytest.raises(ValueError, match="reuse_training_logprobs"):
        ppo(_minimal({"old_log_probs": torch.zeros(1, 2)}, {}, reuse=True))
