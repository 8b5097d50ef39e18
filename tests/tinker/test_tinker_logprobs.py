"""Chunked token_logprobs equals the naive full log-softmax (values and gradients)."""
from __future__ import annotations

import pytest
import torch

import dsrl.actor.logprobs as L


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_naive(monkeypatch, with_entropy, temperature, dtype):
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 3 * 97)  # several chunks per row block (V = 97)
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 8, 97, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 97, (3, 7), generator=g)
    w_lp = torch.randn(3, 7, generator=g)
    w_ent = torch.randn(3, 7, generator=g)
    outs = []
    for fn in (L.token_logprobs, L.token_logprobs_naive):
        x = full.clone().requires_grad_(True)
        lp, ent = fn(x[:, :-1], targets, temperature=temperature, with_entropy=with_entropy)  # non-contiguous view
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)
        loss.backward()
        outs.append((lp.detach(), None if ent is None else ent.detach(), x.grad))
    (lp1, e1, g1), (lp2, e2, g2) = outs
    assert lp1.dtype == torch.float32
    torch.testing.assert_close(lp1, lp2, atol=1e-5, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(e1, e2, atol=1e-5, rtol=1e-5)
    else:
        assert e1 is None and e2 is None
    assert g1.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(g1.float(), g2.float(), atol=tol, rtol=tol)
    assert torch.equal(g1[:, -1], torch.zeros_like(g1[:, -1]))


def test_entropy_detached_and_no_grad_paths():
    x = torch.randn(2, 5, 11, requires_grad=True)
    t = torch.randint(0, 11, (2, 5))
    lp, ent = L.token_logprobs(x, t, with_entropy=True)
    (lp.sum() + 0 * ent.detach().sum()).backward()
    x2 = x.detach().clone().requires_grad_(True)
    lp2, _ = L.token_logprobs_naive(x2, t)
    lp2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        lp3, ent3 = L.token_logprobs(x, t, with_entropy=True)
    torch.testing.assert_close(lp3, lp.detach())
    assert not lp3.requires_grad and not ent3.requires_grad


def test_float64_gradcheck():
    x = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 6, (1, 3))
    # fp32 internals: compare against finite differences with a loose tolerance
    torch.autograd.gradcheck(lambda z: L.token_logprobs(z, t, temperature=0.5, with_entropy=True)[0].sum()
                             + L.token_logprobs(z, t, temperature=0.5, with_entropy=True)[1].sum(),
                             (x,), eps=1e-3, atol=1e-3, rtol=1e-2)


def test_non_prefix_view_and_contiguous_input(monkeypatch):
    """Views that are not a row-prefix of their base (and plain tensors) take the generic path."""
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 2 * 13)
    full = torch.randn(2, 6, 13)
    t = torch.randint(0, 13, (2, 5))
    for make in (lambda z: z[:, 1:], lambda z: z[:, :-1].contiguous(), lambda z: z[:, :5]):
        grads = []
        for fn in (L.token_logprobs, L.token_logprobs_naive):
            x = full.clone().requires_grad_(True)
            lp, ent = fn(make(x), t, with_entropy=True)
            (lp.sum() + ent.sum()).backward()
            grads.append((lp.detach(), x.grad))
        torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-5)
