"""Config errors fail at compose/validate time, before any model loads, naming the key."""
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from dsrl.config.reuse import ConfigError
from dsrl.config.schema import register_configs, to_config
from dsrl.config.validate import validate
from dsrl.testing import subprocess_env

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_default_and_exp_compose_and_validate():
    cfg = to_config(_compose("+exp=grpo_reuse"))
    validate(cfg)
    assert cfg.algo.reuse_logprobs == "on"
    assert cfg.algo.global_batch_size == cfg.algo.rollout_batch_size * cfg.algo.n_samples_per_prompt
    assert cfg.model.path == "smollm2"


@pytest.mark.parametrize("override,key", [
    ("algo.bogus_key=1", "bogus_key"),
    ("actor.zero_stagee=2", "zero_stagee"),
    ("+trainer.nope=3", "nope"),
])
def test_unknown_key_is_rejected_by_name(override, key):
    # Plain overrides fail at composition; "+key" additions fail when typed against the schema.
    with pytest.raises((ConfigCompositionException, Exception)) as e:
        to_config(_compose("+exp=grpo_reuse", override))
    assert key in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("override,key", [
    ("actor.zero_stage=abc", "zero_stage"),
    ("algo.kl_coef=lots", "kl_coef"),
])
def test_wrong_type_is_rejected_by_name(override, key):
    with pytest.raises(Exception) as e:
        to_config(_compose(override))
    assert key in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("override,key", [
    ("algo.reuse_logprobs=maybe", "algo.reuse_logprobs"),
    ("actor.zero_stage=4", "actor.zero_stage"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("algo.global_batch_size=7", "algo.global_batch_size"),
    ("algo.advantage_estimator=nope", "algo.advantage_estimator"),
    ("algo.policy_loss=nope", "algo.policy_loss"),
    ("algo.loss_agg_mode=mean", "algo.loss_agg_mode"),
    ("data.name=imagenet", "data.name"),
    ("model.hidden_dropout=1.5", "model.hidden_dropout"),
])
def test_bad_value_is_rejected_by_name(override, key):
    cfg = to_config(_compose(override))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert key in str(e.value)


def test_cli_fails_before_any_model_loads(tmp_path):
    """The real entry point exits non-zero, names the key, and never reaches model loading."""
    env = subprocess_env(HYDRA_FULL_ERROR="0")
    for override, key in (("algo.bogus_key=1", "bogus_key"), ("algo.reuse_logprobs=maybe", "algo.reuse_logprobs"),
                          ("algo.kl_coef=0.1", "algo.kl_coef")):
        r = subprocess.run([sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", override,
                            f"hydra.run.dir={tmp_path / key}"], capture_output=True, text=True, env=env, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode != 0, out
        assert key in out, out
        assert "Loading weights" not in out and "deepspeed" not in out.lower(), out
        assert not (tmp_path / key / "metrics.jsonl").exists()
