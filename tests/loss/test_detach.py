"""The two detach boundaries: gradients reach only the current policy (semantics §4, seed 001)."""
import pytest
import torch

from dsrl.loss.advantages import compute_advantages
from dsrl.loss.detach import FIXED_KEYS, detach_fixed_scores, fixed
from dsrl.loss.objectives import cispo, gspo, ppo
from dsrl.loss.opd import apply_opd_kl_to_advantages
from dsrl.loss.registry import ADVANTAGE_ESTIMATORS

from ._helpers import F64, inputs


def _leaf(*values):
    return torch.tensor([values], dtype=F64, requires_grad=True)


def test_fixed_and_persistent_boundary():
    leaf = torch.ones(2, requires_grad=True)
    assert fixed(None) is None and fixed(3) == 3
    assert not fixed(leaf * 2).requires_grad
    assert all(not t.requires_grad for t in fixed([leaf * 2, leaf * 3]))
    data = {k: [leaf * 2] for k in FIXED_KEYS} | {"opd_reverse_kl": leaf * 5, "rewards": leaf}
    out = detach_fixed_scores(data)
    assert out is data
    for k in FIXED_KEYS:
        rows = data[k] if isinstance(data[k], list) else [data[k]]
        assert all(r.grad_fn is None and not r.requires_grad for r in rows), k
    assert data["rewards"] is leaf  # only fixed scores are touched


@pytest.mark.parametrize("objective", [ppo, gspo, cispo])
@pytest.mark.parametrize("use_rollout_logprobs", [False, True])
def test_policy_loss_only_backpropagates_through_current_policy(objective, use_rollout_logprobs):
    old_leaf, roll_leaf, adv_leaf, ref_leaf = (_leaf(0.3, -0.2) for _ in range(4))
    logits = torch.tensor([[0.4, 0.9]], dtype=F64, requires_grad=True)
    lp = torch.sin(logits) - 1.0
    batch = {"old_log_probs": torch.sin(old_leaf) - 1.0, "rollout_log_probs": torch.sin(roll_leaf) - 1.0,
             "advantages": torch.square(adv_leaf) + 0.5, "ref_log_probs": torch.sin(ref_leaf) - 1.0}
    cfg = {"use_rollout_logprobs": use_rollout_logprobs, "use_kl_loss": True, "kl_loss_coef": 0.5,
           "use_tis": not use_rollout_logprobs, "use_unbiased_kl": True}
    out = objective(inputs(lp, torch.ones(1, 2), batch, cfg))
    out.loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    for leaf in (old_leaf, roll_leaf, adv_leaf, ref_leaf):
        assert leaf.grad is None
    assert all(not v.requires_grad for v in out.metrics.values())


# --- OPD (semantics §4 test_opd.py 1-7) -------------------------------------------------------
OPD = {"use_opd": True, "opd_kl_coef": 0.5}


def test_opd_subtracts_weighted_reverse_kl_and_stores_metric():
    student = torch.tensor([0.0, 1.0], requires_grad=True)
    teacher = torch.tensor([0.0, 0.0], requires_grad=True)
    data = {"teacher_log_probs": [teacher * 1.0]}
    advs = [torch.tensor([2.0, 2.0])]
    out = apply_opd_kl_to_advantages(OPD, data, advs, [student * 1.0])
    assert out is advs and torch.allclose(advs[0], torch.tensor([2.0, 1.5]))
    assert data["opd_reverse_kl"][0].tolist() == [0.0, 1.0]
    assert not advs[0].requires_grad and not data["opd_reverse_kl"][0].requires_grad
    assert not data["teacher_log_probs"][0].requires_grad
    cur = torch.zeros(2, requires_grad=True)
    (advs[0] * cur).sum().backward()
    assert cur.grad.tolist() == [2.0, 1.5] and student.grad is None and teacher.grad is None


def test_opd_precomputed_reverse_kl_is_detached():
    pre = torch.tensor([0.4, -0.2], requires_grad=True)
    data = {"opd_reverse_kl": [pre * 1.0]}
    advs = [torch.zeros(2)]
    apply_opd_kl_to_advantages({"opd_kl_coef": 0.25}, data, advs, [torch.zeros(2)])
    torch.testing.assert_close(advs[0], torch.tensor([-0.1, 0.05]))
    assert not advs[0].requires_grad and not data["opd_reverse_kl"][0].requires_grad and pre.grad is None
    # a [N, L] tensor layout goes row by row and comes back as a tensor
    out = apply_opd_kl_to_advantages({"opd_kl_coef": 1.0}, {"opd_reverse_kl": [[1.0, 2.0]]},
                                     torch.zeros(1, 2), torch.zeros(1, 2))
    assert isinstance(out, torch.Tensor) and out.tolist() == [[-1.0, -2.0]]


def test_opd_fixed_inputs_are_detached_in_persistent_rollout_data(monkeypatch):
    leaves = [torch.tensor([[0.3, 0.7]], dtype=F64, requires_grad=True) for _ in range(4)]
    data = {"old_log_probs": torch.sin(leaves[0]), "rollout_log_probs": torch.cos(leaves[1]),
            "ref_log_probs": torch.exp(leaves[2]), "teacher_log_probs": torch.square(leaves[3]),
            "rewards": torch.zeros(1, dtype=F64), "loss_mask": torch.ones(1, 2, dtype=F64)}

    def probe(rewards, mask, group_ids, config, kl):
        assert kl.grad_fn is None and data["old_log_probs"].grad_fn is None
        return torch.zeros_like(mask), torch.zeros_like(mask)

    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "probe", probe)
    compute_advantages(data, {**OPD, "advantage_estimator": "probe", "kl_coef": 0.1, "n_samples_per_prompt": 1})
    for key in ("old_log_probs", "rollout_log_probs", "ref_log_probs", "teacher_log_probs",
                "opd_reverse_kl", "advantages", "returns"):
        assert data[key].grad_fn is None and not data[key].requires_grad, key
    assert all(leaf.grad is None for leaf in leaves)
    expected = -0.5 * (torch.sin(leaves[0]) - torch.square(leaves[3])).detach()
    torch.testing.assert_close(data["advantages"], expected, rtol=0, atol=1e-15)


def test_opd_noop_when_student_missing():
    data, advs = {}, [torch.ones(2)]
    assert apply_opd_kl_to_advantages(OPD, data, advs, None) is advs
    assert advs[0].tolist() == [1.0, 1.0] and "opd_reverse_kl" not in data


def test_opd_errors():
    with pytest.raises(ValueError, match="requires teacher_log_probs"):
        apply_opd_kl_to_advantages(OPD, {}, [torch.ones(2)], [torch.ones(2)])
    with pytest.raises(ValueError, match="OPD length mismatch"):
        apply_opd_kl_to_advantages(OPD, {"teacher_log_probs": [torch.ones(2)] * 2}, [torch.ones(2)], [torch.ones(2)])
    with pytest.raises(ValueError, match="OPD length mismatch"):
        apply_opd_kl_to_advantages(OPD, {"opd_reverse_kl": [[0.0]] * 2}, [torch.ones(1)], [torch.ones(1)])
    with pytest.raises(ValueError, match="OPD shape mismatch"):  # scalar-advantage broadcast trap
        apply_opd_kl_to_advantages(OPD, {"teacher_log_probs": [torch.ones(2)]}, [torch.ones(1)], [torch.ones(2)])
    with pytest.raises(ValueError, match="OPD shape mismatch"):
        apply_opd_kl_to_advantages(OPD, {"teacher_log_probs": [torch.ones(3)]}, [torch.ones(2)], [torch.ones(2)])
    with pytest.raises(ValueError, match="OPD shape mismatch"):
        apply_opd_kl_to_advantages(OPD, {"opd_reverse_kl": [[0.0, 1.0]]}, [torch.ones(1)], [torch.ones(1)])
    # use_opd under reuse (no student scores) is refused by the entry point
    with pytest.raises(ValueError, match="use_opd requires old_log_probs"):
        compute_advantages({"rewards": torch.zeros(1), "loss_mask": torch.ones(1, 2),
                            "teacher_log_probs": torch.zeros(1, 2)}, {**OPD, "n_samples_per_prompt": 1})


# --- NaN safety (semantics §4 tests 5-7) ------------------------------------------------------
def test_zero_weighted_entropy_nan_does_not_poison_loss():
    lp = torch.tensor([[-0.5, -1.0]], dtype=F64, requires_grad=True)
    ent = torch.tensor([[float("nan"), 0.3]], dtype=F64, requires_grad=True)
    batch = {"advantages": torch.tensor([[1.0, -0.5]], dtype=F64), "old_log_probs": lp.detach()}
    out = ppo(inputs(lp, torch.ones(1, 2), batch, {"entropy_coef": 0.0}, entropy=ent))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all() and ent.grad is None
    # a NaN entropy on a masked token is harmless even when weighted
    lp.grad = None
    out = ppo(inputs(lp, torch.tensor([[0.0, 1.0]]), batch, {"entropy_coef": 0.1}, entropy=ent))
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.metrics["entropy"].item() == pytest.approx(0.3)
    assert torch.isfinite(ent.grad).all() and torch.isfinite(lp.grad).all()


def test_zero_weighted_kl_nan_does_not_poison_loss():
    lp = torch.tensor([[-0.5, -1.0]], dtype=F64, requires_grad=True)
    batch = {"advantages": torch.tensor([[1.0, -0.5]], dtype=F64), "old_log_probs": lp.detach(),
             "ref_log_probs": torch.full((1, 2), float("nan"), dtype=F64)}
    out = ppo(inputs(lp, torch.ones(1, 2), batch, {"use_kl_loss": True, "kl_loss_coef": 0.0}))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.metrics["kl_loss"]) and torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("objective", [ppo, gspo, cispo])
def test_masked_nonfinite_terms_do_not_poison_loss(objective):
    nan = float("nan")
    logits = torch.tensor([[0.2, 0.4]], dtype=F64, requires_grad=True)
    lp = torch.where(torch.tensor([[True, False]]), logits - 1.0, torch.full_like(logits, nan))
    batch = {"advantages": torch.tensor([[1.0, nan]], dtype=F64),
             "old_log_probs": torch.tensor([[-0.9, nan]], dtype=F64),
             "rollout_log_probs": torch.tensor([[-0.7, float("inf")]], dtype=F64),
             "ref_log_probs": torch.tensor([[-0.8, nan]], dtype=F64)}
    cfg = {"use_tis": True, "use_kl_loss": True, "kl_loss_coef": 0.1}
    out = objective(inputs(lp, torch.tensor([[1.0, 0.0]]), batch, cfg))
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0] != 0 and logits.grad[0, 1] == 0
