"""The environment registry: built-in names, dotted paths, and errors that name `rollout.env`
(unknown name, unloadable path, a non-callable, kwargs the factory rejects, an object without
reset/step); register_env refuses a duplicate name; observations become chat messages."""
from __future__ import annotations

import pytest

from dsrl.agent.env import ENVS, StepResult, as_messages, register_env
from dsrl.agent.environments import env_names, make_env, resolve_env
from dsrl.agent.envs.calculator import CalculatorEnv
from dsrl.registry import PluginError

NOT_A_FACTORY = 42


class NoStep:
    def reset(self, prompt=None, seed=None):
        return "hi"


def test_builtin_names_resolve():
    assert {"calculator", "guess_the_number"} <= set(env_names())
    assert resolve_env("calculator") is CalculatorEnv
    assert isinstance(make_env("calculator", {"tool_bonus": 0.0}), CalculatorEnv)


def test_dotted_path_resolves_to_the_same_class():
    assert resolve_env("dsrl.agent.envs.calculator.CalculatorEnv") is CalculatorEnv
    assert resolve_env("dsrl.agent.envs.calculator:CalculatorEnv") is CalculatorEnv


@pytest.mark.parametrize("name, match", [
    ("no_such_env", r"rollout.env='no_such_env': unknown environment; registered: \[.*'calculator'"),
    ("dsrl.agent.nope.Env", r"rollout.env: cannot load 'dsrl.agent.nope.Env'"),
    ("dsrl.agent.envs.calculator.Missing", r"rollout.env: .*has no attribute 'Missing'"),
    ("test_env_registry.NOT_A_FACTORY", r"rollout.env='test_env_registry.NOT_A_FACTORY': not a usable environment"),
    ("", r"rollout.env is empty"),
])
def test_bad_names_raise_naming_the_key(name, match):
    with pytest.raises(PluginError, match=match):
        resolve_env(name)


def test_factory_errors_name_the_key():
    with pytest.raises(PluginError, match=r"rollout.env='calculator': cannot build it with rollout.env_kwargs=\{'bogus': 1\}"):
        make_env("calculator", {"bogus": 1})
    with pytest.raises(PluginError, match=r"rollout.env='test_env_registry.NoStep': NoStep has no reset\(\)/step\(\)"):
        make_env("test_env_registry.NoStep")


def test_register_env_refuses_duplicates():
    @register_env("test-dummy-env")
    class Dummy:
        """Registered only to be registered again under the same name."""

    try:
        assert resolve_env("test-dummy-env") is Dummy
        with pytest.raises(ValueError, match="registered twice"):
            register_env("test-dummy-env")(Dummy)
    finally:
        del ENVS["test-dummy-env"]


def test_observation_forms():
    assert as_messages("hello") == [{"role": "user", "content": "hello"}]
    msgs = [{"role": "tool", "content": "8"}]
    assert as_messages(msgs) == msgs and as_messages(msgs) is not msgs
    with pytest.raises(ValueError, match="step\\(\\) observation: message 0 needs 'role' and 'content'"):
        as_messages([{"text": "x"}], key="step() observation")
    with pytest.raises(ValueError, match="empty observation"):
        as_messages([])
    assert StepResult("x").reward == 0.0 and StepResult("x").done is False
