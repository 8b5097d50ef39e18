"""ResilientWorker's retry/restart logic around scripted stand-in engines (the real vLLM engine
is exercised in test_engine_restart.py): a death noticed while waiting, an EngineDeadError, a
hang past the timeout, a failed restart -> rebuilt, weights replayed, call retried, counted;
other errors pass through untouched; restarts exhausted -> a RolloutEngineError naming the
engine and the cause."""
from __future__ import annotations

import threading

import pytest

from dsrl.rollout.resilient import ResilientWorker, RolloutEngineError


class EngineDeadError(RuntimeError):
    """Named like vLLM's: the wrapper matches the class name."""


class ScriptedEngine:
    """Each call (generate or push_weights, in order) does what the script says: "ok", "die" (its processes exit while the
    call blocks, as vLLM's client does), "dead" (raises EngineDeadError), "hang" (blocks with
    the processes alive), "bad" (a ValueError: the request's fault, not the engine's)."""

    def __init__(self, actions, log):
        self.actions, self.log = list(actions), log
        self.alive, self.killed = True, False
        self.unblock = threading.Event()
        self.reloads, self.pushes = 0, []
        log.append(self)

    def generate(self, prompts, **kwargs):
        action = self.actions.pop(0) if self.actions else "ok"
        if action == "die":
            self.alive = False
            self.unblock.wait()
            raise EngineDeadError("woken after the kill")
        if action == "dead":
            raise EngineDeadError("engine core died")
        if action == "hang":
            self.unblock.wait()
            raise EngineDeadError("woken after the kill")
        if action == "bad":
            raise ValueError("prompt too long")
        return [f"out:{p}" for p in prompts]

    def push_weights(self, state, step):
        action = self.actions.pop(0) if self.actions else "ok"
        if action == "die":
            self.alive = False
            self.unblock.wait()
            raise EngineDeadError("woken after the kill")
        self.pushes.append((step, state))
        return 0.0

    reloadable = True  # False: like a CUDA IPC push, the pushed weights died with the engine

    def reload_pushed_weights(self):
        self.reloads += 1
        return self.reloadable

    def engine_alive(self):
        return self.alive

    def kill(self):
        self.killed, self.alive = True, False
        self.unblock.set()

    def close(self):
        self.unblock.set()


def _worker(scripts, *, max_restarts=2, timeout_s=30.0):
    """A ResilientWorker whose k-th engine follows scripts[k] ("fail" = its construction fails)."""
    engines, builds = [], iter(scripts)

    def make():
        script = next(builds, [])
        if script == "fail":
            raise OSError("no memory for the KV cache")
        return ScriptedEngine(script, engines)

    rw = ResilientWorker(make, name="engine 7 (/m)", max_restarts=max_restarts, timeout_s=timeout_s, poll_s=0.02)
    return rw, engines


def test_death_during_a_call_restarts_replays_weights_and_retries():
    rw, engines = _worker([["ok", "ok", "die"], []])
    assert rw.push_weights({"w": 1}, 3) == 0.0
    assert rw.generate(["a", "b"]) == ["out:a", "out:b"]
    assert rw.pop_metrics() == {"rollout/restarts": 0.0}
    assert rw.generate(["c"]) == ["out:c"]  # the first engine died during this call
    assert len(engines) == 2 and engines[0].killed and not engines[1].killed
    assert engines[1].reloads == 1  # the new engine got the pushed weights back
    assert rw.pop_metrics() == {"rollout/restarts": 1.0}
    assert rw.pop_metrics() == {"rollout/restarts": 0.0}
    assert rw.total_restarts == 1


def test_a_rebuilt_engine_that_cannot_reload_the_pushed_weights_stops_the_run_naming_it(monkeypatch):
    """A CUDA IPC push is not staged by the wrapper and a new engine cannot re-read it: the rebuilt
    engine would serve the initial weights while the step trains on its samples as on-policy."""
    monkeypatch.setattr(ScriptedEngine, "reloadable", False)
    rw, engines = _worker([["ok", "die"], []])
    rw.push_weights({"w": 1}, 3)
    with pytest.raises(RolloutEngineError, match=r"engine 7 \(/m\): the engine was rebuilt but cannot load the "
                                                 r"trainer's last pushed weights again"):
        rw.generate(["c"])
    assert len(engines) == 2 and engines[1].reloads == 1 and engines[1].killed  # tried, then stopped
    with pytest.raises(RuntimeError, match="used after close"):
        rw.generate(["d"])


def test_before_any_push_a_rebuilt_engine_needs_no_reload(monkeypatch):
    monkeypatch.setattr(ScriptedEngine, "reloadable", False)
    rw, engines = _worker([["die"], []])
    assert rw.generate(["x"]) == ["out:x"] and engines[1].reloads == 0


def test_engine_dead_error_and_hang_count_as_engine_failures():
    rw, engines = _worker([["dead"], ["hang"], []], timeout_s=0.3)
    assert rw.generate(["x"]) == ["out:x"]
    assert [e.killed for e in engines] == [True, True, False]
    assert engines[2].reloads == 0  # nothing was pushed: the fresh engine's own weights are right
    assert rw.pop_metrics() == {"rollout/restarts": 2.0}


def test_a_failed_restart_is_one_more_failed_attempt():
    rw, engines = _worker([["dead"], "fail", []])
    assert rw.generate(["x"]) == ["out:x"]
    assert len(engines) == 2 and rw.pop_metrics() == {"rollout/restarts": 1.0}


def test_other_errors_pass_through_without_a_restart():
    rw, engines = _worker([["bad"]])
    with pytest.raises(ValueError, match="prompt too long"):
        rw.generate(["x"])
    assert len(engines) == 1 and not engines[0].killed
    assert rw.generate(["y"]) == ["out:y"]


def test_a_push_that_kills_the_engine_is_pushed_again():
    rw, engines = _worker([["ok", "die"], []])
    rw.push_weights({"w": 1}, 1)
    rw.push_weights({"w": 2}, 2)
    assert engines[1].pushes == [(2, {"w": 2})]


def test_restarts_exhausted_name_the_engine_and_the_cause():
    rw, engines = _worker([["dead"], ["die"]], max_restarts=1)
    with pytest.raises(RolloutEngineError, match=r"engine 7 \(/m\): generate failed 2 time\(s\) "
                                                 r"\(rollout.max_restarts=1\); last cause: the engine's processes "
                                                 r"exited"):
        rw.generate(["x"])
    assert all(e.killed for e in engines)
    rw.close()  # nothing left to close
    with pytest.raises(RuntimeError, match="used after close"):
        rw.generate(["x"])


def test_max_restarts_zero_fails_at_the_first_death():
    rw, engines = _worker([["dead"]], max_restarts=0)
    with pytest.raises(RolloutEngineError, match="failed 1 time.*last cause: EngineDeadError: engine core died"):
        rw.generate(["x"])
    assert len(engines) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_restarts=-1"):
        ResilientWorker(lambda: None, name="e", max_restarts=-1, timeout_s=1.0)
