"""On the real DeepSpeed engine (tiny Llama, ZeRO 0 and 2): the standalone old-policy pass and
the training forward give bit-identical log-probs, so reusing the detached training log-probs
gives exactly the loss, gradients and metrics of the standalone-pass path."""
import pytest
import torch

from dsrl.actor.engine import ActorEngine
from dsrl.loss.registry import get_objective
from dsrl.loss.types import Reduction
from dsrl.testing import random_microbatch

pytestmark = pytest.mark.slow


def _batch(seed=0):
    """Three random samples with random advantages (dsrl.testing.random_microbatch)."""
    return random_microbatch(seed, [(5, 4), (7, 2), (4, 6)])


def _grads(engine):
    from deepspeed.utils import safe_get_full_grad
    return [safe_get_full_grad(p).clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("zero_stage", [0, 2])
@pytest.mark.parametrize("objective,cfg", [("ppo", {}), ("gspo", {}), ("ppo", {"use_tis": True})],
                         ids=["grpo", "gspo", "grpo+tis"])
def test_reuse_equals_standalone_pass_bit_exactly(tiny_model_path, zero_stage, objective, cfg):
    results = []
    for reuse in (False, True):
        torch.manual_seed(0)
        eng = ActorEngine(str(tiny_model_path), zero_stage=zero_stage, micro_batch_size=3, lr=1e-3)
        mb = _batch()
        if not reuse:
            (old,) = eng.score([mb])  # the real standalone pass (eval mode, no grad)
            mb["old_log_probs"] = old
        reduce = Reduction("token-mean", global_tokens=float(mb["loss_mask"].sum()))
        out = eng.forward_backward(mb, get_objective(objective), cfg, reduce, reuse_training_logprobs=reuse)
        grads = _grads(eng)
        eng.optimizer_step()
        params = [p.detach().clone() for p in eng.module.parameters()]
        results.append((out, grads, params))
    (a, ga, pa), (b, gb, pb) = results
    # Same microbatch, same shapes and kernels: only train/eval mode and autograd differ (dropout 0).
    assert torch.equal(a.loss, b.loss)
    assert set(a.metrics) == set(b.metrics)
    for k in a.metrics:
        assert torch.equal(torch.as_tensor(a.metrics[k]), torch.as_tensor(b.metrics[k])), k
    assert any(g.abs().sum() > 0 for g in ga)
    for x, y in zip(ga, gb):
        assert torch.equal(x, y)
    for x, y in zip(pa, pb):  # and the optimizer step lands on the same weights
        assert torch.equal(x, y)
