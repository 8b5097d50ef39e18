"""Sleep/wake order of a colocated engine (dsrl.rollout.memory), VLLMWorker's CUDA engine
arguments, and the CPU no-op of sleep/wake. The engine is a recording stand-in: what is tested
is the code around it (the order of calls)."""
import types

import pytest
import torch

from dsrl.rollout import memory as memory_mod
from dsrl.rollout import vllm_engine, vllm_worker
from dsrl.rollout.memory import EngineMemory, sleep_mode_wanted


class Recorder:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))


def test_a_step_sleeps_for_training_and_wakes_weights_before_kv_cache():
    eng = Recorder()
    mem = EngineMemory(eng, enabled=True, level=2)
    for _ in range(2):
        with mem.for_rollout():
            eng.calls.append("generate")
        with mem.for_training():
            eng.calls.append("train")
        eng.calls.append("push")  # weights resident, KV cache not yet
    with mem.for_rollout():
        eng.calls.append("generate")
    step = [("sleep", 2), "train", ("wake_up", ("weights",)), "push", ("wake_up", ("kv_cache",)), "generate"]
    assert eng.calls == ["generate", *step, *step]


def test_training_that_raises_still_leaves_the_weights_awake():
    eng = Recorder()
    mem = EngineMemory(eng, enabled=True)
    with pytest.raises(ZeroDivisionError):
        with mem.for_training():
            1 / 0
    assert eng.calls == [("sleep", 1), ("wake_up", ("weights",))]
    assert mem.state == memory_mod.WEIGHTS_ONLY


def test_disabled_does_nothing_and_bad_level_is_named():
    eng = Recorder()
    mem = EngineMemory(eng, enabled=False)
    with mem.for_training() as m:
        assert m is mem
    with mem.for_rollout() as m:
        assert m is mem
    assert eng.calls == []
    with pytest.raises(ValueError, match="sleep level 3"):
        EngineMemory(eng, enabled=True, level=3)


def _cfg(backend="vllm", placement="colocated", off_policy_steps=0):
    return types.SimpleNamespace(rollout=types.SimpleNamespace(backend=backend, placement=placement),
                                 algo=types.SimpleNamespace(off_policy_steps=off_policy_steps))


def test_sleep_mode_only_for_a_colocated_cuda_vllm_engine_without_overlap(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sleep_mode_wanted(_cfg())
    assert not sleep_mode_wanted(_cfg(backend="hf"))
    assert not sleep_mode_wanted(_cfg(placement="ray"))
    assert not sleep_mode_wanted(_cfg(off_policy_steps=1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not sleep_mode_wanted(_cfg())


def test_cuda_engine_kwargs_place_each_rank_on_its_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_engine.cuda_engine_kwargs(3, colocated=True) == {"device_ids": [3], "enable_sleep_mode": True}
    assert vllm_engine.cuda_engine_kwargs(3, colocated=False) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_engine.cuda_engine_kwargs(3, colocated=True) == {}


def test_cpu_worker_sleep_and_wake_are_logged_noops(caplog):
    w = object.__new__(vllm_worker.VLLMWorker)  # no engine: sleep mode off must never touch it
    w.sleep_mode, w._engine = False, None
    monkey_said = vllm_worker._said_no_sleep
    monkey_said.clear()
    with caplog.at_level("INFO", logger="dsrl"):
        w.sleep(1)
        w.sleep(2)
        w.wake_up(["weights"])
    assert sum("sleep mode is off" in r.message for r in caplog.records) == 1
