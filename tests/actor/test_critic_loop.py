"""PPO with a critic (algo.advantage_estimator=gae) through the product's own build and loop:
dsrl.main.build composes the engines (actor, critic) and the Trainer; Trainer.train_on runs the
critic's values pass, GAE and, per optimizer step, the critic's value-loss step beside the actor's.
Only observers are added (spies that call the real methods): the values the loop fed GAE are
checked against an independent forward of the critic, the advantages/returns against a hand-rolled
GAE, the logged value loss and explained variance against numbers recomputed from those, and each
optimizer step moves only its own model. Tiny model, rollout.backend=hf (the actor's module
generates), float32, ZeRO-0, 1 rank."""
from __future__ import annotations

import os

import pytest
import torch
from hydra import compose, initialize_config_dir

import dsrl.stages.scoring as scoring_module

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
GAMMA, LAMBDA = 0.9, 0.95


def _tiny(model_path, *extra) -> list:
    return [f"model.path={model_path}", "model.dtype=float32", "model.attn_implementation=eager",
            "rollout.backend=hf", "rollout.dtype=float32", "rollout.max_new_tokens=6", "rollout.timeout_s=3600",
            "algo.advantage_estimator=gae", f"algo.gamma={GAMMA}", f"algo.gae_lambda={LAMBDA}",
            "algo.rollout_batch_size=2", "algo.n_samples_per_prompt=3", "algo.global_batch_size=6",
            "actor.micro_batch_size=3", "actor.forward_micro_batch_size=3", "actor.lr=1e-3", "critic.lr=1e-3",
            "actor.num_threads=2", "trainer.eval_before=false", "trainer.eval_after=false",
            "trainer.save_final=false", "trainer.save_every=0", "logger.tensorboard=false", "logger.plot=false",
            "logger.progress=false", *extra]


def _build(run_dir, overrides):
    """The real dsrl.main.build on a composed config (validation, engines, critic, Trainer)."""
    from dsrl.main import build

    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        node = compose(config_name="config", overrides=list(overrides))
    os.makedirs(run_dir, exist_ok=True)
    return build(node, str(run_dir))


def _snap(module) -> list:
    return [p.detach().clone() for p in module.parameters()]


def _same(module, snap) -> bool:
    return all(torch.equal(p, q) for p, q in zip(module.parameters(), snap))


def _reference_values(critic, sample) -> torch.Tensor:
    """V at each response token from a plain forward of the critic's module on the one sequence
    (no batching, no padding): target column t reads the hidden state at position t."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        v = critic.module(input_ids=ids, attention_mask=torch.ones_like(ids))
    p = len(sample.prompt_ids)
    return v[0, p - 1: p - 1 + len(sample.response_ids)].double()


def _hand_gae(reward: float, values: list) -> tuple:
    """GAE of one sample by the textbook recursion (reward on the last token, V after it 0)."""
    n = len(values)
    adv = [0.0] * n
    nxt_a = 0.0
    for t in range(n - 1, -1, -1):
        nxt_v = values[t + 1] if t + 1 < n else 0.0
        u = reward if t == n - 1 else 0.0
        delta = u + GAMMA * nxt_v - values[t]
        adv[t] = nxt_a = delta + GAMMA * LAMBDA * nxt_a
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.slow
def test_ppo_with_critic_in_the_real_loop(tiny_model_path, tmp_path, monkeypatch):
    trainer = _build(tmp_path / "run", _tiny(tiny_model_path, "trainer.total_steps=2"))
    actor, critic = trainer.actor, trainer.critic
    assert critic is not None and type(critic).__name__ == "CriticEngine"
    assert trainer.decision.reuse and "the critic of algo.advantage_estimator=gae does not change this" in \
        trainer.decision.reason  # actor reuse stays exact; the run log says so
    # Two models, no shared storage: a gradient of one can never land in the other.
    assert not {p.data_ptr() for p in actor.module.parameters()} & {p.data_ptr() for p in critic.module.parameters()}

    steps, order = [], []
    real_advantages, real_train_on = scoring_module.compute_advantages, trainer.train_on
    real_critic_step, real_actor_step = trainer.critic_update.step, trainer.policy.step

    def advantages_spy(data, config):
        out = real_advantages(data, config)
        steps[-1]["data"] = {k: [t.double().clone() for t in data[k]] for k in ("values", "advantages", "returns")}
        return out

    def train_on_spy(samples, step):
        steps.append({"samples": samples, "v_ref": [_reference_values(critic, s) for s in samples]})
        steps[-1]["metrics"] = real_train_on(samples, step)
        return steps[-1]["metrics"]

    def critic_step_spy(samples, fields, *, step):
        a0, c0 = _snap(actor.module), _snap(critic.module)
        out = real_critic_step(samples, fields, step=step)
        assert _same(actor.module, a0) and not _same(critic.module, c0)  # the value loss moves only the critic
        order.append("critic")
        return out

    def actor_step_spy(samples, token_fields, *, all_samples, step):
        c0, a0 = _snap(critic.module), _snap(actor.module)
        out = real_actor_step(samples, token_fields, all_samples=all_samples, step=step)
        assert _same(critic.module, c0) and not _same(actor.module, a0)  # the policy loss moves only the actor
        order.append("actor")
        return out

    monkeypatch.setattr(scoring_module, "compute_advantages", advantages_spy)
    trainer.train_on, trainer.critic_update.step, trainer.policy.step = train_on_spy, critic_step_spy, actor_step_spy
    trainer.fit()

    assert order == ["critic", "actor"] * 2 and len(steps) == 2
    # The critic packed like the actor: shared-prompt rows (critic.shared_prompt=null follows
    # actor.shared_prompt=auto, on for the tiny Llama), so the values checked below came through them.
    decided = critic._shared_prompt_decision
    assert decided.on and "critic.shared_prompt=null, so actor.shared_prompt=auto" in decided.reason
    for rec, logged in zip(steps, trainer.logger.history):
        d, samples = rec["data"], rec["samples"]
        # The values GAE read are the critic's, before it trained on this rollout.
        for v, ref in zip(d["values"], rec["v_ref"]):
            torch.testing.assert_close(v, ref, rtol=0, atol=1e-5)
        # GAE and the returns against the hand recursion on those values.
        for s, v, adv, ret in zip(samples, d["values"], d["advantages"], d["returns"]):
            hand_adv, hand_ret = _hand_gae(float(s.reward), v.tolist())
            torch.testing.assert_close(adv, torch.tensor(hand_adv, dtype=torch.float64), rtol=0, atol=1e-6)
            torch.testing.assert_close(ret, torch.tensor(hand_ret, dtype=torch.float64), rtol=0, atol=1e-6)
        # One critic step per rollout on the values pass's microbatches: V = V_old, no clip, so the
        # token-mean value loss is 0.5 * mean (V - R)^2 and EV = 1 - Var(R - V) / Var(R).
        v, r = torch.cat(d["values"]), torch.cat(d["returns"])
        assert logged["critic/value_loss"] == pytest.approx(float(0.5 * ((v - r) ** 2).mean()), rel=1e-4)
        ev = 1.0 - float(torch.var(r - v, unbiased=False) / torch.var(r, unbiased=False))
        assert logged["critic/explained_variance"] == pytest.approx(ev, abs=1e-4)
        assert logged["critic/value_clipfrac"] == 0.0 and logged["critic/skipped_steps"] == 0.0
        assert logged["critic/grad_norm"] > 0 and logged["train/grad_norm"] > 0
        assert logged["timing/critic_values"] > 0 and logged["timing/critic_train"] > 0
        assert logged["timing/old_logprobs"] == 0.0  # reuse: no old-policy pass, the values pass still runs


@pytest.mark.slow
def test_critic_state_is_checkpointed_and_restored_bit_identically(tiny_model_path, tmp_path):
    """Run A trains one step and checkpoints it; run B resumes from A's folder through dsrl.main.build
    (trainer.resume_from): B's critic weights and AdamW moments equal A's bit for bit, and differ
    from a fresh critic's (so the comparison can fail)."""
    a = _build(tmp_path / "a", _tiny(tiny_model_path, "trainer.total_steps=1", "trainer.save_every=1"))
    a.fit()
    folder = tmp_path / "a" / "checkpoints" / "step-000001"
    assert (folder / "critic").is_dir() and (folder / "COMPLETE.json").exists()
    trained = _snap(a.critic.module)
    opt_a = a.critic.optimizer.state_dict()["state"]

    b = _build(tmp_path / "b", _tiny(tiny_model_path, "trainer.total_steps=2", f"trainer.resume_from={tmp_path / 'a'}"))
    assert b.start_step == 1
    assert _same(b.critic.module, trained)
    opt_b = b.critic.optimizer.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and opt_a
    for k in opt_a:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(opt_a[k][name]), torch.as_tensor(opt_b[k][name])), (k, name)

    fresh = _build(tmp_path / "c", _tiny(tiny_model_path, "trainer.total_steps=1"))
    assert not _same(fresh.critic.module, trained)


@pytest.mark.slow
def test_each_optimizer_step_trains_the_critic_on_its_own_slice(tiny_model_path, tmp_path, monkeypatch):
    """algo.global_batch_size = half the rollout: two optimizer steps per rollout, each a critic step
    on its half with that half's returns and values-pass V_old (no reuse: the old-policy pass runs)."""
    trainer = _build(tmp_path / "run", _tiny(tiny_model_path, "trainer.total_steps=1", "algo.global_batch_size=3"))
    assert trainer.steps_per_rollout == 2 and not trainer.decision.reuse
    seen, calls = {}, []
    real_advantages, real_critic_step = scoring_module.compute_advantages, trainer.critic_update.step

    def advantages_spy(data, config):
        out = real_advantages(data, config)
        seen.update({k: [t.clone() for t in data[k]] for k in ("values", "returns")})
        return out

    def critic_step_spy(samples, fields, *, step):
        calls.append((list(samples), {k: [t.clone() for t in v] for k, v in fields.items()}))
        return real_critic_step(samples, fields, step=step)

    real_train_on = trainer.train_on

    def train_on_spy(samples, step):
        seen["samples"] = list(samples)
        return real_train_on(samples, step)

    monkeypatch.setattr(scoring_module, "compute_advantages", advantages_spy)
    trainer.train_on, trainer.critic_update.step = train_on_spy, critic_step_spy
    trainer.fit()
    assert len(calls) == 2
    for k, (samples, fields) in enumerate(calls):
        lo, hi = 3 * k, 3 * k + 3
        assert all(a is b for a, b in zip(samples, seen["samples"][lo:hi], strict=True))
        for name, key in (("returns", "returns"), ("old_values", "values")):
            assert all(torch.equal(a, b) for a, b in zip(fields[name], seen[key][lo:hi], strict=True))
    assert trainer.logger.history[0]["timing/old_logprobs"] > 0
