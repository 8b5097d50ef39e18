"""TrainingSession semantics on a plain-autograd stand-in engine (fast): explicit targets,
ordering, outputs, chunk additivity, validation before any forward."""
from __future__ import annotations

import pytest
import torch

from dsrl.actor.work_units import AdamParams, Datum, TrainingSession
from tinker_helpers import (NoForwardEngine, PlainEngine, build_tiny_llama, load_plain, random_datums,
                            reference_loss)

LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_llama(str(tmp_path_factory.mktemp("tinker_tiny") / "llama"))


@pytest.fixture()
def plain(tiny_path):
    return PlainEngine(load_plain(tiny_path))


def grads(model):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def assert_grads_close(a, b, rel=1e-4):
    """max |a - b| <= rel * max |b| per parameter (fp32, different padding/batching)."""
    for n in a:
        scale = b[n].abs().max().item()
        diff = (a[n] - b[n]).abs().max().item()
        assert diff <= rel * scale + 1e-7, f"{n}: max diff {diff:.3e} vs scale {scale:.3e}"


def test_targets_shifted_sequence_equals_next_token_scoring(plain):
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, 1024, (7,), generator=g)
    sess = TrainingSession(plain, micro_batch_size=4)
    d = Datum(seq[:-1].tolist(), {"target_tokens": seq[1:], "weights": torch.ones(6)})
    out = sess.forward([d], "cross_entropy")
    with torch.no_grad():
        logits = plain.model(input_ids=seq[None]).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0]
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert lp.dtype == torch.float32 and lp.shape == (6,)
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.metrics["loss:sum"], -expected.sum().item(), atol=1e-4, rtol=1e-5)


def test_explicit_targets_are_the_gather_labels(plain):
    """rl_loop style: prompt positions carry target 0, labels differ from the next input."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(3, 1024, (5,), generator=g)
    b = torch.randint(3, 1024, (3,), generator=g)
    ta = torch.tensor([0, 0, 9, 10, 11])
    tb = torch.tensor([0, 12, 13])
    data = [Datum(a.tolist(), {"target_tokens": ta.tolist(), "logprobs": [0.0] * 5, "advantages": [0, 0, 1, 1, 1]}),
            Datum(b, {"target_tokens": tb, "logprobs": torch.zeros(3), "advantages": torch.tensor([0.0, 2, 2])})]
    out = TrainingSession(plain, micro_batch_size=2).forward(data, "importance_sampling")
    for (ids, tg), res in zip(((a, ta), (b, tb)), out.loss_fn_outputs):
        with torch.no_grad():
            lsm = torch.log_softmax(plain.model(input_ids=ids[None]).logits[0], -1)
        torch.testing.assert_close(res["logprobs"], lsm.gather(-1, tg[:, None])[:, 0], atol=1e-5, rtol=1e-5)
        # and not the next-token scores
        assert not torch.allclose(res["logprobs"][:-1], lsm[:-1].gather(-1, ids[1:, None])[:, 0])


@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_forward_backward_matches_reference_and_chunking(tiny_path, loss_fn):
    data = random_datums(5, loss_fn, seed=11)
    cfg = {"beta": 0.2} if loss_fn == "dro" else None
    ref_model = load_plain(tiny_path)
    ref_loss, ref_lps = reference_loss(ref_model, data, loss_fn, cfg)
    ref_loss.backward()
    ref = grads(ref_model)
    for mbs in (1, 2, 5):
        eng = PlainEngine(load_plain(tiny_path))
        out = TrainingSession(eng, micro_batch_size=mbs).forward_backward(data, loss_fn, cfg)
        assert abs(out.metrics["loss:sum"] - ref_loss.item()) < 1e-4 * max(1.0, abs(ref_loss.item()))
        assert len(out.loss_fn_outputs) == 5
        for res, d, lp in zip(out.loss_fn_outputs, data, ref_lps):
            n = len(d.model_input)
            assert res["logprobs"].shape == (n,) and res["elementwise_loss"].shape == (n,)
            assert res["logprobs"].dtype == torch.float32 and res["logprobs"].device.type == "cpu"
            assert not res["logprobs"].requires_grad
            torch.testing.assert_close(res["logprobs"], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sum(r["elementwise_loss"].sum().item() for r in out.loss_fn_outputs),
                                   out.metrics["loss:sum"], atol=1e-4, rtol=1e-5)
        assert_grads_close(grads(eng.model), ref)


def test_two_calls_accumulate_like_one(tiny_path):
    data = random_datums(6, "cross_entropy", seed=5)
    e1 = PlainEngine(load_plain(tiny_path))
    s1 = TrainingSession(e1, micro_batch_size=2)
    a = s1.forward_backward(data[:4], "cross_entropy")
    fwd = s1.forward(data[4:], "cross_entropy")  # must not add gradient
    b = s1.forward_backward(data[4:], "cross_entropy")
    e2 = PlainEngine(load_plain(tiny_path))
    c = TrainingSession(e2, micro_batch_size=3).forward_backward(data, "cross_entropy")
    assert abs(a.metrics["loss:sum"] + b.metrics["loss:sum"] - c.metrics["loss:sum"]) < 1e-4
    assert fwd.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-6)
    for x, y in zip(fwd.loss_fn_outputs, b.loss_fn_outputs):
        torch.testing.assert_close(x["logprobs"], y["logprobs"])
    assert_grads_close(grads(e1.model), grads(e2.model))


def test_outputs_not_shared_between_calls(plain):
    data = random_datums(3, "cross_entropy", seed=8)
    sess = TrainingSession(plain, micro_batch_size=2)
    first = sess.forward(data, "cross_entropy")
    second = sess.forward(data[:1], "cross_entropy")
    assert len(first.loss_fn_outputs) == 3 and len(second.loss_fn_outputs) == 1
    second.loss_fn_outputs[0]["logprobs"].add_(1.0)
    assert not torch.equal(first.loss_fn_outputs[0]["logprobs"], second.loss_fn_outputs[0]["logprobs"])


# ---- validation (before any forward) --------------------------------------------------------
def _sess():
    return TrainingSession(NoForwardEngine(), micro_batch_size=2)


def _ce(n=3, **over):
    inp = {"target_tokens": list(range(5, 5 + n)), "weights": [1.0] * n}
    inp.update(over)
    return Datum(list(range(10, 10 + n)), inp)


@pytest.mark.parametrize("bad,pattern", [
    (_ce(weights=[1.0, 2.0]), r"datum 1: loss_fn_inputs\['weights'\] has length 2, expected 3"),
    (_ce(target_tokens=[1, 2, 3, 4]), r"datum 1: loss_fn_inputs\['target_tokens'\] has length 4"),
    (Datum([10, 11, 12], {"target_tokens": [1, 2, 3]}), r"datum 1: .*missing required key 'weights'"),
    (_ce(target_tokens=[1, 2, 5000]), r"datum 1: loss_fn_inputs\['target_tokens'\]: token id out of range"),
    (_ce(weights=[1.0, float("nan"), 1.0]), r"datum 1: loss_fn_inputs\['weights'\]: values must be finite"),
    (_ce(target_tokens=[[1, 2], [3, 4], [5, 6]]), r"datum 1: loss_fn_inputs\['target_tokens'\]: must be 1-D"),
    (Datum([], {"target_tokens": [], "weights": []}), r"datum 1: model_input is empty"),
])
def test_validation_names_datum_and_key(bad, pattern):
    with pytest.raises(ValueError, match=pattern):
        _sess().forward_backward([_ce(), bad], "cross_entropy")


def test_validation_rl_keys_and_config():
    d = Datum([10, 11], {"target_tokens": [1, 2], "logprobs": [0.0, 0.0]})
    with pytest.raises(ValueError, match=r"datum 0: .*missing required key 'advantages' for loss_fn 'ppo'"):
        _sess().forward_backward([d], "ppo")
    with pytest.raises(ValueError, match=r"'beta'.*'ppo'"):
        _sess().forward_backward([d], "ppo", {"beta": 0.1})
    with pytest.raises(ValueError, match="gspo"):
        _sess().forward([d], "gspo")
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainingSession(NoForwardEngine(), micro_batch_size=0)


def test_adam_params_defaults():
    p = AdamParams()
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm) == (1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)
