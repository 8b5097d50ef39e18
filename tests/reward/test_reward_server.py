"""Rewards from a server (reward.url): a small HTTP reward server on 127.0.0.1 scores completions;
failures are retried within the sample's time budget, what still fails or is too slow scores 0 and
is counted, calls run concurrently, and bad configs name their keys."""
from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hydra import compose, initialize_config_dir

from dsrl.config.schema import register_configs, to_config
from dsrl.data.types import Prompt
from dsrl.distributed.ports import free_port
from dsrl.errors import ConfigError
from dsrl.reward.http import RemoteReward, RewardServerError
from dsrl.reward.registry import build_verifier
from dsrl.rollout.rewards import RewardGuard
from dsrl.rollout.samples import generate_samples
from dsrl.rollout.vllm_engine import Completion
from dsrl.validation.validate import validate

register_configs()
CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A client that gave up (the /slow timeouts) breaks the pipe: expected here."""


class _Server:
    """Paths: /exact (1.0 when completion == answer, as {"reward": x}), /number (a bare number),
    /flaky (503 for the first `fail_first` attempts of each completion), /slow (sleeps 5 s),
    /bad (HTTP 400), /text (not JSON), /barrier (answers only once `barrier` parties are waiting).
    Every request body is recorded with its path."""

    def __init__(self, fail_first=2, parties=4):
        self.requests, self.attempts = [], {}
        self.fail_first = fail_first
        self.barrier = threading.Barrier(parties, timeout=3)
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                return

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append((self.path, body))
                    key = (self.path, body["completion"])
                    outer.attempts[key] = outer.attempts.get(key, 0) + 1
                    attempt = outer.attempts[key]
                if self.path == "/flaky" and attempt <= outer.fail_first:
                    return self._send(503, b"busy")
                if self.path == "/slow":
                    time.sleep(5)
                if self.path == "/bad":
                    return self._send(400, b"no")
                if self.path == "/text":
                    return self._send(200, b"not json")
                if self.path == "/barrier":
                    try:
                        outer.barrier.wait()
                    except threading.BrokenBarrierError:
                        return self._send(500, b"alone")
                reward = float(body["completion"] == body["answer"])
                if self.path == "/number":
                    return self._send(200, json.dumps(reward).encode())
                return self._send(200, json.dumps({"reward": reward}).encode())

            def _send(self, code, data):
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def _prompt(q="What is 2 + 3?", answer="5", **meta):
    return Prompt(messages=[{"role": "user", "content": q}], answer=answer, meta=meta)


def test_server_scores_and_gets_the_sample(server):
    fn = RemoteReward(server.url + "/exact", timeout_s=5)
    p = _prompt(id="p7", operands=(2, 3))
    assert fn("5", p) == 1.0 and fn("6", p) == 0.0
    assert RemoteReward(server.url + "/number", timeout_s=5)("5", p) == 1.0
    path, body = server.requests[0]
    assert path == "/exact"
    assert body == {"completion": "5", "prompt": "What is 2 + 3?", "answer": "5",
                    "messages": [{"role": "user", "content": "What is 2 + 3?"}],
                    "meta": {"id": "p7", "operands": [2, 3]}}


def test_failures_are_retried_within_the_budget(server):
    p = _prompt()
    assert RemoteReward(server.url + "/flaky", timeout_s=10, retries=2)("5", p) == 1.0
    assert server.attempts[("/flaky", "5")] == 3  # two 503s, then the answer
    with pytest.raises(RewardServerError, match=r"/flaky: no reward after 2 attempt\(s\).*HTTP 503"):
        RemoteReward(server.url + "/flaky", timeout_s=10, retries=1)("6", p)
    assert server.attempts[("/flaky", "6")] == 2


def test_client_errors_are_not_retried(server):
    with pytest.raises(RewardServerError, match="HTTP 400.*not retried"):
        RemoteReward(server.url + "/bad", timeout_s=5, retries=3)("5", _prompt())
    assert server.attempts[("/bad", "5")] == 1
    with pytest.raises(RewardServerError, match="no reward after 3 attempt.*not JSON"):
        RemoteReward(server.url + "/text", timeout_s=5, retries=2)("5", _prompt())


def test_refused_connection_is_retried_then_counted():
    url = f"http://127.0.0.1:{free_port()}/r"  # nothing listens there
    guard = RewardGuard(RemoteReward(url, timeout_s=5, retries=2), timeout_s=5)
    assert guard.score("5", _prompt(), where="prompt 0 (sample 0)") == 0.0
    assert guard.pop_metrics() == {"reward/errors": 1.0, "reward/timeouts": 0.0}


def test_slow_server_is_a_counted_timeout_never_a_hang(server):
    guard = RewardGuard(RemoteReward(server.url + "/slow", timeout_s=0.5, retries=1), timeout_s=0.5, concurrency=4)
    t0 = time.monotonic()
    rewards = guard.score_many([("5", _prompt(), f"sample {i}") for i in range(4)])
    elapsed = time.monotonic() - t0
    assert rewards == [0.0] * 4
    m = guard.pop_metrics()
    assert m["reward/errors"] + m["reward/timeouts"] == 4.0
    assert elapsed < 4.5, elapsed  # bounded by the 0.5 s budget, far below the server's 5 s sleep


def test_calls_run_concurrently(server):
    """The /barrier path answers only when 4 requests wait at once."""
    items = [("5", _prompt(), f"sample {i}") for i in range(4)]
    guard = RewardGuard(RemoteReward(server.url + "/barrier", timeout_s=8, retries=0), timeout_s=8, concurrency=4)
    assert guard.score_many(items) == [1.0] * 4
    serial = RewardGuard(RemoteReward(server.url + "/barrier", timeout_s=8, retries=0), timeout_s=8, concurrency=1)
    server.barrier.reset()
    assert serial.score_many(items[:1]) == [0.0]  # alone at the barrier: HTTP 500 after its 3 s wait
    assert serial.pop_metrics()["reward/errors"] == 1.0


def test_rewards_stay_aligned_with_their_samples(server):
    class Worker:
        def generate(self, prompt_ids, **kw):
            return [[Completion([1], [-0.1], "stop", t) for t in ("5", "4", "5")],
                    [Completion([1], [-0.1], "stop", t) for t in ("9", "7")]]

    prompts = [_prompt(), _prompt("What is 3 + 4?", "7")]
    guard = RewardGuard(RemoteReward(server.url + "/exact", timeout_s=5), timeout_s=5, concurrency=3)
    samples = generate_samples(Worker(), [[1], [2]], prompts, guard, n=3, temperature=1.0, top_p=1.0,
                               max_tokens=4, show_progress=False)
    assert [(s.group, s.text, s.reward) for s in samples] == [
        (0, "5", 1.0), (0, "4", 0.0), (0, "5", 1.0), (1, "9", 0.0), (1, "7", 1.0)]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_config_builds_the_server_verifier_and_names_bad_keys():
    cfg = _cfg("reward.url=http://127.0.0.1:9/score", "reward.retries=1")
    validate(cfg)
    fn = build_verifier(cfg.reward, source=None)
    assert isinstance(fn, RemoteReward) and fn.url == "http://127.0.0.1:9/score" and fn.retries == 1
    for overrides, keys in [(("reward.url=http://x/r", "reward.fn=arith"), ("reward.url", "reward.fn")),
                            (("reward.url=ftp://x/r",), ("reward.url", "http://")),
                            (("reward.retries=-1",), ("reward.retries",)),
                            (("reward.concurrency=0",), ("reward.concurrency",))]:
        with pytest.raises(ConfigError) as e:
            validate(_cfg(*overrides))
        for key in keys:
            assert key in str(e.value), (key, str(e.value))
