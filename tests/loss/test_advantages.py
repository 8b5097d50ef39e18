"""Advantage estimators against hand numbers, compute_advantages' order of operations, and
whitening (single process and a real 2-process gloo group)."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsrl.loss.advantages import compute_advantages, whiten_advantages
from dsrl.loss.registry import ADVANTAGE_ESTIMATORS

F64 = torch.float64
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=F64)


def _est(name, rewards, config, mask=MASK, group_ids=None, kl=None):
    return ADVANTAGE_ESTIMATORS[name](torch.tensor(rewards, dtype=F64), mask, group_ids, config, kl)


def test_registered_estimators():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= set(ADVANTAGE_ESTIMATORS)


def test_grpo_with_and_without_std():
    cfg = {"n_samples_per_prompt": 2}
    adv, ret = _est("grpo", [1.0, 0.0, 1.0, 1.0], cfg)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)  # unbiased std of {1, 0} = sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([[s, s, 0], [-s, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=F64),
                               rtol=0, atol=1e-15)
    assert torch.equal(adv, ret)
    adv, _ = _est("grpo", [1.0, 0.0, 1.0, 3.0], {**cfg, "grpo_std_normalization": False})
    assert adv.tolist() == [[0.5, 0.5, 0], [-0.5, 0, 0], [-1, -1, -1], [0, 1, 1]]


def test_grpo_group_of_one_is_finite_zero():
    adv, _ = _est("grpo", [1.0, 0.0, 5.0], {}, mask=torch.ones(3, 2, dtype=F64), group_ids=[4, 4, 9])
    assert torch.isfinite(adv).all() and adv[2].tolist() == [0.0, 0.0]


def test_dr_grpo_and_rloo():
    adv, _ = _est("dr_grpo", [1.0, 2.0, 3.0, 6.0], {"n_samples_per_prompt": 2}, mask=torch.ones(4, 1, dtype=F64))
    assert adv.flatten().tolist() == [-0.5, 0.5, -1.5, 1.5]
    # group {1, 2, 6}: leave-one-out baselines 4, 3.5, 1.5; group of one: baseline 0
    adv, _ = _est("rloo", [1.0, 2.0, 6.0, 7.0], {}, mask=torch.ones(4, 1, dtype=F64), group_ids=[0, 0, 0, 1])
    assert adv.flatten().tolist() == [-3.0, -1.5, 4.5, 7.0]


def test_reinforce_pp_discounted_returns():
    cfg = {"kl_coef": 0.5, "gamma": 0.5}
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]], dtype=F64)
    adv, ret = _est("reinforce_pp", [1.0, 1.0], cfg, mask=mask, kl=kl)
    # row 0: u = [−.05, −.1, −.15 + 1, 0]  -> G = [.1125, .325, .85, 0]
    # row 1: u = [−.05, 0 (masked, no KL charge), .85, 0] -> G = [.1625, (.425 masked -> 0), .85, 0]
    torch.testing.assert_close(adv, torch.tensor([[0.1125, 0.325, 0.85, 0], [0.1625, 0, 0.85, 0]], dtype=F64),
                               rtol=0, atol=1e-15)
    assert torch.equal(adv, ret)
    with pytest.raises(ValueError, match="trainable token"):
        _est("reinforce_pp", [1.0], {}, mask=torch.zeros(1, 2, dtype=F64))


def test_reinforce_pp_baseline():
    kl = torch.tensor([[0.2, 0.4], [0.2, 0.4]], dtype=F64)
    adv, ret = _est("reinforce_pp_baseline", [1.0, 3.0], {"kl_coef": 0.5, "n_samples_per_prompt": 2},
                    mask=torch.tensor([[1, 1], [1, 0]], dtype=F64), kl=kl)
    torch.testing.assert_close(adv, torch.tensor([[-1.1, -1.2], [0.9, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    assert torch.equal(adv, ret)


def test_compute_advantages_kl_in_reward_uses_the_configured_source():
    mask = torch.ones(2, 2, dtype=F64)
    base = {"rewards": torch.tensor([1.0, 3.0], dtype=F64), "loss_mask": mask,
            "old_log_probs": torch.full((2, 2), -1.0, dtype=F64),
            "rollout_log_probs": torch.full((2, 2), -2.0, dtype=F64),
            "ref_log_probs": torch.full((2, 2), -1.5, dtype=F64)}
    cfg = {"advantage_estimator": "reinforce_pp_baseline", "kl_coef": 0.5, "kl_loss_type": "k1",
           "n_samples_per_prompt": 2}
    out = compute_advantages(dict(base), cfg)["advantages"]           # k1 = old − ref = 0.5
    torch.testing.assert_close(out, torch.tensor([[-1.25] * 2, [0.75] * 2], dtype=F64), rtol=0, atol=1e-15)
    out = compute_advantages(dict(base), {**cfg, "use_rollout_logprobs": True})["advantages"]  # −0.5
    torch.testing.assert_close(out, torch.tensor([[-0.75] * 2, [1.25] * 2], dtype=F64), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_advantages({k: v for k, v in base.items() if k != "ref_log_probs"}, cfg)


@pytest.mark.parametrize("estimator", sorted(["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]))
def test_zero_kl_synthesis_matches_zero_log_prob_baseline(estimator):
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5])
    cfg = {"advantage_estimator": estimator, "n_samples_per_prompt": 2, "gamma": 0.9}
    reuse = compute_advantages({"rewards": rewards, "loss_mask": mask}, cfg)  # no old/ref log-probs at all
    zeros = torch.zeros(4, 3)
    baseline = compute_advantages({"rewards": rewards, "loss_mask": mask, "old_log_probs": zeros,
                                   "ref_log_probs": zeros.clone()}, {**cfg, "kl_coef": 0.5})
    assert torch.equal(reuse["advantages"], baseline["advantages"])
    assert torch.equal(reuse["returns"], baseline["returns"])


def test_list_layout_round_trips():
    masks = [torch.ones(2), torch.ones(3), torch.tensor([1.0, 0.0])]
    cfg = {"advantage_estimator": "reinforce_pp", "gamma": 0.5, "n_samples_per_prompt": 1}
    out = compute_advantages({"rewards": [1.0, 2.0, 3.0], "loss_mask": masks}, cfg)
    assert [a.tolist() for a in out["advantages"]] == [[0.5, 1.0], [0.5, 1.0, 2.0], [3.0, 0.0]]
    assert isinstance(out["returns"], list)


def test_normalize_advantages_whitens_after_the_estimator():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=F64)
    cfg = {"advantage_estimator": "dr_grpo", "n_samples_per_prompt": 3, "normalize_advantages": True}
    out = compute_advantages({"rewards": torch.tensor([0.0, 3.0, 6.0], dtype=F64), "loss_mask": mask}, cfg)
    # dr_grpo: [-3, -3 | 0 | 3, 3] over 5 tokens: mean 0, unbiased var 36/4 = 9 -> a / sqrt(9 + 1e-8)
    s = 3 / math.sqrt(9 + 1e-8)
    torch.testing.assert_close(out["advantages"], torch.tensor([[-s, -s], [0, 0], [s, s]], dtype=F64),
                               rtol=0, atol=1e-15)
    assert out["returns"].tolist() == [[-3, -3], [0, 0], [3, 3]]  # returns are never whitened


def test_whiten_formula_and_empty_mask():
    adv = torch.tensor([[1.0, 2.0, 100.0], [4.0, float("nan"), 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=F64)
    out = whiten_advantages(adv, mask)
    mean = 7 / 3
    var = (21 / 3 - mean ** 2) * 3 / 2
    expected = [[(1 - mean) / math.sqrt(var + 1e-8), (2 - mean) / math.sqrt(var + 1e-8), 0.0],
                [(4 - mean) / math.sqrt(var + 1e-8), 0.0, 0.0]]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="mask sum is 0"):
        whiten_advantages(adv, torch.zeros_like(mask))


def _whiten_worker(rank, world, init_file, out_dir, adv, mask):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = slice(0, 2) if rank == 0 else slice(2, None)
        torch.save(whiten_advantages(adv[rows], mask[rows]), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_whiten_uses_global_statistics_across_two_gloo_ranks(tmp_path):
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(5, 4, generator=g, dtype=F64)
    mask = (torch.rand(5, 4, generator=g) > 0.3).to(F64)
    mask[1] = 0.0  # rank 0 holds a fully masked sample; still joins the all-reduce
    mp.spawn(_whiten_worker, args=(2, str(tmp_path / "init"), str(tmp_path), adv, mask), nprocs=2, join=True)
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in range(2)])
    torch.testing.assert_close(got, whiten_advantages(adv, mask), rtol=0, atol=1e-12)
