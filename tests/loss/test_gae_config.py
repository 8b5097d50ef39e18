"""PPO-with-critic config: conf/critic/default.yaml composes into the schema; validation names
each bad critic/GAE key before anything loads; the reuse decision says what the critic changes."""
import os

import pytest
from hydra import compose, initialize_config_dir

from dsrl.config.schema import CriticConfig, register_configs, to_config
from dsrl.errors import ConfigError
from dsrl.validation.reuse import decide_reuse
from dsrl.validation.validate import validate

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
register_configs()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def _errors(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    return str(e.value)


def test_critic_group_composes_with_schema_defaults():
    cfg = _cfg()
    assert cfg.critic == CriticConfig()
    assert (cfg.algo.gae_lambda, cfg.algo.value_clip, cfg.algo.value_loss_coef) == (1.0, 0.2, 1.0)
    cfg = _cfg("algo.advantage_estimator=gae", "critic.lr=5e-6", "critic.zero_stage=3", "algo.value_clip=null")
    assert cfg.critic.lr == 5e-6 and cfg.critic.zero_stage == 3 and cfg.algo.value_clip is None
    cfg = _cfg("algo.advantage_estimator=gae", "critic.shared_prompt=off", "critic.max_tokens_per_microbatch=512")
    assert cfg.critic.shared_prompt == "off" and cfg.critic.max_tokens_per_microbatch == 512
    validate(cfg)


def test_gae_validates_now_that_the_loop_runs_the_critic():
    validate(_cfg("algo.advantage_estimator=gae"))
    validate(_cfg("algo.advantage_estimator=gae", "critic.lr=1e-5", "algo.gae_lambda=0.95", "critic.zero_stage=3"))


@pytest.mark.parametrize("override,message", [
    ("algo.gae_lambda=1.5", "algo.gae_lambda=1.5 must be in [0, 1]"),
    ("algo.value_clip=0", "algo.value_clip=0.0 must be > 0 or null"),
    ("algo.value_loss_coef=0", "algo.value_loss_coef=0.0 must be > 0"),
    ("critic.lr=0", "critic.lr=0.0 must be > 0"),
    ("critic.zero_stage=4", "critic.zero_stage=4 must be 0, 1, 2, 3 or null"),
    ("critic.micro_batch_size=0", "critic.micro_batch_size=0 must be >= 1 or null"),
    ("critic.shared_prompt=yes", "critic.shared_prompt='yes' is not one of [None, 'auto', 'on', 'off']"),
    ("critic.max_tokens_per_microbatch=-1", "critic.max_tokens_per_microbatch=-1 must be >= 0"),
    ("critic.loss=nope", "critic.loss='nope': unknown value loss"),
    ("algo.policy_loss=sft", "algo.policy_loss=sft reads no advantages"),
])
def test_bad_critic_settings_are_named(override, message):
    assert message in _errors(_cfg("algo.advantage_estimator=gae", override))


def test_critic_keys_without_a_critic_are_an_error():
    err = _errors(_cfg("critic.lr=1e-4", "critic.path=/x"))
    assert "critic.path, critic.lr set, but algo.advantage_estimator='grpo' reads no values" in err


def test_reuse_reason_says_what_the_critic_changes():
    d = decide_reuse(_cfg("algo.advantage_estimator=gae", "algo.reuse_logprobs=auto"))
    assert d.reuse and "the critic of algo.advantage_estimator=gae does not change this" in d.reason
    assert "values pass runs every step" in d.reason
    # KL in the reward (gae folds algo.kl_coef into it) blocks reuse as for reinforce_pp.
    d = decide_reuse(_cfg("algo.advantage_estimator=gae", "algo.kl_coef=0.01", "model.path=x"))
    assert not d.reuse and "algo.kl_coef" in d.reason and "critic" in d.reason
    assert "critic" not in decide_reuse(_cfg()).reason


def test_no_critic_is_built_for_estimators_without_values():
    from dsrl.actor.critic import build_critic

    assert build_critic(_cfg(), "/nonexistent", dtype="float32", attn_implementation="eager") is None


def test_reuse_reason_keeps_the_critic_note_when_the_model_blocks_reuse(tiny_model_path):
    """A model-side blocker (here a dropout knob read with the model's config.json) rebuilds the
    decision: the run log must still say what the critic changes."""
    from dsrl.validation.reuse import reuse_for_model_config

    for mode in ("auto", "adaptive"):
        cfg = _cfg("algo.advantage_estimator=gae", f"algo.reuse_logprobs={mode}", "model.attention_dropout=0.1")
        d = reuse_for_model_config(decide_reuse(cfg), cfg, str(tiny_model_path))
        assert not d.reuse and "attention_dropout" in d.reason, d.reason
        assert "the critic of algo.advantage_estimator=gae does not change this" in d.reason, d.reason
