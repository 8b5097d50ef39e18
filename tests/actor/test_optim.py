"""The optimizer step's fast paths (dsrl.actor.optim, dsrl.actor.nonfinite): the fused AdamW makes
the for-loop AdamW's update; the single-rank ZeRO-0 engine skips DeepSpeed's gradient all-reduce
and trains bit-identically to the engine that runs it; the one-pass finiteness check agrees with
the element-wise one, overflowing norms included; the logged gradient norm, now read from bf16
gradients without float32 copies, is the norm of the copies bit for bit."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsrl.actor.nonfinite import fp32_grad_norm, grads_finite, local_grads_finite
from dsrl.actor.optim import adamw


def _params(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(64, 48), (48,), (3, 5, 7)]]


def test_fused_adamw_makes_the_loop_update():
    fused_params, loop_params = _params(0), _params(0)
    fused = adamw(fused_params, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    assert fused.defaults["fused"] is True  # the CPU kernel exists in this torch
    g = torch.Generator().manual_seed(1)
    start = [p.detach().clone() for p in fused_params]
    for _ in range(5):
        for a, b in zip(fused_params, loop_params):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        loop.step()
    for a, b, s in zip(fused_params, loop_params, start):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert (a.detach() - s).abs().max() > 1e-3  # five real steps were taken
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[a][key], loop.state[b][key], rtol=1e-6, atol=1e-9)


def _engine_with_grads(grads: list):
    params = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        params.append(p)
    module = SimpleNamespace(parameters=lambda: iter(params))
    return SimpleNamespace(zero_optimization_stage=lambda: 0, optimizer=SimpleNamespace(), module=module)


@pytest.mark.parametrize("bad, finite", [(None, True), (float("nan"), False), (float("inf"), False),
                                         (-float("inf"), False)])
def test_finiteness_check(bad, finite):
    grads = [torch.randn(10, 10), torch.randn(7)]
    if bad is not None:
        grads[1][3] = bad
    assert local_grads_finite(_engine_with_grads(grads)) is finite


def test_finiteness_check_is_not_fooled_by_an_overflowing_norm():
    # every element finite, but the sum of their squares overflows float32: the norm is inf
    grads = [torch.full((4,), 3e38), torch.ones(3)]
    assert not torch.isfinite(torch.nn.utils.get_total_norm(grads))
    assert local_grads_finite(_engine_with_grads(grads)) is True
    grads[0][2] = float("nan")
    assert local_grads_finite(_engine_with_grads(grads)) is False


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_single_rank_zero0_skips_the_allreduce_and_trains_the_same(tiny_model_path, stage):
    """Two steps of two microbatches each (the first step's second microbatch closes the window
    through optimizer_step, is_last=False): the engine without the all-reduce ends with the same
    weights and optimizer state, bit for bit, as one forced to run it. ZeRO-1 keeps it."""
    from test_engine_nonfinite import PPO, _assert_equal, _engine, _mb, _optimizer_state, _params

    from dsrl.loss.types import Reduction

    def train(eng):
        for k, is_last in ((1, False), (3, True)):
            eng.weights_pushed()  # a new rollout from these weights (reuse refuses steps since the last push)
            for i, mb in enumerate([_mb(k), _mb(k + 1)]):
                reduce = Reduction("token-mean", global_tokens=float(mb["loss_mask"].sum()))
                eng.forward_backward(mb, PPO, {}, reduce, reuse_training_logprobs=True, is_last=is_last and i == 1)
            eng.optimizer_step()
        return _params(eng), _optimizer_state(eng)

    fast = _engine(tiny_model_path, stage)
    assert fast.engine.enable_backward_allreduce is (stage != 0)
    if stage != 0:
        return
    calls = []
    slow = _engine(tiny_model_path, stage)
    slow.engine.enable_backward_allreduce = True
    real = slow.engine.allreduce_gradients
    slow.engine.allreduce_gradients = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    a, b = train(fast), train(slow)
    assert len(calls) >= 2  # the forced engine did reduce (at the boundary of each step, and in engine.step)
    _assert_equal(a[0], b[0], "weights")
    _assert_equal(a[1], b[1], "optimizer state")


def _model_shaped_grads(dtype, seed: int, scales) -> list:
    """Gradients with SmolLM2's tensor shapes (an embedding, a layer's projections and norms),
    each at its own scale, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(4096, 576), (576, 576), (192, 576), (1536, 576), (576, 1536), (576,), (576,)]
    return [(torch.randn(shape, generator=g) * scale).to(dtype) for shape, scale in zip(shapes, scales)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed, scales", [(0, [1e-3] * 7), (1, [1e-6, 1e-2, 3.0, 1e-4, 5e-3, 1e-8, 100.0]),
                                          (2, [7e-5, 7e-5, 1e-1, 2e-2, 9e-7, 1.0, 1e-3])])
def test_the_one_pass_norm_is_the_norm_of_float32_copies(dtype, seed, scales):
    grads = _model_shaped_grads(dtype, seed, scales)
    reference = torch.nn.utils.get_total_norm([g.float() for g in grads], foreach=True)
    norm = fp32_grad_norm(grads)
    assert norm.dtype == torch.float32 and torch.equal(norm, reference), (norm.item(), reference.item())
    # an independent float64 computation agrees to float32 accumulation over 2.4M elements (4e-5 seen)
    exact = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    assert abs(norm.item() - exact.item()) <= 2e-4 * exact.item()
    assert fp32_grad_norm([]).item() == 0.0


def test_a_given_norm_settles_finiteness_and_an_overflowing_one_is_checked_element_wise():
    grads = _model_shaped_grads(torch.bfloat16, 3, [1e-3] * 7)
    assert grads_finite(grads, fp32_grad_norm(grads)) is True
    grads[4][7, 11] = float("nan")
    assert grads_finite(grads, fp32_grad_norm(grads)) is False
    big = [torch.full((4,), 3e38, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)]
    assert not torch.isfinite(fp32_grad_norm(big))  # the squares overflow float32
    assert grads_finite(big, fp32_grad_norm(big)) is True
