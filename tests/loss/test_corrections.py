"""TIS / icepop / MIS against hand numbers, and the correction-function contract."""
import math
import sys
import textwrap

import pytest
import torch

from dsrl.loss.corrections import CORRECTIONS, get_tis_function
from dsrl.loss.objectives import ppo

from ._helpers import F64, inputs

LN = math.log


def _on_policy_batch(weights, adv=None, rows=1):
    """On-policy tokens (ρ = 1, A = 1 -> pg_t = −1) whose train/rollout weight w = exp(train − roll)
    is given, so the corrected loss is −Σ w̃ and dL/dlp = −w̃."""
    n = len(weights)
    train = torch.zeros(rows, n, dtype=F64)
    roll = -torch.tensor([[LN(w) for w in weights]] * rows, dtype=F64)
    lp = train.clone().requires_grad_(True)
    adv = torch.ones(rows, n, dtype=F64) if adv is None else adv
    return lp, torch.ones(rows, n, dtype=F64), {"advantages": adv, "old_log_probs": train, "rollout_log_probs": roll}


def _run(weights, cfg, rows=1):
    lp, mask, batch = _on_policy_batch(weights, rows=rows)
    out = ppo(inputs(lp, mask, batch, {"use_tis": True, **cfg}))
    out.loss.backward()
    return out, lp.grad


def test_registered_corrections():
    assert {"vanilla", "icepop", "mis"} <= set(CORRECTIONS)
    assert get_tis_function({})[0] is CORRECTIONS["vanilla"]


def test_vanilla_tis_truncation_and_metrics():
    out, grad = _run([3.0, 1.0, 0.5], {"tis_clip": 2.0, "tis_clip_low": 0.6})
    assert out.loss.item() == pytest.approx(-(2.0 + 1.0 + 0.6), abs=1e-14)
    torch.testing.assert_close(grad, torch.tensor([[-2.0, -1.0, -0.6]], dtype=F64), rtol=0, atol=1e-14)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["tis"] == pytest.approx(4.5) and m["tis_clipfrac"] == 2.0 and m["tis_abs"] == pytest.approx(2.5)
    assert m["ois"] == 3.0  # PPO ratio, all on-policy
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(LN(3) + LN(2), abs=1e-14)
    # k3 of KL(rollout‖train) per token: e^{−δ} − 1 + δ with δ = roll − train = −ln w
    expected_kl = sum(w - 1 - LN(w) for w in (3.0, 1.0, 0.5))
    assert m["train_rollout_kl"] == pytest.approx(expected_kl, abs=1e-14)


def test_icepop_rejects_out_of_range_tokens():
    out, grad = _run([3.0, 1.0, 0.5], {"tis_function": "icepop", "tis_clip": 2.0, "tis_clip_low": 0.6})
    assert out.loss.item() == -1.0
    assert grad.tolist() == [[0.0, -1.0, 0.0]]
    assert out.metrics["tis_clipfrac"].item() == 2.0


MIS = {"tis_function": "mis", "mis_batch_normalize": False, "mis_veto_threshold": None}


@pytest.mark.parametrize("cfg,weights_used", [
    ({"mis_mode": "truncate"}, [2.0, 1.0, 0.5]),
    ({"mis_mode": "clip", "mis_lower": 0.6}, [2.0, 1.0, 0.6]),
    ({"mis_mode": "mask", "mis_lower": 0.6}, [0.0, 1.0, 0.0]),
    ({"mis_level": "sequence"}, [1.5, 1.5, 1.5]),                         # Π w = 1.5
    ({"mis_level": "geometric"}, [1.5 ** (1 / 3)] * 3),
    ({"mis_level": "sequence", "mis_upper": 1.2}, [1.2, 1.2, 1.2]),
    ({"mis_rs_upper": 2.5}, [0.0, 1.0, 0.5]),                             # rejection sampling bound
    ({"mis_veto_threshold": 0.6}, [0.0, 0.0, 0.0]),                       # w=0.5 vetoes its sequence
    ({"mis_batch_normalize": True}, [2 / (3.5 / 3), 1 / (3.5 / 3), 0.5 / (3.5 / 3)]),
])
def test_mis_modes(cfg, weights_used):
    out, grad = _run([3.0, 1.0, 0.5], {**MIS, **cfg})
    assert out.loss.item() == pytest.approx(-sum(weights_used), abs=1e-13)
    torch.testing.assert_close(grad, -torch.tensor([weights_used], dtype=F64), rtol=0, atol=1e-13)
    if "mis_level" not in cfg:
        assert out.metrics["tis"].item() == pytest.approx(4.5)  # pre-correction token weights


def test_mis_veto_only_hits_the_offending_sequence_and_keeps_denominators():
    lp = torch.zeros(2, 2, dtype=F64, requires_grad=True)
    roll = torch.tensor([[0.0, -LN(1e-5)], [0.0, 0.0]], dtype=F64)  # row 0 token 1: w = 1e-5 < 1e-4
    batch = {"advantages": torch.ones(2, 2, dtype=F64), "old_log_probs": torch.zeros(2, 2, dtype=F64),
             "rollout_log_probs": roll}
    from dsrl.loss.types import Aggregator
    mask = torch.ones(2, 2, dtype=F64)
    agg = Aggregator(mask=mask, seq_weight=torch.full((2,), 0.25, dtype=F64))  # token-mean over 4
    out = ppo(inputs(lp, mask, batch, {"use_tis": True, "tis_function": "mis", "mis_batch_normalize": False},
                     reduce=agg))
    assert out.loss.item() == pytest.approx(-0.5)  # row 1 over the *unchanged* denominator 4
    assert out.metrics["mis_veto_frac"].item() == 0.5 and out.metrics["mis_reject_frac"].item() == 0.5


def test_builtin_tis_names_the_missing_input():
    lp, mask, batch = _on_policy_batch([1.0])
    no_roll = {k: v for k, v in batch.items() if k != "rollout_log_probs"}
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        ppo(inputs(lp, mask, no_roll, {"use_tis": True}))
    # under use_rollout_logprobs without an old-policy pass there are no trainer-scored log-probs
    no_old = {k: v for k, v in batch.items() if k != "old_log_probs"}
    with pytest.raises(ValueError, match="needs train_log_probs"):
        ppo(inputs(lp, mask, no_old, {"use_tis": True, "use_rollout_logprobs": True}))


def test_custom_tis_tolerates_missing_trainer_log_probs():
    seen = {}

    def my_tis(pg_loss, train_log_probs, rollout_log_probs, mask, config):
        seen.update(train=train_log_probs, roll=rollout_log_probs)
        return pg_loss * 0.5, mask, {"my_weight": torch.full_like(pg_loss, 0.5)}

    lp, mask, batch = _on_policy_batch([1.0, 1.0])
    roll_leaf = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    batch = {"advantages": batch["advantages"], "rollout_log_probs": roll_leaf * 1.0}
    out = ppo(inputs(lp, mask, batch, {"use_tis": True, "use_rollout_logprobs": True, "tis_function": my_tis}))
    out.loss.backward()
    assert seen["train"] is None and not seen["roll"].requires_grad
    assert out.metrics["my_weight"].item() == 1.0
    assert lp.grad.tolist() == [[-0.5, -0.5]] and roll_leaf.grad is None


def test_tis_function_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "user_tis_mod.py").write_text(textwrap.dedent("""
        def halve(pg_loss, train_log_probs, rollout_log_probs, mask, config):
            return pg_loss * 0.5, mask, {}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for path in ("user_tis_mod.halve", "user_tis_mod:halve"):
            out, grad = _run([3.0], {"tis_function": path})
            assert out.loss.item() == -0.5
        with pytest.raises((ValueError, ModuleNotFoundError)):
            _run([3.0], {"tis_function": "user_tis_mod.missing"})
    finally:
        sys.modules.pop("user_tis_mod", None)
