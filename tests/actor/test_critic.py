"""The critic (dsrl.actor.critic) on real tiny DeepSpeed engines (random-init Llama, float32):
it starts from the policy's backbone; its values are aligned like the actor's log-probs (column t
is the state from which token t+1 is generated), also in the shared-prompt layout; ZeRO-0 and
ZeRO-3 give the same value-loss gradient (equal to autograd on a plain transformers model) and
step; and a value-loss step moves only the critic while a policy step moves only the actor
(gradients and parameter deltas checked on both engines)."""
from __future__ import annotations

import pytest
import torch

from dsrl.actor.batch import Sample, collate, masked_rows
from dsrl.actor.critic import CriticEngine
from dsrl.actor.engine import ActorEngine
from dsrl.loss.advantages import compute_advantages
from dsrl.loss.registry import get_objective
from dsrl.loss.types import Reduction
from dsrl.loss.value import get_value_loss

pytestmark = pytest.mark.slow  # ~20 s per engine build on 2 shared cores

CFG = {"value_clip": 0.2, "value_loss_coef": 1.0, "gamma": 1.0, "gae_lambda": 0.95}


def _samples(seed=0, shape=((5, 4), (7, 2), (4, 6))):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(shape):
        ids = torch.randint(10, 1000, (p + r,), generator=g).tolist()
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], rollout_log_probs=[0.0] * r, group=0, index=i,
                          reward=float(i % 2)))
    return out


def _critic(path, zero_stage=0):
    torch.manual_seed(0)
    # lr 1, Adam eps 10: the first step is ~ -g / 10, linear in the gradient (tests/trainer/_real_engine.py).
    return CriticEngine(str(path), zero_stage=zero_stage, micro_batch_size=3, lr=1.0, eps=10.0, grad_clip=0.0)


def _train_batch(critic, samples):
    """A microbatch carrying returns and old_values as the trainer would build it: the critic's
    values pass, then GAE (gamma 1, lambda 0.95) from the samples' rewards."""
    mb = collate(samples, pad_id=0)
    (old,) = critic.values([mb])
    rows = masked_rows(old, mb["loss_mask"])
    data = {"rewards": torch.tensor([s.reward for s in samples]), "values": rows,
            "loss_mask": [torch.ones(len(s.response_ids)) for s in samples]}
    compute_advantages(data, {**CFG, "advantage_estimator": "gae"})
    return collate(samples, 0, {"old_values": rows, "returns": data["returns"],
                                "advantages": data["advantages"]})


def _token_mean(mb):
    return Reduction("token-mean", global_tokens=float(mb["loss_mask"].sum()))


def _reference_value_grads(model_path, samples, mb, *, head):
    """d(token-mean clipped value loss)/d(params) by autograd on a plain model: AutoModel + a
    Linear head holding `head` (the critic's weight and bias before its step)."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="eager")
    lin = torch.nn.Linear(backbone.config.hidden_size, 1)
    with torch.no_grad():
        lin.weight.copy_(head[0])
        lin.bias.copy_(head[1])
    n = float(mb["loss_mask"].sum())
    loss = 0.0
    for i, s in enumerate(samples):
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        P, R = len(s.prompt_ids), len(s.response_ids)
        v = lin(backbone(input_ids=ids).last_hidden_state[0, P - 1:P - 1 + R]).squeeze(-1)
        ret, old = mb["returns"][i, P - 1:P - 1 + R], mb["old_values"][i, P - 1:P - 1 + R]
        for t in range(R):
            v_clip = old[t] + torch.clamp(v[t] - old[t], -CFG["value_clip"], CFG["value_clip"])
            loss = loss + 0.5 * torch.maximum((v[t] - ret[t]) ** 2, (v_clip - ret[t]) ** 2) / n
    loss.backward()
    out = {f"backbone.{k}": p.grad for k, p in backbone.named_parameters()}
    out.update({"value_head.weight": lin.weight.grad, "value_head.bias": lin.bias.grad})
    return out


def _full_params(critic):
    with critic.full_parameters():  # gathered under ZeRO-3
        return [p.detach().clone() for p in critic.module.parameters()]


@pytest.fixture(scope="module")
def critic0(tiny_model_path):
    return _critic(tiny_model_path, 0)


def test_backbone_is_the_policys_and_values_align_with_target_columns(critic0, tiny_model_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    mine = dict(critic0.module.backbone.named_parameters())
    theirs = dict(policy.model.named_parameters())
    assert set(mine) == set(theirs)
    for name, p in theirs.items():
        assert torch.equal(mine[name].detach(), p.detach()), name
    samples = _samples()
    mb = collate(samples, pad_id=0)
    (values,) = critic0.values([mb])
    w, b = critic0.module.value_head.weight.detach(), critic0.module.value_head.bias.detach()
    assert w.abs().sum() > 0
    for i, s in enumerate(samples):
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        with torch.no_grad():
            hidden = policy.model(input_ids=ids).last_hidden_state[0]  # unpadded, alone
        P, R = len(s.prompt_ids), len(s.response_ids)
        # Response token k is generated from the state at position P-1+k: column P-1+k.
        expected = (hidden[P - 1:P - 1 + R] @ w.T).squeeze(-1) + b
        torch.testing.assert_close(values[i, P - 1:P - 1 + R], expected, rtol=1e-5, atol=1e-6)
        assert values[i, :P - 1].abs().sum() == 0 and values[i, P - 1 + R:].abs().sum() == 0  # off the mask
    # Causality: changing response token 2 of sample 0 (position P+2) leaves columns <= P+1 as they
    # were (those states do not contain it) and changes column P+2 (the state after it). Like is
    # compared with like: the same batch, same shape, only that one token differs, so every kernel
    # runs the same blocking and reduction order; the earlier columns must then be equal bit for bit
    # (a masked key adds exp(-inf) * v = 0 exactly). A batch of another shape may round differently
    # (oneDNN picks its blocking by shape: a 1-row batch differed from the 3-row one on AMX).
    s = samples[0]
    changed = Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids[:2] + [7] + s.response_ids[3:],
                     rollout_log_probs=s.rollout_log_probs, group=0, index=0)
    assert changed.response_ids != s.response_ids
    (v2,) = critic0.values([collate([changed] + samples[1:], pad_id=0)])
    assert v2.shape == values.shape
    P = len(s.prompt_ids)
    assert torch.equal(v2[0, :P + 2], values[0, :P + 2])
    assert v2[0, P + 2] != values[0, P + 2]
    assert torch.equal(v2[1:], values[1:])  # the other rows never see row 0


def test_shared_prompt_layout_gives_the_dense_values(critic0):
    """A group's samples packed as one shared-prompt row (dsrl.actor.shared_prompt) read the same
    values as the dense layout, response token by response token."""
    from dsrl.actor.shared_prompt import collate_shared_prompt

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(10, 1000, (6,), generator=g).tolist()
    samples = [Sample(prompt_ids=prompt, response_ids=torch.randint(10, 1000, (r,), generator=g).tolist(),
                      rollout_log_probs=[0.0] * r, group=0, index=i) for i, r in enumerate((3, 5, 1))]
    dense = collate(samples, pad_id=0)
    shared = collate_shared_prompt(samples, 0)
    (vd,), (vs,) = critic0.values([dense]), critic0.values([shared])
    for a, b in zip(masked_rows(vd, dense["loss_mask"]), masked_rows(vs, shared["loss_mask"])):
        assert a.shape == b.shape and a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_zero0_and_zero3_give_the_same_value_gradient_and_step(critic0, tiny_model_path):
    from deepspeed.utils import safe_get_full_grad

    critic3 = _critic(tiny_model_path, 3)
    samples = _samples(seed=1)
    results = []
    for critic in (critic0, critic3):
        mb = _train_batch(critic, samples)
        before = _full_params(critic)
        out = critic.forward_backward(mb, get_value_loss("clipped"), CFG, _token_mean(mb))
        grads = [safe_get_full_grad(p).clone() for p in critic.module.parameters()]
        critic.optimizer_step()
        after = _full_params(critic)
        results.append((mb, out, grads, [a - b for a, b in zip(after, before)], before))
    (mb0, out0, g0, d0, p0), (mb3, out3, g3, d3, _) = results
    # Independent reference for the ZeRO-0 gradient: a plain transformers backbone with the same
    # head, each sample unpadded, the clipped value loss written out token by token.
    ref_grads = _reference_value_grads(tiny_model_path, samples, mb0, head=p0[-2:])
    names = [n for n, _ in critic0.module.named_parameters()]
    assert set(names) == set(ref_grads)
    for name, g in zip(names, g0):
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    torch.testing.assert_close(mb0["returns"], mb3["returns"], rtol=0, atol=1e-6)  # same values pass
    torch.testing.assert_close(out0.loss, out3.loss, rtol=1e-6, atol=1e-7)
    assert out0.loss > 0
    assert len(g0) == len(g3) and any(g.abs().sum() > 0 for g in g0[:-2])  # the backbone gets gradient too
    for x, y in zip(g0, g3):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)
    # Adam's first step is -lr * g / (|g| + eps); with eps = 10 >> |g| it is ~ -g / 10, linear in the
    # gradient, so the steps agree as closely as the gradients do.
    assert max(float(d.abs().max()) for d in d0) > 1e-4
    for x, y in zip(d0, d3):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-8)


def test_value_loss_moves_only_the_critic_and_policy_loss_only_the_actor(critic0, tiny_model_path):
    """A real critic and a real actor side by side: the critic's value-loss step leaves the actor
    without gradient and unchanged; the actor's PPO step on the GAE advantages leaves the critic
    without gradient and unchanged; each engine's own parameters do move."""
    torch.manual_seed(0)
    actor = ActorEngine(str(tiny_model_path), zero_stage=0, micro_batch_size=3, lr=1e-3)
    samples = _samples(seed=2)
    mb = _train_batch(critic0, samples)
    assert not mb["advantages"].requires_grad and not mb["returns"].requires_grad
    snap = lambda eng: [p.detach().clone() for p in eng.module.parameters()]  # noqa: E731
    actor_before, critic_before = snap(actor), snap(critic0)

    metrics = critic0.train_step([mb], CFG, _token_mean(mb))
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in actor.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(snap(actor), actor_before))
    critic_after = snap(critic0)
    assert any(not torch.equal(a, b) for a, b in zip(critic_after[:-2], critic_before[:-2]))  # backbone moved
    assert not torch.equal(critic_after[-2], critic_before[-2])  # head moved
    assert metrics["critic/value_loss"] > 0 and metrics["critic/grad_norm"] > 0
    assert {"critic/value_clipfrac", "critic/explained_variance", "critic/values", "critic/returns"} <= set(metrics)

    policy_mb = {k: v for k, v in mb.items() if k not in ("returns", "old_values")}
    policy_mb["old_log_probs"] = actor.score([policy_mb])[0]
    actor.forward_backward(policy_mb, get_objective("ppo"), {}, _token_mean(policy_mb))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.module.parameters())
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in critic0.module.parameters())
    actor.optimizer_step()
    assert any(not torch.equal(a, b) for a, b in zip(snap(actor), actor_before))
    assert all(torch.equal(a, b) for a, b in zip(snap(critic0), critic_after))
