"""Registries without import circles, and plug-ins named by dotted path (objectives, advantage
estimators, TIS functions, prompt sources, verifiers) through the same lookups the product uses."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsrl.data.registry import SOURCES, build_source, make_source, register_source
from dsrl.loss.advantages import compute_advantages
from dsrl.loss.corrections import get_tis_function
from dsrl.loss.registry import (ADVANTAGE_ESTIMATORS, get_advantage_estimator, get_objective,
                                uses_kl_in_reward)
from dsrl.loss.types import Aggregator, LossInputs
from dsrl.registry import PluginError
from dsrl.reward.registry import get_verifier, score, verifier_for_source
from dsrl.testing import subprocess_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
F64 = torch.float64

REGISTRY_MODULES = {"dsrl/loss/registry.py", "dsrl/data/registry.py", "dsrl/reward/registry.py",
                    "dsrl/registry.py"}
PLUGIN_MODULES = ("dsrl.loss.objectives", "dsrl.loss.advantages", "dsrl.loss.tinker", "dsrl.loss.corrections",
                  "dsrl.data.arith", "dsrl.data.gsm8k", "dsrl.reward.verifiers")


@pytest.fixture(autouse=True)
def _plugins_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def _imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # also imports inside functions
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("rel", sorted(REGISTRY_MODULES))
def test_no_registry_module_imports_a_plugin(rel):
    imported = _imported_modules(ROOT / rel)
    assert not imported & set(PLUGIN_MODULES), (rel, imported & set(PLUGIN_MODULES))


_PROBE = """
import importlib, sys

def fresh_import(module):
    for name in [m for m in sys.modules if m == "dsrl" or m.startswith("dsrl.")]:
        del sys.modules[name]  # registries live in their modules: they start empty again
    importlib.import_module(module)
    from dsrl.loss.registry import OBJECTIVES, ADVANTAGE_ESTIMATORS
    from dsrl.data.registry import SOURCES
    from dsrl.reward.registry import VERIFIERS
    return [sorted(OBJECTIVES), sorted(ADVANTAGE_ESTIMATORS), sorted(SOURCES), sorted(VERIFIERS)]

for module in sys.argv[1:]:
    print(module, *fresh_import(module), sep="|")
"""
FIRST_IMPORTS = ("dsrl.loss.registry", "dsrl.data.registry", "dsrl.reward.registry", *PLUGIN_MODULES)


def test_each_module_imports_first_without_a_circle():
    """A circle fails (ImportError on a partly initialised module) for some import order:
    import each module first, with every dsrl module unloaded before it, in one interpreter;
    the built-ins are registered whichever module came first."""
    r = subprocess.run([sys.executable, "-c", _PROBE, *FIRST_IMPORTS], capture_output=True, text=True,
                       env=subprocess_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.strip().splitlines()]
    assert [row[0] for row in rows] == list(FIRST_IMPORTS)
    for module, objectives, estimators, sources, verifiers in rows:
        for name in ("ppo", "gspo", "cispo", "sft", "tinker:ppo"):
            assert repr(name) in objectives, module
        for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
            assert repr(name) in estimators, module
        assert "'arith'" in sources and "'gsm8k'" in sources, module
        assert "'arith'" in verifiers and "'gsm8k'" in verifiers, module


def test_estimators_declare_whether_they_use_kl_in_reward():
    assert {n: uses_kl_in_reward(f) for n, f in ADVANTAGE_ESTIMATORS.items()
            if n in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")} == {
        "grpo": False, "dr_grpo": False, "rloo": False, "reinforce_pp": True, "reinforce_pp_baseline": True}
    assert uses_kl_in_reward(get_advantage_estimator("plugins_for_tests.reward_minus_kl"))
    assert not uses_kl_in_reward(get_advantage_estimator("plugins_for_tests.best_of_group"))


def test_dotted_objective_spec_from_function_attributes():
    import plugins_for_tests as p

    spec = get_objective("plugins_for_tests.reinforce_objective")
    assert spec.fn is p.reinforce_objective and spec.name == "plugins_for_tests.reinforce_objective"
    assert (spec.needs_old_log_probs, spec.skip_zero_advantage_exact, spec.required_inputs) == (
        False, True, ("advantages",))
    assert get_objective("plugins_for_tests.reinforce_objective") is spec  # loaded once
    bare = get_objective("plugins_for_tests.bare_objective")  # conservative defaults
    assert (bare.needs_old_log_probs, bare.skip_zero_advantage_exact, bare.aggregation, bare.rl_loop_error,
            bare.config_defaults) == (True, False, None, None, None)


def test_dotted_objective_value_and_gradient():
    spec = get_objective("plugins_for_tests.reinforce_objective")
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=F64)
    adv = torch.tensor([[2.0, 2.0, 0.0], [-1.0, -1.0, 0.0]], dtype=F64)
    out = spec.fn(LossInputs(log_probs=lp, mask=mask, batch={"advantages": adv}, config={},
                             reduce=Aggregator.build("token-mean", mask, global_tokens=4)))
    # token-mean of -A*lp over 4 tokens: -(2*-1 + 2*-2 + -1*-0.5 + -1*-4) / 4 = 1.5 / 4
    assert out.loss.item() == 0.375  # dyadic values: exact in any summation order
    out.loss.backward()
    assert torch.equal(lp.grad, -adv * mask / 4)


def test_dotted_estimator_through_compute_advantages():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1]], dtype=F64)
    data = {"rewards": torch.tensor([0.0, 1.0, 3.0, 2.0], dtype=F64), "loss_mask": mask}
    out = compute_advantages(data, {"advantage_estimator": "plugins_for_tests.best_of_group",
                                    "n_samples_per_prompt": 2})
    assert torch.equal(out["advantages"], torch.tensor([[0, 0], [1, 0], [1, 1], [0, 0]], dtype=F64))


def test_dotted_estimator_receives_kl_when_it_folds_kl_into_reward():
    mask = torch.tensor([[1, 1], [1, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0], [-1.0, 0.0]], dtype=F64)
    data = {"rewards": torch.tensor([1.0, 0.0], dtype=F64), "loss_mask": mask, "old_log_probs": old,
            "ref_log_probs": ref}
    out = compute_advantages(data, {"advantage_estimator": "plugins_for_tests.reward_minus_kl",
                                    "kl_coef": 0.1, "kl_loss_type": "k1", "n_samples_per_prompt": 2})
    k1 = (old - ref) * mask  # k1 = log pi - log ref
    torch.testing.assert_close(out["advantages"], (torch.tensor([[1.0], [0.0]], dtype=F64) - 0.1 * k1) * mask,
                               rtol=0, atol=1e-15)


@pytest.mark.parametrize("name,needle", [
    ("nope", "registered"), ("no_such_module_xyz.fn", "cannot load"),
    ("plugins_for_tests.missing_fn", "no attribute"), ("plugins_for_tests.NOT_CALLABLE", "not a usable"),
])
def test_bad_objective_names_the_key(name, needle):
    with pytest.raises(PluginError) as e:
        get_objective(name)
    assert "algo.policy_loss" in str(e.value) and needle in str(e.value)
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)


def test_dotted_tis_function():
    import plugins_for_tests as p

    fn, builtin = get_tis_function({"tis_function": "plugins_for_tests.halve_correction"})
    assert fn is p.halve_correction and builtin is False
    assert get_tis_function({"tis_function": "icepop"})[1] is True
    with pytest.raises(PluginError, match="algo.tis_function"):
        get_tis_function({"tis_function": "not_registered"})


def test_dotted_source_and_verifiers():
    src = build_source({"name": "plugins_for_tests.LetterCountSource", "seed": 5, "digits": 3,
                        "verifier": "plugins_for_tests.length_verifier"})
    assert type(src).__name__ == "LetterCountSource" and src.seed == 5  # digits/verifier not passed
    prompts = src.sample_train(3, 0)
    fn = verifier_for_source(src)  # the source's default_verifier is itself a dotted path
    assert score(fn, ["x" * (int(p.answer) + 1) for p in prompts], prompts) == [0.0, 0.0, 0.0]
    assert score(fn, ["y" * int(p.answer) for p in prompts], prompts) == [1.0, 1.0, 1.0]
    arith = get_verifier("arith")
    assert verifier_for_source(src, "arith") is arith  # reward.fn overrides the default
    with pytest.raises(PluginError, match="reward.fn"):
        verifier_for_source(src, "nope")
    with pytest.raises(PluginError, match="data.name"):
        make_source("plugins_for_tests.NotASource")


def test_user_registered_source():
    import plugins_for_tests as p

    class Registered(p.LetterCountSource):
        pass

    register_source("letters_for_test")(Registered)
    try:
        assert isinstance(make_source("letters_for_test"), Registered)
    finally:
        del SOURCES["letters_for_test"]
