"""Config errors fail at compose/validate time, before any model loads, naming the key."""
import os
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from dsrl.config.schema import register_configs, to_config
from dsrl.errors import ConfigError
from dsrl.testing import subprocess_env
from dsrl.validation.validate import validate

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


# ---------------------------------------------------------------- rules checked before any model
PLUGINS_DIR = os.path.dirname(os.path.abspath(__file__))  # tests/config: plugins_for_tests.py
ROOT = os.path.abspath(os.path.join(PLUGINS_DIR, "..", ".."))


@pytest.fixture
def plugins_importable(monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS_DIR)


def _errors(*overrides) -> str:
    """The validator's message for a config that must be rejected."""
    with pytest.raises(ConfigError) as e:
        validate(to_config(_compose(*overrides)))
    return str(e.value)


@pytest.mark.parametrize("overrides,keys", [
    # Samples left untrained: 64 samples in 3 steps.
    (("algo.num_steps_per_rollout=3",), ("algo.num_steps_per_rollout", "algo.rollout_batch_size")),
    # 2 steps of global_batch_size=64 samples from a 64-sample rollout.
    (("algo.num_steps_per_rollout=2",), ("algo.global_batch_size", "algo.num_steps_per_rollout")),
    (("algo.tis_function=mis", "algo.mis_level=tokens"), ("algo.mis_level",)),
    (("algo.tis_function=mis", "algo.mis_mode=cut"), ("algo.mis_mode",)),
    (("algo.tis_function=vanila",), ("algo.tis_function",)),
    (("algo.tis_function=os.path.no_such_fn",), ("algo.tis_function",)),
    (("data.name=no_such_pkg.Source",), ("data.name",)),
    (("reward.fn=exact",), ("reward.fn",)),
    (("reward.fn=os.path.no_such_fn",), ("reward.fn",)),
    (("algo.kl_coef=0.1",), ("algo.kl_coef", "algo.advantage_estimator", "use_kl_loss")),
    (("algo.kl_coef=0.1", "algo.advantage_estimator=rloo"), ("algo.kl_coef", "algo.advantage_estimator")),
    (("rollout.top_p=0.9", "algo.use_rollout_logprobs=true"), ("rollout.top_p", "algo.use_rollout_logprobs")),
    (("rollout.top_p=0.9", "algo.use_tis=true"), ("rollout.top_p", "algo.use_tis")),
    (("algo.policy_loss=tinker:cross_entropy", "algo.loss_agg_mode=sum"),
     ("algo.policy_loss=tinker:cross_entropy cannot run in the RL loop: it needs per-token loss weights",)),
    (("algo.policy_loss=tinker:ppo",), ("algo.policy_loss=tinker:ppo", "algo.loss_agg_mode=sum")),
    (("algo.policy_loss=tinker:ppo", "algo.loss_agg_mode=sum", "+algo.loss_fn_config.clip_lo=0.5"),
     ("algo.loss_fn_config.clip_lo", "clip_low_threshold")),
    (("+algo.loss_fn_config.eps_clip=0.3",), ("algo.loss_fn_config", "algo.policy_loss=ppo")),
])
def test_rule_names_the_key(overrides, keys):
    msg = _errors(*overrides)
    for key in keys:
        assert key in msg, (key, msg)


@pytest.mark.parametrize("overrides", [
    ("algo.num_steps_per_rollout=2", "algo.global_batch_size=32"),
    ("algo.tis_function=mis", "algo.mis_level=geometric", "algo.mis_mode=mask"),
    ("algo.mis_level=anything",),  # MIS options are read only by tis_function=mis
    ("algo.tis_function=icepop", "algo.use_tis=true"),
    ("algo.kl_coef=0.1", "algo.advantage_estimator=reinforce_pp"),
    ("algo.kl_coef=0.1", "algo.advantage_estimator=reinforce_pp_baseline"),
    ("rollout.top_p=0.9",),
    ("algo.policy_loss=tinker:ppo", "algo.loss_agg_mode=sum", "+algo.loss_fn_config.clip_low_threshold=0.7"),
    ("data.name=gsm8k", "reward.fn=arith"),
])
def test_valid_combinations_pass(overrides):
    validate(to_config(_compose(*overrides)))


def test_world_size_from_the_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "algo.rollout_batch_size" in _errors("algo.rollout_batch_size=8")
    monkeypatch.setenv("WORLD_SIZE", "4")
    validate(to_config(_compose("algo.rollout_batch_size=8")))
    # 4 prompts x 3 samples over 4 ranks = 3 samples per rank; 12 / global_batch_size 3 = 4 steps.
    msg = _errors("algo.rollout_batch_size=4", "algo.n_samples_per_prompt=3", "algo.global_batch_size=3")
    assert "algo.global_batch_size" in msg and "WORLD_SIZE=4" in msg
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert "WORLD_SIZE" in _errors()
    monkeypatch.delenv("WORLD_SIZE")
    validate(to_config(_compose("algo.rollout_batch_size=3", "algo.global_batch_size=24")))  # 1 rank


def test_all_problems_reported_together():
    msg = _errors("algo.num_steps_per_rollout=3", "algo.tis_function=mis", "algo.mis_mode=cut",
                  "data.name=nope", "algo.kl_coef=0.1", "rollout.top_p=0.5", "algo.use_tis=true")
    for key in ("algo.num_steps_per_rollout", "algo.mis_mode", "data.name", "algo.kl_coef", "rollout.top_p"):
        assert key in msg, (key, msg)


def test_source_registered_by_user_code_is_accepted(plugins_importable):
    from dsrl.data.registry import SOURCES, register_source
    import plugins_for_tests

    class UserSource(plugins_for_tests.LetterCountSource):
        pass

    assert "data.name" in _errors("data.name=user_letters")
    register_source("user_letters")(UserSource)
    try:
        validate(to_config(_compose("data.name=user_letters")))
    finally:
        del SOURCES["user_letters"]


def test_dotted_path_plugins_pass_validation(plugins_importable):
    validate(to_config(_compose(
        "algo.policy_loss=plugins_for_tests.reinforce_objective",
        "algo.advantage_estimator=plugins_for_tests.reward_minus_kl", "algo.kl_coef=0.05",
        "algo.tis_function=plugins_for_tests.halve_correction", "algo.use_tis=true",
        "data.name=plugins_for_tests.LetterCountSource", "reward.fn=plugins_for_tests.length_verifier")))
    # The source's default verifier (a dotted path) is resolved too when reward.fn is null.
    validate(to_config(_compose("data.name=plugins_for_tests.LetterCountSource")))


@pytest.mark.parametrize("overrides,keys", [
    (("data.name=plugins_for_tests.NotASource",), ("data.name", "sample_train")),
    (("data.name=plugins_for_tests.SourceWithoutVerifier",), ("reward.fn", "default_verifier")),
    (("algo.policy_loss=plugins_for_tests.NOT_CALLABLE",), ("algo.policy_loss",)),
    # An estimator that does not declare uses_kl_in_reward ignores kl_coef.
    (("algo.advantage_estimator=plugins_for_tests.best_of_group", "algo.kl_coef=0.1"),
     ("algo.kl_coef", "algo.advantage_estimator")),
])
def test_bad_dotted_plugins_name_the_key(plugins_importable, overrides, keys):
    msg = _errors(*overrides)
    for key in keys:
        assert key in msg, (key, msg)


def _cli(tmp_path, tag, overrides, **env):
    """Run the real entry point; returns (returncode, output, wall seconds)."""
    pythonpath = os.pathsep.join(p for p in (PLUGINS_DIR, os.environ.get("PYTHONPATH", "")) if p)
    child_env = subprocess_env(HYDRA_FULL_ERROR="0", PYTHONPATH=pythonpath, **env)
    if "WORLD_SIZE" not in env:
        child_env.pop("WORLD_SIZE", None)
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dsrl.main", "+exp=grpo_reuse", *overrides,
                        f"hydra.run.dir={tmp_path / tag}"], capture_output=True, text=True, env=child_env,
                       cwd=ROOT, timeout=300)
    wall = time.monotonic() - start
    out = r.stdout + r.stderr
    assert "Loading weights" not in out and "deepspeed" not in out.lower(), out
    assert not (tmp_path / tag / "metrics.jsonl").exists()
    return r.returncode, out, wall


@pytest.mark.parametrize("tag,overrides,env,keys", [
    ("ranks_mis_tis_data_kl_topp",
     ("algo.tis_function=mis", "algo.mis_level=tokens", "algo.mis_mode=cut", "data.name=no_such_pkg.Source",
      "reward.fn=exact", "algo.kl_coef=0.1", "rollout.top_p=0.9", "algo.use_tis=true"),
     {"WORLD_SIZE": "3"},
     ("algo.rollout_batch_size", "WORLD_SIZE=3", "algo.mis_level", "algo.mis_mode", "data.name", "reward.fn",
      "algo.kl_coef", "algo.advantage_estimator", "rollout.top_p", "algo.use_tis")),
    ("steps_objective_config",
     ("algo.num_steps_per_rollout=3", "algo.policy_loss=tinker:cross_entropy", "+algo.loss_fn_config.beta=1",
      "algo.tis_function=vanila"),
     {},
     ("algo.num_steps_per_rollout", "algo.rollout_batch_size",
      "algo.policy_loss=tinker:cross_entropy cannot run in the RL loop", "algo.loss_agg_mode",
      "algo.loss_fn_config.beta", "algo.tis_function")),
    ("global_batch_rollout_logprobs",
     ("algo.reuse_logprobs=auto", "algo.num_steps_per_rollout=2", "rollout.top_p=0.9",
      "algo.use_rollout_logprobs=true", "algo.policy_loss=tinker:ppo"),
     {},
     ("algo.global_batch_size", "algo.num_steps_per_rollout", "rollout.top_p", "algo.use_rollout_logprobs",
      "algo.loss_agg_mode")),
])
def test_cli_rejects_each_rule_fast_naming_the_key(tmp_path, tag, overrides, env, keys):
    """The real CLI: non-zero exit, every key named, no model loaded, in under 60 s."""
    rc, out, wall = _cli(tmp_path, tag, overrides, **env)
    assert rc != 0, out
    for key in keys:
        assert key in out, (key, out)
    assert wall < 60, wall


def test_cli_accepts_dotted_path_plugins(tmp_path):
    """Valid plug-ins by dotted path get through the real CLI's validation: the run fails only
    on the one bad value added on purpose, and names none of the plug-in keys."""
    rc, out, wall = _cli(tmp_path, "plugins", (
        "algo.reuse_logprobs=auto", "algo.policy_loss=plugins_for_tests.reinforce_objective",
        "algo.advantage_estimator=plugins_for_tests.best_of_group",
        "data.name=plugins_for_tests.LetterCountSource", "reward.fn=plugins_for_tests.length_verifier",
        "algo.tis_function=plugins_for_tests.halve_correction", "actor.lr=-1"))
    assert rc != 0 and "actor.lr" in out, out
    for key in ("algo.policy_loss", "algo.advantage_estimator", "data.name", "reward.fn", "algo.tis_function"):
        assert key not in out, (key, out)
    assert wall < 60, wall


def test_validate_imports_no_model_stack():
    """validate() (with plug-ins loaded by dotted path) leaves transformers, deepspeed and vLLM
    unimported: it can run before anything heavy."""
    code = ("import sys; from dsrl.config.schema import Config, DataConfig\n"
            "from dsrl.validation.validate import validate\n"
            "cfg = Config(); cfg.data = DataConfig(name='plugins_for_tests.LetterCountSource')\n"
            "validate(cfg)\n"
            "print(sorted(m for m in ('transformers', 'deepspeed', 'vllm', 'ray') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=subprocess_env(PYTHONPATH=PLUGINS_DIR))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_gsm8k_reasoning_preset_composes_and_validates():
    cfg = to_config(_compose("+exp=gsm8k_reasoning"))
    validate(cfg)
    assert (cfg.data.name, cfg.reward.fn, cfg.reward.eval_fn) == ("gsm8k", "gsm8k_format", "gsm8k")
    assert cfg.rollout.max_new_tokens == 256 and cfg.model.path == "smollm2"
    assert (cfg.algo.rollout_batch_size, cfg.algo.n_samples_per_prompt) == (8, 8)
    assert cfg.algo.global_batch_size == cfg.algo.rollout_batch_size * cfg.algo.n_samples_per_prompt
    # The prompt budget the preset leaves (max_model_len - max_new_tokens) holds every GSM8K prompt
    # with its system prompt (checked again at start-up by dsrl.data.lengths).
    assert cfg.rollout.max_model_len - cfg.rollout.max_new_tokens >= 400
    assert "The answer is N." in cfg.data.system_prompt


def test_reward_eval_fn_is_checked_by_name():
    with pytest.raises(ConfigError, match=r"reward\.eval_fn"):
        validate(to_config(_compose("+exp=gsm8k_reasoning", "reward.eval_fn=no_such_verifier")))


def test_reward_eval_fn_leaves_the_training_reward_checks_alone(tmp_path):
    """User files name no default verifier: reward.fn set and eval_fn null validates (the eval_fn
    check once swallowed this branch and demanded reward.fn though it was set); eval_fn set and
    reward.fn null still asks for reward.fn."""
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "1 + 2 =", "answer": "3"}\n')
    data = ["+exp=grpo_reuse", "data=jsonl", f"data.path={rows}"]
    validate(to_config(_compose(*data, "reward.fn=gsm8k")))
    with pytest.raises(ConfigError, match=r"reward\.fn is required"):
        validate(to_config(_compose(*data, "reward.eval_fn=gsm8k")))
