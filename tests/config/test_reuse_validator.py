"""The fail-closed reuse rule set: every incompatible option is rejected by name (all of them in
one error), every compatible combination passes, and `auto` decides the same way."""
import dataclasses
import itertools

import pytest

from dsrl.config.schema import Config
from dsrl.errors import ConfigError
from dsrl.validation.reuse import decide_reuse, reuse_blockers, validate_reuse


def make(section_overrides=None, reuse="on"):
    cfg = Config()
    cfg.algo = dataclasses.replace(cfg.algo, reuse_logprobs=reuse)
    for section, kw in (section_overrides or {}).items():
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **kw))
    return cfg


INCOMPATIBLE = [
    ("model.attention_dropout", {"model": {"attention_dropout": 0.1}}),
    ("model.hidden_dropout", {"model": {"hidden_dropout": 0.1}}),
    ("algo.kl_coef", {"algo": {"kl_coef": 0.05}}),
    ("algo.keep_old_actor", {"algo": {"keep_old_actor": True}}),
    ("algo.use_opd", {"algo": {"use_opd": True}}),
    ("algo.num_steps_per_rollout", {"algo": {"num_steps_per_rollout": 2}}),
    ("algo.global_batch_size", {"algo": {"global_batch_size": 32}}),
    ("trainer.before_train_step_hooks", {"trainer": {"before_train_step_hooks": ["my.hooks.replay"]}}),
]


@pytest.mark.parametrize("name,over", INCOMPATIBLE, ids=[n for n, _ in INCOMPATIBLE])
def test_each_incompatible_option_is_rejected_by_name(name, over):
    cfg = make(over)
    with pytest.raises(ConfigError) as e:
        validate_reuse(cfg)
    assert name in str(e.value)
    assert reuse_blockers(cfg) == [name]
    d = decide_reuse(make(over, reuse="auto"))
    assert not d.reuse and name in d.reason and d.run_old_pass


def test_all_blockers_named_in_one_error():
    merged = {"algo": {"policy_loss": "sft"}}
    for _, over in INCOMPATIBLE:
        for section, kw in over.items():
            merged.setdefault(section, {}).update(kw)
    with pytest.raises(ConfigError) as e:
        validate_reuse(make(merged))
    for name, _ in INCOMPATIBLE + [("algo.policy_loss", None)]:
        assert name in str(e.value)


@pytest.mark.parametrize("objective", ["sft", "tinker:importance_sampling"])
def test_objective_without_old_log_probs_has_nothing_to_reuse(objective):
    """The registry flag, not the name, decides: `on` is an error naming algo.policy_loss and
    why; `auto` and `off` reuse nothing and run no old-policy pass."""
    from dsrl.loss.registry import get_objective

    assert not get_objective(objective).needs_old_log_probs
    over = {"algo": {"policy_loss": objective}}
    with pytest.raises(ConfigError) as e:
        validate_reuse(make(over))
    assert "algo.policy_loss" in str(e.value) and "reads no old-policy log-probs" in str(e.value)
    assert reuse_blockers(make(over)) == ["algo.policy_loss"]
    for mode in ("auto", "off"):
        for rollout_lp, tis in ((False, False), (True, False), (False, True)):
            d = decide_reuse(make({"algo": {"policy_loss": objective, "use_rollout_logprobs": rollout_lp,
                                             "use_tis": tis}}, reuse=mode))
            assert not d.reuse and not d.run_old_pass, (mode, rollout_lp, tis)


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
def test_objectives_reading_old_log_probs_are_not_blockers(objective):
    assert reuse_blockers(make({"algo": {"policy_loss": objective}})) == []
    assert decide_reuse(make({"algo": {"policy_loss": objective}}, reuse="off")).run_old_pass


COMPATIBLE_KNOBS = {
    "use_rollout_logprobs": (False, True),
    "use_tis": (False, True),
    "use_kl_loss": (False, True),
    "policy_loss": ("ppo", "gspo", "cispo"),
    "num_steps_per_rollout": (None, 1),
    "entropy_coef": (0.0, 0.01),
}


# use_tis with use_rollout_logprobs is excluded: the general validator forbids that pair.
COMBOS = [c for c in itertools.product(*COMPATIBLE_KNOBS.values()) if not (c[0] and c[1])]


@pytest.mark.parametrize("combo", COMBOS)
def test_compatible_combinations_pass(combo):
    kw = dict(zip(COMPATIBLE_KNOBS, combo))
    kw["kl_loss_coef"] = 0.1 if kw["use_kl_loss"] else 0.0
    cfg = make({"algo": kw})
    validate_reuse(cfg)
    for mode in ("on", "auto"):
        d = decide_reuse(make({"algo": kw}, reuse=mode))
        assert d.reuse and not d.run_old_pass


def test_off_always_runs_the_old_pass_unless_rollout_logprobs_are_the_old_policy():
    assert decide_reuse(make(reuse="off")).run_old_pass
    assert not decide_reuse(make({"algo": {"use_rollout_logprobs": True}}, reuse="off")).run_old_pass
    assert not decide_reuse(make(reuse="off")).reuse
