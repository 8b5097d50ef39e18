"""How rollout.backend=hf is built (dsrl.rollout.factory) and validated; it never needs vLLM."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from dsrl.config.schema import register_configs, to_config
from dsrl.rollout.factory import build_rollout
from dsrl.rollout.hf_worker import HFWorker
from dsrl.validation.validate import validate

CONF = Path(__file__).parents[2] / "conf"
register_configs()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return to_config(compose(config_name="config", overrides=["+exp=grpo_reuse", *overrides]))


def _actor(module, zero_stage):
    """Stand-in for an ActorEngine: only what the factory reads (module, stage, device)."""
    return types.SimpleNamespace(module=module, zero_stage=zero_stage, engine=types.SimpleNamespace(device=torch.device("cpu")))


@pytest.fixture(scope="module")
def live_module(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)


@pytest.mark.parametrize("zero_stage,off_policy,shared", [(0, 0, True), (2, 0, True), (3, 0, False), (2, 1, False)])
def test_the_actor_module_is_shared_below_zero3_without_overlap(tiny_model_path, live_module, zero_stage,
                                                                 off_policy, shared):
    cfg = _cfg("rollout.backend=hf", "rollout.dtype=float32", f"algo.off_policy_steps={off_policy}")
    worker = build_rollout(cfg, str(tiny_model_path), "/nonexistent", actor=_actor(live_module, zero_stage))
    inner = worker.worker
    assert isinstance(inner, HFWorker) and inner.shared is shared
    assert (inner.module is live_module) is shared
    if not shared:  # its own copy, same weights
        assert all(torch.equal(a, b) for a, b in zip(inner.module.state_dict().values(),
                                                     live_module.state_dict().values()))
    worker.close()


def test_without_an_actor_the_worker_loads_its_own_copy(tiny_model_path):
    cfg = _cfg("rollout.backend=hf", "rollout.dtype=float32")
    worker = build_rollout(cfg, str(tiny_model_path), "/nonexistent")
    assert not worker.worker.shared and worker.worker.device == torch.device("cpu")
    worker.close()


def test_validation_names_the_backend_and_placement():
    from dsrl.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.backend=hf.*rollout.placement=colocated"):
        validate(_cfg("rollout.backend=hf", "rollout.placement=ray"))
    with pytest.raises(ConfigError, match="rollout.backend"):
        validate(_cfg("rollout.backend=sglang"))


def test_the_hf_path_imports_no_vllm(tiny_model_path):
    code = ("import sys; from dsrl.rollout.factory import build_rollout; from dsrl.rollout.hf_worker import HFWorker; "
            f"w = HFWorker({str(tiny_model_path)!r}, device='cpu'); "
            "w.generate([[1, 2, 3]], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seeds=[7]); "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
