"""Engine restarts with the REAL vLLM worker on the tiny Llama: the engine-core process (a child
of this test process named VLLM::EngineCore) is killed between calls, during a call, or frozen
(SIGSTOP: a hang) -> the call still succeeds after one restart, the restart is counted, the
rebuilt engine serves the weights pushed before the kill (its outputs equal the old engine's),
and no process of a dead engine is left behind. max_restarts=0 -> an error naming the engine.
One engine (and its restarts) is shared by the module; the tests run in file order."""
from __future__ import annotations

import functools
import os
import signal
import threading

import psutil
import pytest
import torch

from dsrl.rollout.resilient import ResilientWorker, RolloutEngineError
from dsrl.rollout.vllm_worker import VLLMWorker

pytestmark = pytest.mark.slow

NAME = "test engine (tiny)"
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [42, 43, 44, 45, 46]]


def _engine_cores() -> list:
    """Live children of this process that vLLM named VLLM::EngineCore (psutil shows 15 chars)."""
    out = []
    for p in psutil.Process().children():
        try:
            if p.name().startswith("VLLM::EngineCor") and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _the_core() -> psutil.Process:
    cores = _engine_cores()
    assert len(cores) == 1, cores
    return cores[0]


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _greedy(rw, prompts=PROMPTS, max_tokens=12):
    return [g[0].token_ids for g in rw.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=max_tokens)]


def _sampled(rw, prompts=PROMPTS, n=2, max_tokens=12):
    """Seeded sampling (one seed per prompt): the same on any engine with the same weights."""
    groups = rw.generate(prompts, n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens,
                         seeds=[1000 + i for i in range(len(prompts))])
    return [[(c.token_ids, c.logprobs) for c in g] for g in groups]


@pytest.fixture(scope="module")
def rw(tiny_model_path, tmp_path_factory):
    weights = str(tmp_path_factory.mktemp("engine_restart") / "weights")
    worker = ResilientWorker(functools.partial(VLLMWorker, str(tiny_model_path), weights_dir=weights, kv_cache_gib=1),
                             name=NAME, max_restarts=2, timeout_s=300.0, poll_s=0.2)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def perturbed(tiny_model_path):
    """The tiny model's weights with large noise on every matrix (tied lm_head left out)."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(str(tiny_model_path), "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    return {k: (v + 0.5 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v).contiguous()
            for k, v in state.items() if k != "lm_head.weight"}


def test_kill_between_calls_restarts_with_the_pushed_weights(rw, perturbed):
    base = _greedy(rw)
    rw.push_weights(perturbed, 1)
    pushed, pushed_sampled = _greedy(rw), _sampled(rw)
    assert pushed != base  # the push changed the outputs: comparing outputs compares weights
    assert rw.pop_metrics() == {"rollout/restarts": 0.0}

    core = _the_core()
    core.kill()
    after = _greedy(rw)
    assert rw.pop_metrics() == {"rollout/restarts": 1.0}
    assert after == pushed  # the rebuilt engine serves the pushed weights, not the model folder's
    assert _sampled(rw) == pushed_sampled  # token ids and sampling log-probs, exactly
    assert _gone(core) and _the_core().pid != core.pid


def test_kill_during_generate(rw):
    prompts = [[i, i + 1, i + 2] for i in range(100, 116)]
    core = _the_core()
    killed = threading.Event()

    def kill_once_busy():
        # Kill only once the engine has spent 0.5 s of CPU on this call: it is mid-generation.
        start = sum(core.cpu_times()[:2])
        while sum(core.cpu_times()[:2]) - start < 0.5:
            threading.Event().wait(0.05)
        core.kill()
        killed.set()

    threading.Thread(target=kill_once_busy, daemon=True).start()
    groups = rw.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=120)
    assert killed.is_set()
    assert rw.pop_metrics() == {"rollout/restarts": 1.0}, "the kill did not land during the call"
    # A whole answer from the new engine (long sampled texts are not compared token for token:
    # the old engine's prefix cache and batching make them differ in the last bits).
    assert [len(g) for g in groups] == [4] * len(prompts)
    for c in (c for g in groups for c in g):
        assert len(c.token_ids) == len(c.logprobs) > 0 and c.finish_reason in ("length", "stop")
        assert all(lp <= 0.0 for lp in c.logprobs)
    assert _gone(core)


def test_hung_engine_is_killed_at_the_timeout(rw):
    expected = _greedy(rw)
    core = _the_core()
    os.kill(core.pid, signal.SIGSTOP)  # alive but silent: only the timeout can tell
    rw.timeout_s = 5.0
    try:
        assert _greedy(rw) == expected
    finally:
        rw.timeout_s = 300.0
    assert rw.pop_metrics() == {"rollout/restarts": 1.0}
    assert _gone(core)


def test_max_restarts_zero_names_the_engine_and_leaves_no_process(rw):
    cores_before = _engine_cores()
    rw.max_restarts = 0
    _the_core().kill()
    with pytest.raises(RolloutEngineError, match=r"test engine \(tiny\): generate failed 1 time\(s\) "
                                                 r"\(rollout.max_restarts=0\); last cause: "):
        _greedy(rw)
    assert all(_gone(p) for p in cores_before)
    leftovers = [p for p in psutil.Process().children(recursive=True) if not _gone(p) and p.name().startswith("VLLM")]
    assert leftovers == []
