"""Reuse's runtime guards on the engine read runtime evidence, not the config decision: each
fires on a real tiny DeepSpeed engine when the training forward is not the rollout policy's
old-policy pass (an optimizer step since the last push, a random train-mode forward, a forward
without gradient), and stays silent on the product path."""
import pytest
import torch

from dsrl.actor.engine import ActorEngine
from dsrl.errors import ReuseInvariantError
from dsrl.loss.registry import get_objective
from dsrl.loss.types import Reduction
from dsrl.testing import random_microbatch

pytestmark = pytest.mark.slow

PPO = get_objective("ppo")


@pytest.fixture()
def eng(tiny_model_path):
    torch.manual_seed(0)
    return ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=3, lr=1e-3)


def _reuse_step(eng, **kw):
    mb = random_microbatch(0, [(5, 4), (7, 2)])
    return eng.forward_backward(mb, PPO, {}, Reduction("token-mean", global_tokens=float(mb["loss_mask"].sum())),
                                reuse_training_logprobs=True, **kw)


def test_an_optimizer_step_since_the_last_push_refuses_reuse(eng):
    _reuse_step(eng)
    eng.optimizer_step()  # a second step on the same rollout, or a push that never happened
    with pytest.raises(ReuseInvariantError, match=r"1 optimizer step\(s\) since the rollout engine got these weights"):
        _reuse_step(eng)
    eng.weights_pushed()  # the rollout engine now holds the stepped weights
    _reuse_step(eng)


def test_a_random_train_mode_forward_refuses_reuse_and_eval_mode_does_not(eng):
    attn = eng.module.model.layers[0].self_attn
    attn.attention_dropout = 0.1  # what a model's config.json may set; train mode makes it live
    with pytest.raises(ReuseInvariantError, match=r"model\.layers\.0\.self_attn \(LlamaAttention attention_dropout=0\.1\)"):
        _reuse_step(eng)
    attn.eval()  # this module's forward is deterministic again
    _reuse_step(eng)
    attn.train()
    attn.attention_dropout = 0.0
    _reuse_step(eng)


def test_reuse_needs_a_training_forward_with_gradient(eng):
    with pytest.raises(ReuseInvariantError, match="forward_only"):
        _reuse_step(eng, forward_only=True)
    with torch.no_grad(), pytest.raises(ReuseInvariantError, match="carry no gradient"):
        _reuse_step(eng)


def test_the_weight_push_resets_the_count(tiny_model_path, eng):
    """dsrl.rollout.weight_sync.WeightSync.push tells the actor its weights reached the engine."""
    import dataclasses

    from dsrl.config.schema import RolloutConfig
    from dsrl.rollout.weight_sync import WeightSync

    class Worker:
        def push_weights(self, buckets, step):
            self.step = step

    sync = WeightSync(eng, Worker(), dataclasses.replace(RolloutConfig(), sync_probe=False))
    _reuse_step(eng)
    eng.optimizer_step()
    assert eng.steps_since_push == 1
    sync.push(1)
    assert eng.steps_since_push == 0
    _reuse_step(eng)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_hook_that_perturbs_the_weights_after_the_push_refuses_reuse(tiny_model_path, zero_stage):
    """What the rollout sampled is the pushed weights; a hook (trainer.before_train_step_hooks, or
    any code) that edits a weight in place before the training forward makes reuse wrong. The
    engine compares the parameters' in-place version counters with those at the push."""
    import deepspeed

    torch.manual_seed(0)
    eng = ActorEngine(str(tiny_model_path), zero_stage=zero_stage, micro_batch_size=3, lr=1e-3,
                      persistence_threshold=0)
    eng.weights_pushed()
    _reuse_step(eng)  # forward and backward are no edits
    eng.optimizer_step()
    eng.weights_pushed()
    name, param = next(iter(eng.module.named_parameters()))
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0) if zero_stage == 3 else torch.no_grad():
        with torch.no_grad():
            param.add_(1e-3)  # the perturbation (kept under ZeRO-3: modifier_rank=0)
    with pytest.raises(ReuseInvariantError, match=rf"{name} \(and 0 more\) was modified in place"):
        _reuse_step(eng)
    eng.weights_pushed()  # pushed again: the engine now samples from the perturbed weights
    _reuse_step(eng)
