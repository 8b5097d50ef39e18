"""TrainingSession on the real DeepSpeed ActorEngine: gradients equal autograd of the summed
loss (ZeRO 0-3, one process; ZeRO-2/3 on two ranks), accumulation across calls, forward leaves
gradients alone, optim_step = AdamW on the accumulated gradient, then cleared."""
from __future__ import annotations

import os

import pytest
import torch

from dsrl.actor.work_units import AdamParams, TrainingSession
from dsrl.distributed.ports import free_port
from tinker_helpers import (build_tiny_llama, full_grads, full_params, load_plain, random_datums,
                            reference_loss, two_rank_worker)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_llama(str(tmp_path_factory.mktemp("tinker_engine") / "llama"))


def _check(got, ref, rel=1e-4):
    for n, r in ref.items():
        g = got[n]
        assert g is not None, n
        scale = r.abs().max().item()
        diff = (g - r).abs().max().item()
        assert diff <= rel * scale + 1e-7, f"{n}: max diff {diff:.3e} vs scale {scale:.3e}"


def _ref_grads(model, parts):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for data, loss_fn in parts:
        loss, _ = reference_loss(model, data, loss_fn)
        total = total + loss
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, float(total.detach())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_gradients_accumulation_and_step(tiny_path, stage):
    from dsrl.actor.engine import ActorEngine

    actor = ActorEngine(tiny_path, zero_stage=stage, persistence_threshold=0, micro_batch_size=2, grad_clip=1.0)
    sess = TrainingSession(actor, micro_batch_size=2)
    a = random_datums(3, "cross_entropy", seed=1)
    b = random_datums(3, "ppo", seed=2)
    c = random_datums(2, "cross_entropy", seed=3)

    ra = sess.forward_backward(a, "cross_entropy")
    fwd = sess.forward(c, "cross_entropy")  # must leave the gradient alone
    rb = sess.forward_backward(b, "ppo")
    got = full_grads(actor)

    ref_model = load_plain(tiny_path)
    ref, ref_total = _ref_grads(ref_model, [(a, "cross_entropy"), (b, "ppo")])
    _check(got, ref)
    assert ra.metrics["loss:sum"] + rb.metrics["loss:sum"] == pytest.approx(ref_total, rel=1e-5, abs=1e-4)
    with torch.no_grad():
        ref_c, ref_lps = reference_loss(ref_model, c, "cross_entropy")
    assert fwd.metrics["loss:sum"] == pytest.approx(ref_c.item(), rel=1e-5, abs=1e-4)
    for out, lp in zip(fwd.loss_fn_outputs, ref_lps):
        torch.testing.assert_close(out["logprobs"], lp, atol=1e-5, rtol=1e-5)

    # AdamW first step from zero state: delta = -lr * g / (|g| + eps) ~ -lr * sign(g); clipping off.
    before = full_params(actor)
    lr = 1e-3
    m = sess.optim_step(AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0,
                                   grad_clip_norm=0.0))
    gnorm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values())).item()
    assert m.metrics["grad_norm:mean"] == pytest.approx(gnorm, rel=1e-3)
    after = full_params(actor)
    for n, g in ref.items():
        delta = after[n] - before[n]
        big = g.abs() > 1e-6
        expected = -lr * torch.sign(g)
        assert (delta[big] - expected[big]).abs().max().item() < 2e-5 * lr * 50, n
        if bool((g == 0).any()):
            assert delta[g == 0].abs().max().item() == 0.0, n  # untouched rows (unused embeddings)

    # The gradient was cleared by the step: a new call gives exactly the new loss's gradient.
    d = random_datums(2, "dro", seed=4)
    sess.forward_backward(d, "dro")
    got2 = full_grads(actor)
    ref_model.load_state_dict({k: v for k, v in after.items()}, strict=False)
    ref2, _ = _ref_grads(ref_model, [(d, "dro")])
    _check(got2, ref2)
    actor.optimizer_step()


def test_two_ranks_zero2_zero3_equal_single_process_gradient(tiny_path, tmp_path):
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=two_rank_worker, args=(r, 2, port, tiny_path, str(tmp_path), (2, 3), 3))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    data = random_datums(5, "ppo", seed=21)
    ref, ref_total = _ref_grads(load_plain(tiny_path), [(data, "ppo")])
    for stage in (2, 3):
        res = torch.load(os.path.join(str(tmp_path), f"zero{stage}.pt"))
        assert res["n_out"] == 3  # rank 0's own datums only
        assert res["loss"] == pytest.approx(ref_total, rel=1e-5, abs=1e-4)  # loss:sum all-reduced
        _check(res["grads"], ref)
        # optim_step across ranks: identical parameters on both ranks, and the first AdamW step
        # moves every parameter with a clear gradient by lr against its sign.
        r0, r1 = (torch.load(os.path.join(str(tmp_path), f"params_zero{stage}_rank{r}.pt")) for r in (0, 1))
        moved = 0
        for name, after in r0["after"].items():
            assert torch.equal(after, r1["after"][name]), (stage, name)
            g = ref[name].reshape(after.shape)
            delta = after - r0["before"][name]
            clear = g.abs() > 1e-4
            assert torch.all(delta.abs() <= 1e-3 * (1 + 1e-3))
            assert torch.all(torch.sign(delta[clear]) == -torch.sign(g[clear])), (stage, name)
            moved += int(clear.sum())
        assert moved > 1000
