"""GAE (algo.advantage_estimator=gae) against values worked out by hand, over several masks,
lengths and the gamma/lambda edge cases 0 and 1; then its path through compute_advantages
(values detached, whitening of advantages only, list layout, missing values named)."""
import pytest
import torch

from dsrl.loss.advantages import compute_advantages
from dsrl.loss.registry import ADVANTAGE_ESTIMATORS, uses_kl_in_reward

F64 = torch.float64

# Each row: (mask, values, reward, gamma, lambda, kl_coef, kl, expected advantages, expected returns).
# Worked out by hand with delta_t = u_t + gamma*V_next - V_t, A_t = delta_t + gamma*lambda*A_next over
# the trainable tokens only (V after the last one = 0), u = -kl_coef*kl plus the reward on the last
# trainable token, R = A + V, and A = R = 0 on masked tokens.
TABLE = [
    # gamma = lambda = 1: A_t = r - V_t (Monte-Carlo return minus baseline); R_t = r.
    ([1, 1, 1], [0.5, 0.2, -0.1], 1.0, 1.0, 1.0, 0.0, None,
     [0.5, 0.8, 1.1], [1.0, 1.0, 1.0]),
    # lambda = 0: A_t = delta_t = [0 + 0.2 - 0.5, 0 - 0.1 - 0.2, 1 + 0 + 0.1].
    ([1, 1, 1], [0.5, 0.2, -0.1], 1.0, 1.0, 0.0, 0.0, None,
     [-0.3, -0.3, 1.1], [0.2, -0.1, 1.0]),
    # gamma = 0 (lambda irrelevant): A_t = u_t - V_t.
    ([1, 1, 1], [0.5, 0.2, -0.1], 1.0, 0.0, 0.5, 0.0, None,
     [-0.5, -0.2, 1.1], [0.0, 0.0, 1.0]),
    # A masked token inside the response (an environment token) and trailing padding: the values
    # 9 and 7 there are never read; the TD step joins positions 0 -> 2 -> 3.
    #   t=3: 2 - 0.6 = 1.4;  t=2: 0.5*0.6 - 0.2 = 0.1, A = 0.1 + 0.25*1.4 = 0.45;
    #   t=0: 0.5*0.2 - 0.4 = -0.3, A = -0.3 + 0.25*0.45 = -0.1875.
    ([1, 0, 1, 1, 0], [0.4, 9.0, 0.2, 0.6, 7.0], 2.0, 0.5, 0.5, 0.0, None,
     [-0.1875, 0.0, 0.45, 1.4, 0.0], [0.2125, 0.0, 0.65, 2.0, 0.0]),
    # KL in the reward: u = -0.1*[0.5, 1, 2] + [0, 0, 1] = [-0.05, -0.1, 0.8]; V = 0, gamma = lambda = 1:
    # A_t = sum of u from t on.
    ([1, 1, 1], [0.0, 0.0, 0.0], 1.0, 1.0, 1.0, 0.1, [0.5, 1.0, 2.0],
     [0.65, 0.7, 0.8], [0.65, 0.7, 0.8]),
    # KL on a masked token is not charged (the policy did not sample it); prompt columns before.
    ([0, 0, 1, 1], [5.0, 5.0, 0.0, 0.0], 1.0, 1.0, 1.0, 0.1, [3.0, 3.0, 1.0, 2.0],
     [0.0, 0.0, 0.7, 0.8], [0.0, 0.0, 0.7, 0.8]),
    # One trainable token: delta = r - V = -1 - 0.3.
    ([0, 1, 0], [4.0, 0.3, 4.0], -1.0, 0.9, 0.8, 0.0, None,
     [0.0, -1.3, 0.0], [0.0, -1.0, 0.0]),
    # gamma = 1, lambda = 0.5, four tokens, V = [0, -0.1, -0.2, -0.3]: delta_t = V_{t+1} - V_t = -0.1
    # for t < 3, delta_3 = 1 + 0.3 = 1.3;
    #   A3 = 1.3; A2 = -0.1 + 0.5*1.3 = 0.55; A1 = -0.1 + 0.275 = 0.175; A0 = -0.1 + 0.0875 = -0.0125.
    ([1, 1, 1, 1], [0.0, -0.1, -0.2, -0.3], 1.0, 1.0, 0.5, 0.0, None,
     [-0.0125, 0.175, 0.55, 1.3], [-0.0125, 0.075, 0.35, 1.0]),
    # No trainable token at all: zeros, no error.
    ([0, 0, 0], [1.0, 2.0, 3.0], 1.0, 1.0, 1.0, 0.0, None,
     [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]),
]


@pytest.mark.parametrize("row", TABLE, ids=[f"case{i}" for i in range(len(TABLE))])
def test_gae_matches_hand_computed_table(row):
    mask, values, reward, gamma, lam, kl_coef, kl, exp_adv, exp_ret = row
    cfg = {"gamma": gamma, "gae_lambda": lam, "kl_coef": kl_coef}
    m = torch.tensor([mask], dtype=F64)
    kl_t = None if kl is None else torch.tensor([kl], dtype=F64)
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](torch.tensor([reward], dtype=F64), m, None, cfg, kl_t,
                                           values=torch.tensor([values], dtype=F64))
    torch.testing.assert_close(adv, torch.tensor([exp_adv], dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor([exp_ret], dtype=F64), rtol=0, atol=1e-12)


def test_gae_rows_are_independent_in_a_batch():
    """The whole table as one padded batch gives each row's own numbers (no leak across rows)."""
    width = max(len(r[0]) for r in TABLE)
    pad = lambda xs: list(xs) + [0.0] * (width - len(xs))  # noqa: E731
    rows = [r for r in TABLE if r[3] == 1.0 and r[4] == 1.0]  # gamma = lambda = 1; kl_coef 0 or 0.1
    assert len(rows) == 4
    mask = torch.tensor([pad(r[0]) for r in rows], dtype=F64)
    values = torch.tensor([pad(r[1]) for r in rows], dtype=F64)
    rewards = torch.tensor([r[2] for r in rows], dtype=F64)
    # kl_coef = 0.1 for all: rows without KL get kl = 0 (the estimator's input is per token).
    kl = torch.tensor([pad(r[6] if r[5] else [0.0] * len(r[0])) for r in rows], dtype=F64)
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](rewards, mask, None, {"gamma": 1.0, "gae_lambda": 1.0, "kl_coef": 0.1},
                                           kl, values=values)
    torch.testing.assert_close(adv, torch.tensor([pad(r[7]) for r in rows], dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor([pad(r[8]) for r in rows], dtype=F64), rtol=0, atol=1e-12)


def test_gae_is_registered_with_kl_in_reward_and_values():
    fn = ADVANTAGE_ESTIMATORS["gae"]
    assert uses_kl_in_reward(fn) and fn.needs_values


def test_gae_rejects_missing_or_misshapen_values():
    m = torch.ones(1, 3)
    with pytest.raises(ValueError, match="critic's values"):
        ADVANTAGE_ESTIMATORS["gae"](torch.ones(1), m, None, {}, None)
    with pytest.raises(ValueError, match=r"values have shape \(1, 2\)"):
        ADVANTAGE_ESTIMATORS["gae"](torch.ones(1), m, None, {}, None, values=torch.zeros(1, 2))


def test_compute_advantages_gae_detaches_values_and_whitens_only_advantages():
    leaf = torch.tensor([[0.5, 0.2, -0.1], [0.3, 0.0, 0.0]], requires_grad=True)
    values = leaf * 1.0  # carries a graph, as a careless scorer might hand back
    data = {"rewards": torch.tensor([1.0, 0.0]), "loss_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
            "values": values}
    cfg = {"advantage_estimator": "gae", "gamma": 1.0, "gae_lambda": 1.0, "normalize_advantages": True}
    compute_advantages(data, cfg)
    assert data["values"].grad_fn is None and not data["advantages"].requires_grad
    # gamma = lambda = 1: raw A = r - V = [0.5, 0.8, 1.1] and [-0.3]; R = r on trainable tokens.
    torch.testing.assert_close(data["returns"], torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), rtol=0, atol=1e-6)
    raw = torch.tensor([0.5, 0.8, 1.1, -0.3], dtype=F64)
    whitened = (raw - raw.mean()) / (raw.var(unbiased=True) + 1e-8).sqrt()
    got = data["advantages"][torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)]
    torch.testing.assert_close(got, whitened.to(torch.float32), rtol=0, atol=1e-6)
    assert data["advantages"][1, 1:].abs().sum() == 0


def test_compute_advantages_gae_list_layout_and_missing_values():
    data = {"rewards": torch.tensor([1.0, 2.0]), "loss_mask": [torch.ones(2), torch.ones(1)],
            "values": [torch.tensor([0.25, 0.5]), torch.tensor([1.5])]}
    compute_advantages(data, {"advantage_estimator": "gae", "gamma": 1.0, "gae_lambda": 1.0})
    assert [a.tolist() for a in data["advantages"]] == [[0.75, 0.5], [0.5]]
    assert [r.tolist() for r in data["returns"]] == [[1.0, 1.0], [2.0]]
    with pytest.raises(ValueError, match=r"algo.advantage_estimator=gae needs rollout_data\['values'\]"):
        compute_advantages({"rewards": torch.ones(1), "loss_mask": torch.ones(1, 2)}, {"advantage_estimator": "gae"})
