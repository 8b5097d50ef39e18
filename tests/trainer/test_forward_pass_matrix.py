"""Which forward passes the trainer runs for each combination of reuse / use_rollout_logprobs /
KL loss, and the runtime guards of the reuse path. Engines and the rollout worker are fakes
(this tests the loop around them); the objectives and advantage estimators are the real ones."""
import dataclasses
import types

import pytest
import torch

from dsrl.config.schema import Config
from dsrl.data.types import user_prompt
from dsrl.errors import ConfigError, ReuseInvariantError
from dsrl.loss.types import LossInputs
from dsrl.rollout.vllm_engine import Completion
from dsrl.trainer import Trainer
from dsrl.validation.reuse import decide_reuse
from dsrl.validation.validate import validate


class FakeWorker:
    """Deterministic completions with alternating rewards so every group has signal."""

    def __init__(self):
        self.pushes = 0

    def generate(self, prompt_ids, *, n, temperature, top_p, max_tokens, show_progress=False, seeds=None):
        out = []
        for g, _ in enumerate(prompt_ids):
            out.append([Completion([5 + j, 6, 7][: 2 + (j % 2)], [-0.5, -0.25, -1.0][: 2 + (j % 2)], "stop",
                                   "1" if j % 2 else "0") for j in range(n)])
        return out

    def push_weights(self, state, step):
        self.pushes += 1
        return 0.0


class FakeEngine:
    """Records passes; runs the real objective on deterministic 'log-probs' with gradient."""

    def __init__(self, value=-0.7):
        self.value = value
        self.score_calls = 0
        self.train_batches = []
        self.steps = 0
        self.last_step_skipped = False

    def score(self, microbatches, progress=None):
        self.score_calls += 1
        return [torch.full(mb["targets"].shape, self.value) * mb["loss_mask"] for mb in microbatches]

    def forward_backward(self, mb, objective, config, reduction, *, reuse_training_logprobs=False, is_last=True):
        lp = (torch.full(mb["targets"].shape, -0.7) * mb["loss_mask"]).requires_grad_(True)
        fixed = {k: v for k, v in mb.items() if k not in ("input_ids", "attention_mask", "targets")}
        self.train_batches.append(dict(keys=set(mb), reuse=reuse_training_logprobs))
        out = objective.fn(LossInputs(log_probs=lp, mask=mb["loss_mask"], batch=fixed, config=config,
                                      reduce=reduction.build(mb["loss_mask"]), reuse_training_logprobs=reuse_training_logprobs))
        out.loss.backward()
        assert lp.grad is not None
        return out

    def optimizer_step(self):
        self.steps += 1
        return 1.0

    def state_dict_for_export(self):
        return {}

    def weights_pushed(self):
        self.pushes = getattr(self, "pushes", 0) + 1  # the weight sync tells the actor

    def export_named_tensors(self, **kwargs):
        return iter(())


def _cfg(**algo):
    cfg = Config()
    algo = {"n_samples_per_prompt": 4, "rollout_batch_size": 2, "global_batch_size": 8, **algo}
    cfg.algo = dataclasses.replace(cfg.algo, **algo)
    cfg.logger = dataclasses.replace(cfg.logger, tensorboard=False, plot=False, progress=False)
    cfg.trainer = dataclasses.replace(cfg.trainer, eval_before=False, eval_after=False, save_final=False)
    cfg.rollout = dataclasses.replace(cfg.rollout, sync_probe=False)  # fake worker: no engine to probe
    return cfg


class FakeSource:
    def sample_train(self, n, rng):
        return [user_prompt(f"q{i}", "1") for i in range(n)]


def _trainer(cfg, tmp_path, with_ref):
    validate(cfg)
    actor, ref = FakeEngine(), (FakeEngine() if with_ref else None)
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=0)
    t = Trainer(cfg, actor=actor, ref=ref, worker=FakeWorker(), tokenizer=tok, source=FakeSource(),
                verifier=lambda text, p: float(text == p.answer), prompt_ids_fn=lambda p: [1, 2, 3],
                decision=decide_reuse(cfg), run_dir=str(tmp_path))
    return t, actor, ref


# (reuse_logprobs, use_rollout_logprobs, use_kl_loss) -> (old pass runs, reuse flag in train)
MATRIX = [
    ("off", False, False, True, False),
    ("off", True, False, False, False),
    ("off", False, True, True, False),
    ("on", False, False, False, True),
    ("on", True, False, False, True),
    ("on", False, True, False, True),
    ("on", True, True, False, True),
    ("auto", False, False, False, True),
    ("auto", True, True, False, True),
]


@pytest.mark.parametrize("mode,rollout_lp,kl_loss,old_pass,reuse", MATRIX)
def test_forward_passes_per_combination(tmp_path, mode, rollout_lp, kl_loss, old_pass, reuse):
    kw = dict(reuse_logprobs=mode, use_rollout_logprobs=rollout_lp, use_kl_loss=kl_loss,
              kl_loss_coef=0.1 if kl_loss else 0.0)
    t, actor, ref = _trainer(_cfg(**kw), tmp_path, with_ref=kl_loss)
    m = t.step(1)
    assert actor.score_calls == int(old_pass)
    assert (ref.score_calls if ref else 0) == int(kl_loss)  # reference pass still runs for a KL loss
    assert actor.steps == 1 and t.worker.pushes == 1
    for b in actor.train_batches:
        assert b["reuse"] is reuse
        assert ("old_log_probs" in b["keys"]) is old_pass
        assert ("ref_log_probs" in b["keys"]) is kl_loss
    if not old_pass:
        assert m["timing/old_logprobs"] == 0.0
    if not kl_loss:
        assert m["timing/ref_logprobs"] == 0.0
    if rollout_lp:  # rollout log-probs (-0.5/-0.25/-1.0) != trainer's -0.7: a real ratio
        assert m["train/ppo_kl"] != 0.0


def test_auto_falls_back_when_unsafe(tmp_path):
    cfg = _cfg(reuse_logprobs="auto", global_batch_size=4)  # two optimizer steps per rollout
    d = decide_reuse(cfg)
    assert not d.reuse and d.run_old_pass and "algo.global_batch_size" in d.reason
    t, actor, _ = _trainer(cfg, tmp_path, with_ref=False)
    t.step(1)
    assert actor.score_calls == 1 and actor.steps == 2
    assert all(not b["reuse"] and "old_log_probs" in b["keys"] for b in actor.train_batches)


def test_runtime_guard_rejects_more_than_one_optimizer_step(tmp_path):
    cfg = _cfg(reuse_logprobs="auto", global_batch_size=4)
    t, actor, _ = _trainer(cfg, tmp_path, with_ref=False)
    # Bypass the validator: the stages that read the decision get the forged one.
    t.scoring.decision = t.policy.decision = dataclasses.replace(t.decision, reuse=True, run_old_pass=False)
    with pytest.raises(ReuseInvariantError, match="optimizer step"):
        t.step(1)
    assert actor.train_batches == [] and actor.score_calls == 0  # rejected before any forward


def test_runtime_guard_rejects_precomputed_actor_logprobs(tmp_path):
    cfg = _cfg(reuse_logprobs="on")
    t, actor, _ = _trainer(cfg, tmp_path, with_ref=False)
    t.scoring.decision = t.policy.decision = dataclasses.replace(t.decision, run_old_pass=True)  # a stale old pass
    with pytest.raises(ReuseInvariantError, match="old_log_probs"):
        t.step(1)
    assert actor.train_batches == [] and actor.score_calls == 0  # before the old pass itself


def test_on_with_blockers_fails_closed():
    with pytest.raises(ConfigError):
        validate(_cfg(reuse_logprobs="on", global_batch_size=4))


def test_opd_scores_the_teacher_and_keeps_the_old_pass(tmp_path):
    cfg = _cfg(reuse_logprobs="auto", use_opd=True, opd_kl_coef=0.5)
    cfg.model = dataclasses.replace(cfg.model, teacher_path="tiny")
    validate(cfg)
    d = decide_reuse(cfg)
    assert not d.reuse and "algo.use_opd" in d.reason
    actor, teacher = FakeEngine(), FakeEngine(value=-0.9)
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=0)
    t = Trainer(cfg, actor=actor, ref=None, teacher=teacher, worker=FakeWorker(), tokenizer=tok,
                source=FakeSource(), verifier=lambda text, p: float(text == p.answer),
                prompt_ids_fn=lambda p: [1, 2, 3], decision=d, run_dir=str(tmp_path))
    seen = {}
    real = t.actor.forward_backward

    def spy(mb, *a, **k):
        seen.setdefault("adv", []).append(mb["advantages"][mb["loss_mask"] > 0])
        return real(mb, *a, **k)
    t.actor.forward_backward = spy
    m = t.step(1)
    assert actor.score_calls == 1 and teacher.score_calls == 1 and m["timing/teacher_logprobs"] > 0
    # GRPO advantages are +-0.866 (group of 4 with rewards 0,1,0,1: centred +-0.5, unbiased std
    # 0.577); OPD subtracts opd_kl_coef * (student - teacher) = 0.5 * (-0.7 + 0.9) = 0.1 per token.
    adv = torch.cat(seen["adv"])
    assert torch.allclose((adv + 0.1).abs(), torch.full_like(adv, 0.5 / (0.5773502691896258 + 1e-6)), atol=1e-5)
    # The reverse KL reaches the logs: student - teacher = -0.7 - (-0.9) on every trained token.
    assert m["train/opd_reverse_kl"] == pytest.approx(0.2, abs=1e-6)


def test_gsm8k_is_a_selectable_prompt_source(tmp_path):
    """data.name=gsm8k: real GSM8K prompts flow through the loop and are scored by its verifier."""
    from dsrl.data.registry import build_source
    from dsrl.reward.registry import verifier_for_source

    cfg = _cfg(reuse_logprobs="on")
    cfg.data = dataclasses.replace(cfg.data, name="gsm8k")
    validate(cfg)
    source = build_source(cfg.data)
    verifier = verifier_for_source(source)
    last_answers = []

    class Recording:  # the real source, remembering the answers of the prompts it handed out
        def sample_train(self, n, rng):
            out = source.sample_train(n, rng)
            last_answers[:] = [p.answer for p in out]
            return out

    class EchoAnswerWorker(FakeWorker):  # odd samples of each group answer correctly
        def generate(self, prompt_ids, **kw):
            groups = super().generate(prompt_ids, **kw)
            for g, answer in zip(groups, last_answers):
                for j, c in enumerate(g):
                    c.text = f"The answer is {answer}." if j % 2 else "no idea"
            return groups

    t = Trainer(cfg, actor=FakeEngine(), ref=None, worker=EchoAnswerWorker(),
                tokenizer=types.SimpleNamespace(pad_token_id=0, eos_token_id=0), source=Recording(),
                verifier=verifier, prompt_ids_fn=lambda p: [1, 2, 3], decision=decide_reuse(cfg),
                run_dir=str(tmp_path))
    m = t.step(1)
    assert m["reward/mean"] == 0.5
    assert all(p.meta["split"] == "train" for p in source.sample_train(4, 0))


def test_a_work_unit_may_name_its_own_objective(tmp_path, monkeypatch):
    """A hook sets loss_fn/loss_fn_config on a microbatch: that objective and config apply to it."""
    import sys

    calls = []

    def pick_cispo(mb):
        mb["loss_fn"] = "cispo"
        mb["loss_fn_config"] = {"eps_clip_high": 3.0}

    mod = types.ModuleType("dsrl_test_hooks")
    mod.pick_cispo = pick_cispo
    monkeypatch.setitem(sys.modules, "dsrl_test_hooks", mod)
    cfg = _cfg(reuse_logprobs="off")
    cfg.trainer = dataclasses.replace(cfg.trainer, before_train_step_hooks=["dsrl_test_hooks.pick_cispo"])
    t, actor, _ = _trainer(cfg, tmp_path, with_ref=False)
    real = actor.forward_backward

    def spy(mb, objective, config, reduce, **kw):
        calls.append((objective.name, config["eps_clip_high"], "loss_fn" in mb))
        return real(mb, objective, config, reduce, **kw)
    actor.forward_backward = spy
    t.step(1)
    assert calls and all(c == ("cispo", 3.0, False) for c in calls)
    bad = _cfg(reuse_logprobs="off")
    t2, _, _ = _trainer(bad, tmp_path, with_ref=False)
    with pytest.raises(ValueError, match="no_such_key"):
        t2.policy._objective_for({"loss_fn": "ppo", "loss_fn_config": {"no_such_key": 1}, "sample_indices": [0]})


class EqualRewardWorker(FakeWorker):
    """Every completion of every group gets the same reward: all advantages are zero."""

    def generate(self, prompt_ids, **kw):
        groups = super().generate(prompt_ids, **kw)
        for g in groups:
            for c in g:
                c.text = "1"
        return groups


def test_a_step_with_every_sample_skipped_logs_no_fabricated_metrics(tmp_path):
    cfg = _cfg(reuse_logprobs="on")
    t, actor, _ = _trainer(cfg, tmp_path, with_ref=False)
    t.worker = t.rollout.worker = EqualRewardWorker()  # the rollout stage generates
    m = t.step(1)
    assert t.scoring.skip_zero_advantage and m["train/trained_fraction"] == 0.0
    # Never measured: absent, not 0.
    for key in ("train/ppo_kl", "train/pg_clipfrac", "train/logprob", "rollout/logprob_diff"):
        assert key not in m, key
    # The loss is known exactly (every advantage is 0) and the optimizer still steps (Adam's
    # moments move the weights as they would in the unskipped step).
    assert m["train/loss"] == 0.0 and actor.steps == 1


def test_tinker_objective_in_the_rl_loop(tmp_path):
    """tinker:ppo driven by the loop: rollout log-probs are the sampler log-probs q, the objective
    gets its own config keys only, raw-sum loss; no old-policy pass."""
    cfg = _cfg(reuse_logprobs="auto", policy_loss="tinker:ppo", loss_agg_mode="sum",
               loss_fn_config={"clip_high_threshold": 1.3})
    t, actor, _ = _trainer(cfg, tmp_path, with_ref=False)
    assert not t.decision.run_old_pass
    seen = []
    real = actor.forward_backward

    def spy(mb, objective, config, reduce, **kw):
        seen.append((dict(config), torch.equal(mb["sampling_logprobs"], mb["rollout_log_probs"])))
        return real(mb, objective, config, reduce, **kw)
    actor.forward_backward = spy
    m = t.step(1)
    assert actor.score_calls == 0
    assert seen and all(c == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3} and same for c, same in seen)
    # By hand: FakeWorker gives sample j of a group tokens with q = [-0.5, -0.25, -1.0][:2 + j % 2] and
    # reward j % 2 (text "1" for odd j); the fake trainer log-prob is -0.7 on every token; GRPO
    # advantages are +-0.5 / (std 0.57735 + 1e-6); loss = -sum_tokens min(r A, clip(r, 0.8, 1.3) A).
    import math
    a = 0.5 / (0.5773502691896258 + 1e-6)
    total = 0.0
    for _group in range(2):
        for j in range(4):
            adv = a if j % 2 else -a
            for q in [-0.5, -0.25, -1.0][: 2 + j % 2]:
                r = math.exp(-0.7 - q)
                total += -min(r * adv, min(max(r, 0.8), 1.3) * adv)
    assert m["train/loss:sum"] == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("algo,exact", [
    ({}, True),
    ({"skip_zero_variance_groups": False}, False),
    ({"policy_loss": "gspo"}, True),
    ({"policy_loss": "cispo"}, True),
    ({"policy_loss": "sft"}, False),
    ({"policy_loss": "tinker:ppo"}, True),
    ({"policy_loss": "tinker:dro"}, False),
    ({"entropy_coef": 0.01}, False),
    ({"use_kl_loss": True, "kl_loss_coef": 0.1}, False),
    ({"use_tis": True}, True),
    ({"use_tis": True, "tis_function": "icepop"}, True),
    ({"use_tis": True, "tis_function": "mis"}, False),  # mis_batch_normalize defaults to true
    ({"use_tis": True, "tis_function": "mis", "mis_batch_normalize": False}, True),
    ({"use_tis": True, "tis_function": "tests.my_tis.fn"}, False),
])
def test_zero_advantage_skip_is_declared_exact_only_where_it_is(algo, exact):
    from dsrl.loss.skip import zero_advantage_skip

    skip, reason = zero_advantage_skip(_cfg(**algo))
    assert skip is exact and reason


def test_greedy_eval_uses_reward_eval_fn(tmp_path):
    """reward.eval_fn: the greedy eval scores with that verifier, the training reward otherwise.
    Every eval answer is wrong but stated ("The answer is <reference + 1>."): gsm8k_format pays
    0.1 for it, gsm8k (correctness only) 0."""
    from dsrl.data.registry import build_source
    from dsrl.reward.registry import get_verifier

    cfg = _cfg(reuse_logprobs="on")
    cfg.data = dataclasses.replace(cfg.data, name="gsm8k", num_eval=4)
    validate(cfg)
    source = build_source(cfg.data)
    answers = [p.answer for p in source.eval_set(4)]

    class StatedWrongAnswers(FakeWorker):
        def generate(self, prompt_ids, *, n, **kw):
            assert n == 1 and len(prompt_ids) == len(answers)
            return [[Completion([5], [0.0], "stop", f"The answer is {int(a) + 1}.")] for a in answers]

    def trainer(eval_verifier):
        return Trainer(cfg, actor=FakeEngine(), ref=None, worker=StatedWrongAnswers(),
                       tokenizer=types.SimpleNamespace(pad_token_id=0, eos_token_id=0), source=source,
                       verifier=get_verifier("gsm8k_format"), prompt_ids_fn=lambda p: [1, 2, 3],
                       decision=decide_reuse(cfg), run_dir=str(tmp_path), eval_verifier=eval_verifier)

    assert trainer(None).evaluate()["eval/accuracy"] == pytest.approx(0.1)
    assert trainer(get_verifier("gsm8k")).evaluate()["eval/accuracy"] == 0.0
