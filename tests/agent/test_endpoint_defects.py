"""The agent endpoint trains what the agents saw (dsrl.agent.endpoint), over real HTTP on the SmolLM2
tokenizer with the scripted engine of test_agent_endpoint (completion of (episode e, call t) read
from the request seed e * 256 + t):

- a client that times out and retries the same request while its call waits joins that call (one
  completion trained, not two); a call whose client disconnected before its reply is not trained,
  whether it still waited (dropped when the agent's next call arrives) or was in the engine;
- group statistics count an episode once however many sequences it trains as (hand-computed:
  episodes A=1 in three sequences, B=1, C=0, D=0);
- rollout.failed_episodes: zero (a crashed agent's episode trains with reward 0) | drop (left out);
- a program agent's process group is killed at its episode's timeout and at the end of the round;
- the barrier names the episodes that never called (an HTTP client whose pool is smaller than the
  round's episodes), with the real `openai` client over a one-connection httpx pool;
- a chat template's refusal is a 400 naming the message;
- per-episode secrets: a wrong secret or another episode's token is refused, and off loopback a
  call without its token is refused (the two-host run is tests/multinode/test_agent_two_hosts.py)."""
from __future__ import annotations

import copy
import json
import logging
import os
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from dsrl.agent.episodes import episode_numbers
from dsrl.loss.advantages import compute_advantages
from test_agent_endpoint import endpoint  # noqa: F401  (the fixture: endpoints made and closed per test)
from test_agent_endpoint import N, TASKS, RecordingWorker, post_reward, seeds, texts




ONE_TASK = TASKS[:1]  # one group of N=2 episodes: r1-e0 and r1-e1


def _chat(base_url, eid, messages, timeout):
    return httpx.post(f"{base_url}/chat/completions", json={"model": "m", "messages": messages},
                      headers={"X-Episode-Id": eid}, timeout=timeout)


def _late_second_episode(base_url, episode_id, task, delay=2.0):
    """Episode r1-e1: calls only after `delay` s (its call releases the batch), then rewards 1."""
    time.sleep(delay)
    _chat(base_url, episode_id, task["messages"], 60).raise_for_status()
    post_reward(base_url, episode_id, 1.0).raise_for_status()


# ---------------------------------------------------------------------------------------------- retries
def test_a_retry_of_a_call_in_flight_joins_it(endpoint, tiny_tokenizer):
    """The first request times out at the barrier (its client disconnects) and the client sends it
    again, as the `openai` client does: one call, one completion trained, the retry gets it."""
    seen = {}

    def agent(base_url, episode_id, task):
        if episode_id.endswith("e1"):
            return _late_second_episode(base_url, episode_id, task)
        try:
            _chat(base_url, episode_id, task["messages"], 0.5)
            seen["first"] = "answered"
        except httpx.ReadTimeout:
            seen["first"] = "timed out"
        r = _chat(base_url, episode_id, task["messages"], 60)  # the retry: the same body
        r.raise_for_status()
        seen["reply"] = r.json()["choices"][0]["message"]["content"]
        post_reward(base_url, episode_id, 1.0).raise_for_status()

    ep, worker = endpoint(agent)
    samples, metrics = ep.run_round(ONE_TASK, n=N, seeds=[0])
    assert seen["first"] == "timed out"
    assert worker.batches == [((0, 0), (1, 0))]  # today: ((0, 0), (0, 1), (1, 0)): the retry was a second call
    assert [s.extra["episode"] for s in samples] == ["r1-e0", "r1-e1"]  # one sequence each
    assert seen["reply"] == tiny_tokenizer.decode(worker.sampled[(0, 0)], skip_special_tokens=True)
    model_ids = [t for t, m in zip(samples[0].response_ids, samples[0].extra["model_mask"]) if m]
    assert model_ids == worker.sampled[(0, 0)]
    assert metrics["agent/sequences"] == 1.0 and metrics["agent/split_episodes"] == 0.0
    assert metrics["agent/joined_calls"] == 0.5 and metrics["agent/orphan_calls"] == 0.0
    assert metrics["agent/calls"] == 1.0


def test_a_waiting_call_whose_client_left_is_not_trained(endpoint, tiny_tokenizer):
    """The client gives up on its call at the barrier and sends a different one: only that one trains."""
    second = [{"role": "user", "content": "Compute 0 + 1, briefly."}]

    def agent(base_url, episode_id, task):
        if episode_id.endswith("e1"):
            return _late_second_episode(base_url, episode_id, task)
        with pytest.raises(httpx.ReadTimeout):
            _chat(base_url, episode_id, task["messages"], 0.5)
        _chat(base_url, episode_id, second, 60).raise_for_status()
        post_reward(base_url, episode_id, 1.0).raise_for_status()

    ep, worker = endpoint(agent)
    samples, metrics = ep.run_round(ONE_TASK, n=N, seeds=[0])
    assert worker.batches == [((0, 1), (1, 0))]  # today: ((0, 0), (0, 1), (1, 0))
    assert [s.extra["episode"] for s in samples] == ["r1-e0", "r1-e1"]
    want = tiny_tokenizer.apply_chat_template(second, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert samples[0].prompt_ids == list(want)
    assert metrics["agent/orphan_calls"] == 0.5 and metrics["agent/sequences"] == 1.0


class SlowFirstBatch(RecordingWorker):
    """The engine takes `delay` s over its first batch (a client may disconnect meanwhile)."""

    def __init__(self, tok, texts, delay):
        super().__init__(tok, texts)
        self.delay = delay

    def generate(self, prompt_ids, **kw):
        if not self.batches:
            time.sleep(self.delay)
        return super().generate(prompt_ids, **kw)


def test_a_call_whose_client_left_while_in_the_engine_is_not_trained(endpoint, tiny_tokenizer):
    second = [{"role": "user", "content": "Compute 0 + 1, briefly."}]

    def agent(base_url, episode_id, task):
        with pytest.raises(httpx.ReadTimeout):
            _chat(base_url, episode_id, task["messages"], 0.4)  # in the engine for 1.5 s
        time.sleep(1.5)  # its completion comes back with no client
        _chat(base_url, episode_id, second, 60).raise_for_status()
        post_reward(base_url, episode_id, 1.0).raise_for_status()

    ep, worker = endpoint(agent, worker=SlowFirstBatch(tiny_tokenizer, texts, 1.5))
    samples, metrics = ep.run_round(ONE_TASK, n=1, seeds=[0])
    assert worker.batches == [((0, 0),), ((0, 1),)]
    assert len(samples) == 1  # today: 2 (the completion no client saw trained too)
    want = tiny_tokenizer.apply_chat_template(second, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert samples[0].prompt_ids == list(want)
    assert [t for t, m in zip(samples[0].response_ids, samples[0].extra["model_mask"]) if m] == worker.sampled[(0, 1)]
    assert metrics["agent/orphan_calls"] == 1.0 and metrics["agent/sequences"] == 1.0


# ---------------------------------------------------------------------------------------------- GRPO groups
A_B_C_D = {"rewards": torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0]), "group_ids": torch.zeros(6, dtype=torch.long),
           "episode_ids": torch.tensor([0, 0, 0, 1, 2, 3])}  # episode A in three sequences, B, C, D


@pytest.mark.parametrize("estimator,want", [
    # episodes 1, 1, 0, 0: mean 1/2, unbiased std sqrt(1/3): (r - 1/2) / (sqrt(1/3) + 1e-6)
    ("grpo", [0.5 / (3 ** -0.5 + 1e-6)] * 4 + [-0.5 / (3 ** -0.5 + 1e-6)] * 2),
    ("dr_grpo", [0.5] * 4 + [-0.5] * 2),
    # leave-one-out over the other episodes: A, B: 1 - (1 + 0 + 0) / 3; C, D: 0 - (1 + 1 + 0) / 3
    ("rloo", [2 / 3] * 4 + [-2 / 3] * 2),
])
def test_group_statistics_count_each_episode_once(estimator, want):
    data = {**A_B_C_D, "loss_mask": torch.ones(6, 3)}
    cfg = {"advantage_estimator": estimator, "grpo_std_normalization": True, "kl_coef": 0.0,
           "normalize_advantages": False}
    adv = compute_advantages(data, cfg)["advantages"]
    # today: the split episode counted 3 times, mean 4/6 (grpo: A..B 0.7071, C..D -1.4142)
    assert adv[:, 0].tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert bool((adv == adv[:, :1]).all())
    # the same numbers as the four episodes unsplit
    one_each = {"rewards": torch.tensor([1.0, 1.0, 0.0, 0.0]), "group_ids": torch.zeros(4, dtype=torch.long),
                "loss_mask": torch.ones(4, 3)}
    unsplit = compute_advantages(one_each, cfg)["advantages"][:, 0]
    assert torch.equal(adv[[0, 3, 4, 5], 0], unsplit)


def plain_estimator(rewards, mask, group_ids, config, kl=None):
    """A dotted-path estimator that knows nothing of episodes."""
    return mask * 0, mask * 0


def test_an_estimator_without_per_episode_is_refused_on_split_episodes():
    with pytest.raises(ValueError, match="plain_estimator.*per_episode"):
        compute_advantages({**A_B_C_D, "loss_mask": torch.ones(6, 3)},
                           {"advantage_estimator": "test_endpoint_defects.plain_estimator", "kl_coef": 0.0})


def test_split_episodes_carry_their_episode_into_the_group_statistics(endpoint):
    """A history-rewriting agent's episodes train as two sequences each; the samples name their
    episode and the advantages equal those of one sample per episode."""

    def rewriting(base_url, episode_id, task):
        for k in range(2):  # the same first message each time: not a continuation
            _chat(base_url, episode_id, task["messages"] + [{"role": "user", "content": f"try {k}"}], 60)
        post_reward(base_url, episode_id, float(int(episode_id[-1]) % 2)).raise_for_status()  # e1, e3: 1

    ep, _ = endpoint(rewriting)
    samples, metrics = ep.run_round(TASKS, n=N, seeds=seeds())
    assert metrics["agent/split_episodes"] == 1.0 and len(samples) == 8
    numbers = episode_numbers(samples)
    assert numbers == [0, 0, 1, 1, 2, 2, 3, 3]
    data = {"rewards": torch.tensor([s.reward for s in samples]), "group_ids": torch.tensor([s.group for s in samples]),
            "episode_ids": torch.tensor(numbers), "loss_mask": torch.ones(8, 2)}
    cfg = {"advantage_estimator": "grpo", "kl_coef": 0.0, "normalize_advantages": False}
    adv = compute_advantages(data, cfg)["advantages"][:, 0]
    # per group: episodes 0 and 1, one sequence each counted once: (0 - 1/2) / (std 0.7071 + 1e-6), etc.
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert adv.tolist() == pytest.approx([-a, -a, a, a, -a, -a, a, a], rel=1e-6)


# ---------------------------------------------------------------------------------------------- failed episodes
def _crashing_agent(base_url, episode_id, task):
    """r1-e1 crashes after its call (no reward); the others reward 1."""
    _chat(base_url, episode_id, task["messages"], 60).raise_for_status()
    if episode_id.endswith("e1"):
        raise RuntimeError("sandbox lost")
    post_reward(base_url, episode_id, 1.0).raise_for_status()


@pytest.mark.parametrize("mode", ["zero", "drop"])
def test_failed_episodes_zero_or_drop(endpoint, mode, caplog):
    ep, _ = endpoint(_crashing_agent, failed_episodes=mode)
    with caplog.at_level(logging.WARNING, logger="dsrl"):
        samples, metrics = ep.run_round(TASKS, n=N, seeds=seeds())
    got = [(s.extra["episode"], s.group, s.reward) for s in samples]
    if mode == "zero":
        assert got == [("r1-e0", 0, 1.0), ("r1-e1", 0, 0.0), ("r1-e2", 1, 1.0), ("r1-e3", 1, 1.0)]
        assert metrics["agent/dropped_episodes"] == 0.0
    else:  # r1-e1 left out of group 0: its other episode is the group
        assert got == [("r1-e0", 0, 1.0), ("r1-e2", 1, 1.0), ("r1-e3", 1, 1.0)]
        assert metrics["agent/dropped_episodes"] == 0.25
    assert metrics["agent/failed_episodes"] == 0.25 and metrics["agent/finish_agent_error"] == 0.25
    assert f"rollout.failed_episodes={mode}" in caplog.text and "r1-e1" in caplog.text


def test_failed_episodes_is_checked_before_anything_loads():
    from types import SimpleNamespace

    from dsrl.agent.config_checks import check_agent_config
    from dsrl.config.schema import RolloutConfig

    r = RolloutConfig(agent_endpoint=True, agent="cmd: python3", failed_episodes="skip", agent_host="no host!")
    errors = check_agent_config(SimpleNamespace(rollout=r))
    assert any("rollout.failed_episodes='skip'" in e for e in errors), errors
    assert any("rollout.agent_host='no host!'" in e for e in errors), errors


# ---------------------------------------------------------------------------------------------- program agents
PROGRAM = r'''
import json, os, subprocess, sys, time
task = json.load(sys.stdin)
out = os.environ["DSRL_TEST_PIDS"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # outlives this program
with open(out, "a") as f:
    f.write(json.dumps({"episode": os.environ["DSRL_EPISODE_ID"], "pid": os.getpid(), "child": child.pid}) + "\n")
if os.environ["DSRL_EPISODE_ID"].endswith("e0"):
    time.sleep(600)  # hangs without a call: killed at its episode's timeout
import httpx
base = os.environ["OPENAI_BASE_URL"]
httpx.post(f"{base}/chat/completions", json={"model": "m", "messages": task["messages"]}, timeout=60).raise_for_status()
httpx.post(os.environ["DSRL_REWARD_URL"], json={"reward": 1.0}, timeout=60).raise_for_status()
'''


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: dead, not yet reaped
    except FileNotFoundError:
        return True


def test_program_agents_are_killed_at_the_timeout_and_at_the_round_end(endpoint, tmp_path, monkeypatch):
    from dsrl.agent.endpoint.server import load_agent

    script = tmp_path / "agent.py"
    script.write_text(PROGRAM)
    pids = tmp_path / "pids.jsonl"
    monkeypatch.setenv("DSRL_TEST_PIDS", str(pids))
    # the hung program is killed after 8 s without a call (room for the other's start-up on a busy machine)
    ep, _ = endpoint(load_agent(f"cmd: {sys.executable} {script}"), timeout_s=8.0)
    t0 = time.monotonic()
    try:
        samples, metrics = ep.run_round(ONE_TASK, n=N, seeds=[0])
        took = time.monotonic() - t0
        rows = {r["episode"]: r for r in map(json.loads, pids.read_text().splitlines())}
        deadline = time.monotonic() + 5  # SIGKILL is delivered at once; the reaping may lag
        while time.monotonic() < deadline and not all(_dead(r[k]) for r in rows.values() for k in ("pid", "child")):
            time.sleep(0.05)
        alive = {(e, k): r[k] for e, r in rows.items() for k in ("pid", "child") if not _dead(r[k])}
        # today: the hung program and both children live on after the round
        assert alive == {}, alive
        assert [s.extra["episode"] for s in samples] == ["r1-e1"] and took < 30
        assert metrics["agent/finish_timeout"] == 0.5 and metrics["agent/finish_rewarded"] == 0.5
    finally:  # whatever the code under test did: nothing of this test outlives it
        for r in (map(json.loads, pids.read_text().splitlines()) if pids.exists() else []):
            for k in ("pid", "child"):
                try:
                    os.kill(r[k], 9)
                except ProcessLookupError:
                    pass


# ---------------------------------------------------------------------------------------------- the barrier
def test_the_barrier_names_the_episodes_that_never_called(endpoint, caplog):
    """One shared `openai` client whose httpx pool has one connection, two episodes: the first
    call holds the connection at the barrier, the second episode's request waits in the client's
    pool until its episode times out. The warning names it and says why."""
    shared = openai.OpenAI(base_url="http://unused", api_key="x", max_retries=0, timeout=60,
                           http_client=httpx.Client(limits=httpx.Limits(max_connections=1)))
    order = []
    lock = threading.Lock()

    def agent(base_url, episode_id, task):
        with lock:
            order.append(episode_id)
            if len(order) == 2:
                time.sleep(0.3)  # the first episode's request takes the connection first
        c = shared.with_options(base_url=base_url)
        c.chat.completions.create(model="m", messages=task["messages"], extra_headers={"X-Episode-Id": episode_id})
        post_reward(base_url, episode_id, 1.0).raise_for_status()

    ep, _ = endpoint(agent, timeout_s=2.0)  # warning after min(30, 2 / 2) s
    with caplog.at_level(logging.WARNING, logger="dsrl"):
        samples, metrics = ep.run_round(ONE_TASK, n=N, seeds=[0])
    shared.close()
    warnings = [r.getMessage() for r in caplog.records if "made no call yet" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # today: none (the barrier waits silently for the timeout)
    silent = order[1]
    assert f"made no call yet: {silent}. " in warnings[0], warnings
    assert "connection pool of at least 2 connections" in warnings[0]
    assert [s.extra["episode"] for s in samples] == [order[0]]
    assert metrics["agent/finish_timeout"] == 0.5


# ---------------------------------------------------------------------------------------------- chat templates
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                   "{{ raise_exception('a system message must come first') }}{% endif %}"
                   "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_refusal_is_a_400_naming_the_message(endpoint, tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = STRICT_TEMPLATE
    got = {}

    def agent(base_url, episode_id, task):
        c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60,
                          default_headers={"X-Episode-Id": episode_id})
        bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
        try:
            c.chat.completions.create(model="m", messages=bad)
        except openai.APIStatusError as e:
            got["first"] = (e.status_code, e.body)
        messages = [{"role": "user", "content": "hi"}]
        reply = c.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "system", "content": "late"}]
        try:  # a continuation: the new messages rendered alone
            c.chat.completions.create(model="m", messages=messages)
        except openai.APIStatusError as e:
            got["continued"] = (e.status_code, e.body)
        post_reward(base_url, episode_id, 1.0).raise_for_status()

    ep, _ = endpoint(agent, tokenizer=tok)
    samples, metrics = ep.run_round(ONE_TASK, n=1, seeds=[0])
    for key, index in (("first", 1), ("continued", 2)):
        status, body = got[key]  # today: 500 Internal Server Error
        assert status == 400, got
        assert body["code"] == "chat_template_error" and body["param"] == f"messages[{index}]", body
        assert "a system message must come first" in body["message"] and "role 'system'" in body["message"]
    assert len(samples) == 1 and metrics["agent/refused_requests"] == 2.0


# ---------------------------------------------------------------------------------------------- secrets
def test_a_wrong_secret_or_another_episodes_token_is_refused(endpoint):
    results = {}

    def agent(base_url, episode_id, task):
        book = ep.book
        mine = book.episodes[episode_id]
        other = book.episodes["r1-e1" if episode_id == "r1-e0" else "r1-e0"]
        root = base_url[:-len("/v1")]
        if episode_id == "r1-e0":
            body = {"model": "m", "messages": task["messages"]}
            results["wrong secret"] = httpx.post(f"{root}/episodes/{other.id}.{mine.secret}/v1/chat/completions",
                                                 json=body, timeout=60).status_code
            results["other's reward, my key"] = httpx.post(
                f"{base_url}/episodes/{other.id}/reward", json={"reward": 1.0},
                headers={"Authorization": f"Bearer {mine.token}"}, timeout=60).status_code
        c = openai.OpenAI(base_url=f"{root}/episodes/{mine.token}/v1", api_key=mine.token, max_retries=0, timeout=60)
        c.chat.completions.create(model="m", messages=task["messages"])
        results[episode_id] = httpx.post(f"{root}/episodes/{mine.token}/v1/reward", json={"reward": 1.0},
                                         timeout=60).status_code

    ep, _ = endpoint(agent)
    samples, metrics = ep.run_round(ONE_TASK, n=N, seeds=[0])
    assert results == {"wrong secret": 403, "other's reward, my key": 403, "r1-e0": 200, "r1-e1": 200}
    assert metrics["agent/finish_rewarded"] == 1.0 and metrics["agent/refused_requests"] == 2.0


def test_off_loopback_every_call_needs_its_token(endpoint):
    """Bound to every address (rollout.agent_host=0.0.0.0): a bare episode id is refused; the
    agent is given its token as its episode id and trains with it unchanged."""
    results = {}

    def agent(base_url, episode_id, task):
        eid = episode_id.partition(".")[0]
        results["bare id"] = _chat(base_url, eid, task["messages"], 60).status_code
        results["bare reward"] = post_reward(base_url, eid, 1.0).status_code
        r = _chat(base_url, episode_id, task["messages"], 60)  # the token as X-Episode-Id
        results["token"] = r.status_code
        results["reward"] = post_reward(base_url, episode_id, 1.0).status_code

    ep, _ = endpoint(agent, host="0.0.0.0")
    samples, metrics = ep.run_round(ONE_TASK, n=1, seeds=[0])
    assert results == {"token": 200, "bare id": 401, "bare reward": 401, "reward": 200}
    assert len(samples) == 1 and metrics["agent/finish_rewarded"] == 1.0
