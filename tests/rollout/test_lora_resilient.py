"""ResilientWorker around a LoRA engine (scripted stand-in; the real engine is in
test_lora_sync.py): it reports the engine's `lora_enabled`, passes load_adapter / probe_sampled
through, and a rebuilt engine gets the last loaded adapter (same folder, same id) before the
failed call is retried."""
from __future__ import annotations

from dsrl.rollout.resilient import ResilientWorker


class EngineDeadError(RuntimeError):
    """Named like vLLM's: the wrapper matches the class name."""


class LoraStandIn:
    def __init__(self, log, fail_first_generate):
        self.log, self.fail = log, fail_first_generate
        self.lora_enabled = True
        self.adapters, self.alive = [], True
        log.append(self)

    def load_adapter(self, path, adapter_id):
        self.adapters.append((path, adapter_id))
        return 0.0

    def probe_sampled(self, prompts, *, max_tokens, seed):
        return [([seed] * max_tokens, [-1.0] * max_tokens) for _ in prompts]

    def generate(self, prompts, **kwargs):
        if self.fail:
            self.fail = False
            raise EngineDeadError("engine core died")
        return [f"{p}:{self.adapters[-1][1] if self.adapters else 'base'}" for p in prompts]

    def engine_alive(self):
        return self.alive

    def reload_pushed_weights(self):
        return False

    def kill(self):
        self.alive = False

    def close(self):
        self.alive = False


def test_rebuilt_engine_gets_the_last_adapter_back():
    log = []
    rw = ResilientWorker(lambda: LoraStandIn(log, fail_first_generate=not log), name="lora engine",
                         max_restarts=1, timeout_s=30.0, poll_s=0.01)
    assert rw.lora_enabled
    rw.load_adapter("/dev/shm/x/step1-id1", 1)
    rw.load_adapter("/dev/shm/x/step2-id2", 2)
    assert rw.probe_sampled([[5, 6]], max_tokens=3, seed=7) == [([7, 7, 7], [-1.0, -1.0, -1.0])]
    assert rw.generate(["p"]) == ["p:2"]  # first engine died; the rebuilt one serves adapter 2
    assert len(log) == 2 and log[1].adapters == [("/dev/shm/x/step2-id2", 2)]
    assert rw.pop_metrics()["rollout/restarts"] == 1.0
