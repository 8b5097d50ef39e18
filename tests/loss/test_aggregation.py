"""DP / microbatch invariance: with the aggregator built from global counts, the sum of the
partial losses (and the accumulated gradient) over any split of the rows equals the whole-batch
loss. TIS (vanilla), KL loss and the entropy bonus are on, since each is reduced separately."""
import pytest
import torch

from dsrl.loss.objectives import cispo, gspo, ppo
from dsrl.loss.types import AGG_MODES, Aggregator, LossInputs

F64 = torch.float64
MODES = [m for m in AGG_MODES if m != "sum"]
CFG = {"use_tis": True, "tis_clip": 1.3, "tis_clip_low": 0.8, "use_kl_loss": True, "kl_loss_coef": 0.3,
       "kl_loss_type": "k3", "entropy_coef": 0.01, "eps_clip_high": 0.28}
SPLITS = {
    "microbatches": [[0], [1, 2], [3, 4]],
    "two_ranks": [[0, 2, 4], [1, 3]],          # each "rank" then splits again into 2 microbatches
}


def _problem():
    g = torch.Generator().manual_seed(7)
    B, L = 5, 6
    lengths = torch.tensor([6, 2, 4, 1, 5])
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(F64)
    lp = (-torch.rand(B, L, generator=g, dtype=F64) * 2).requires_grad_(True)
    ent = torch.rand(B, L, generator=g, dtype=F64).requires_grad_(True)
    batch = {"advantages": torch.randn(B, L, generator=g, dtype=F64) * mask,
             "old_log_probs": (lp + 0.3 * torch.randn(B, L, generator=g, dtype=F64)).detach() * mask,
             "rollout_log_probs": (lp + 0.3 * torch.randn(B, L, generator=g, dtype=F64)).detach() * mask,
             "ref_log_probs": (lp + 0.3 * torch.randn(B, L, generator=g, dtype=F64)).detach() * mask}
    return lp, ent, mask, batch


def _part(objective, mode, lp, ent, mask, batch, rows):
    idx = torch.tensor(rows)
    m = mask[idx]
    agg = Aggregator.build(mode, m, global_tokens=float(mask.sum()), global_seqs=float(mask.shape[0]),
                           norm_len=float(mask.shape[1]))
    agg = Aggregator(mask=agg.mask.to(F64), seq_weight=agg.seq_weight.to(F64))
    return objective(LossInputs(log_probs=lp[idx], mask=m, batch={k: v[idx] for k, v in batch.items()},
                                config=CFG, reduce=agg, entropy=ent[idx]))


@pytest.mark.parametrize("objective", [ppo, gspo, cispo], ids=["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", list(SPLITS))
def test_partial_sums_match_whole_batch(objective, mode, split):
    lp, ent, mask, batch = _problem()
    whole = _part(objective, mode, lp, ent, mask, batch, list(range(mask.shape[0])))
    whole.loss.backward()
    g_lp, g_ent = lp.grad.clone(), ent.grad.clone()
    lp.grad = ent.grad = None

    parts = []
    for rows in SPLITS[split]:
        chunks = [rows] if split == "microbatches" else [rows[: len(rows) // 2 + 1], rows[len(rows) // 2 + 1:]]
        for chunk in filter(None, chunks):
            out = _part(objective, mode, lp, ent, mask, batch, chunk)
            out.loss.backward()  # gradient accumulation across microbatches and "ranks"
            parts.append(out)
    total = sum(p.loss.detach() for p in parts)
    assert abs(total.item() - whole.loss.item()) < 1e-12
    torch.testing.assert_close(lp.grad, g_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent.grad, g_ent, rtol=0, atol=1e-12)
    assert g_lp.abs().sum() > 0
    for key, value in whole.metrics.items():
        assert abs(sum(p.metrics[key] for p in parts).item() - value.item()) < 1e-12, key
