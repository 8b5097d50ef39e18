"""check_agent_config: single-turn configs pass untouched; every multi-turn error names its key
(unknown env, bad env kwargs, turns, token budget vs max_model_len and max_new_tokens, backend,
the GAE critic, the data keys the environment replaces)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsrl.agent.config_checks import check_agent_config


def _cfg(data=None, algo=None, **rollout):
    r = dict(env="calculator", env_kwargs={}, max_turns=4, max_episode_tokens=256, max_new_tokens=48,
             max_model_len=1024, backend="vllm")
    r.update(rollout)
    d = dict(chat_template=True, system_prompt="")
    d.update(data or {})
    return SimpleNamespace(rollout=SimpleNamespace(**r), algo=SimpleNamespace(**(algo or {"advantage_estimator": "grpo"})), data=SimpleNamespace(**d))


def test_valid_and_single_turn_configs_pass():
    assert check_agent_config(_cfg()) == []
    assert check_agent_config(_cfg(env="guess_the_number", env_kwargs={"max_number": 10})) == []
    assert check_agent_config(_cfg(env="", max_turns=0)) == []  # no env: nothing multi-turn to check


@pytest.mark.parametrize("change, fragment", [
    (dict(env="nope"), "rollout.env='nope': unknown environment"),
    (dict(env_kwargs={"bogus": 1}), "rollout.env_kwargs={'bogus': 1}"),
    (dict(env_kwargs={"verifier": "nope"}), "rollout.env_kwargs.verifier='nope'"),
    (dict(env="guess_the_number", env_kwargs={"min_number": 5, "max_number": 5}), "min_number=5 must be < max_number=5"),
    (dict(max_turns=0), "rollout.max_turns=0 must be >= 1"),
    (dict(max_episode_tokens=0), "rollout.max_episode_tokens=0 must be >= 1"),
    (dict(max_episode_tokens=1024), "rollout.max_episode_tokens=1024 must be < rollout.max_model_len=1024"),
    (dict(max_new_tokens=300), "rollout.max_new_tokens=300 (per turn) exceeds rollout.max_episode_tokens=256"),
    (dict(backend="hf"), "rollout.backend='hf' does not apply to multi-turn episodes"),
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
                          data=SimpleNamespace(chat_template=True, system_prompt=""))
    assert check_agent_config(cfg) == []
    assert exp["rollout"]["env"] == "calculator" and exp["data"]["digits"] == 2
