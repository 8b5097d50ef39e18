"""check_agent_config: single-turn configs pass untouched; every multi-turn error names its key
(unknown env, bad env kwargs, turns, token budget vs max_model_len and max_new_tokens, the GAE
critic, adaptive reuse, the single-turn greedy eval, reward.fn/url, the data keys the environment
replaces); both rollout backends apply. And through dsrl.validation.validate on the full schema."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsrl.agent.config_checks import check_agent_config


def _cfg(data=None, algo=None, trainer=None, reward=None, **rollout):
    r = dict(env="calculator", env_kwargs={}, max_turns=4, max_episode_tokens=256, max_new_tokens=48,
             max_model_len=1024, backend="vllm")
    r.update(rollout)
    d = dict(chat_template=True, system_prompt="")
    d.update(data or {})
    al = dict(advantage_estimator="grpo", reuse_logprobs="on")
    al.update(algo or {})
    t = dict(eval_before=False, eval_after=False)
    t.update(trainer or {})
    rw = dict(fn=None, url=None)
    rw.update(reward or {})
    return SimpleNamespace(rollout=SimpleNamespace(**r), algo=SimpleNamespace(**al), data=SimpleNamespace(**d),
                           trainer=SimpleNamespace(**t), reward=SimpleNamespace(**rw))


def test_valid_and_single_turn_configs_pass():
    assert check_agent_config(_cfg()) == []
    assert check_agent_config(_cfg(env="guess_the_number", env_kwargs={"max_number": 10})) == []
    assert check_agent_config(_cfg(env="", max_turns=0)) == []  # no env: nothing multi-turn to check
    assert check_agent_config(_cfg(backend="hf")) == []  # the hf worker takes token ids, returns log-probs too
    assert check_agent_config(_cfg(algo={"reuse_logprobs": "auto"})) == []
    assert check_agent_config(_cfg(algo={"advantage_estimator": "reinforce_pp", "gamma": 1.0})) == []


@pytest.mark.parametrize("change, fragment", [
    (dict(env="nope"), "rollout.env='nope': unknown environment"),
    (dict(env_kwargs={"bogus": 1}), "rollout.env_kwargs={'bogus': 1}"),
    (dict(env_kwargs={"verifier": "nope"}), "rollout.env_kwargs.verifier='nope'"),
    (dict(env="guess_the_number", env_kwargs={"min_number": 5, "max_number": 5}), "min_number=5 must be < max_number=5"),
    (dict(max_turns=0), "rollout.max_turns=0 must be >= 1"),
    (dict(max_episode_tokens=0), "rollout.max_episode_tokens=0 must be >= 1"),
    (dict(max_episode_tokens=1024), "rollout.max_episode_tokens=1024 must be < rollout.max_model_len=1024"),
    (dict(max_new_tokens=300), "rollout.max_new_tokens=300 (per turn) exceeds rollout.max_episode_tokens=256"),
    (dict(algo={"reuse_logprobs": "adaptive"}), "algo.reuse_logprobs='adaptive' does not apply"),
    (dict(algo={"advantage_estimator": "reinforce_pp", "gamma": 0.99}), "algo.gamma=0.99 < 1 with"),
    (dict(trainer={"eval_before": True}), "trainer.eval_before=true does not apply"),
    (dict(trainer={"eval_after": True}), "trainer.eval_after=true does not apply"),
    (dict(reward={"fn": "arith"}), "reward.fn='arith' is not used with rollout.env='calculator'"),
    (dict(reward={"url": "http://127.0.0.1:1"}), "reward.url='http://127.0.0.1:1' is not used"),
    (dict(data={"chat_template": False}), "data.chat_template=false"),
    (dict(algo={"advantage_estimator": "gae"}), "algo.advantage_estimator=gae does not apply"),
    (dict(data={"system_prompt": "Be brief."}), "data.system_prompt is not used"),
])
def test_errors_name_the_key(change, fragment):
    errors = check_agent_config(_cfg(**change))
    assert len(errors) == 1 and fragment in errors[0], errors


def test_prepared_exp_file_passes():
    """conf/exp/agent_tools.yaml (merged over the rollout/data defaults) is a valid agent config."""
    from pathlib import Path

    from omegaconf import OmegaConf

    exp = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf/exp/agent_tools.yaml"))
    r = dict(backend="vllm", max_model_len=512)
    r.update(exp["rollout"])
    cfg = SimpleNamespace(rollout=SimpleNamespace(**r), algo=SimpleNamespace(advantage_estimator="grpo"),
                          data=SimpleNamespace(chat_template=True, system_prompt=""),
                          trainer=SimpleNamespace(**{k: exp["trainer"][k] for k in ("eval_before", "eval_after")}))
    assert check_agent_config(cfg) == []
    assert exp["rollout"]["env"] == "calculator" and exp["data"]["digits"] == 2


def test_validate_runs_the_agent_checks_on_the_schema():
    """dsrl.validation.validate on the typed Config: a good env config passes; an unknown env,
    max_turns < 1 and gae are reported together, each naming its key (no model is loaded)."""
    import dataclasses

    from dsrl.config.schema import Config
    from dsrl.errors import ConfigError
    from dsrl.validation.validate import validate

    cfg = Config()
    cfg.rollout = dataclasses.replace(cfg.rollout, env="guess_the_number", max_new_tokens=16)
    cfg.trainer = dataclasses.replace(cfg.trainer, eval_before=False, eval_after=False)
    validate(cfg)
    bad = dataclasses.replace(cfg.rollout, env="no_such_env", max_turns=0)
    with pytest.raises(ConfigError) as e:
        validate(dataclasses.replace(cfg, rollout=bad, algo=dataclasses.replace(cfg.algo, advantage_estimator="gae")))
    msg = str(e.value)
    for fragment in ("rollout.env='no_such_env'", "rollout.max_turns=0 must be >= 1", "algo.advantage_estimator=gae"):
        assert fragment in msg, msg
