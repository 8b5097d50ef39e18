"""The OpenAI-compatible agent endpoint (dsrl.agent.endpoint) driven by the real `openai` client
over real HTTP, on the SmolLM2 tokenizer. The engine is the scripted stand-in of agent_testkit
(completion of (episode e, call t) read from the request seed e * 256 + t), so every token the
endpoint records can be checked against what was "sampled"; the real engine runs in
tests/e2e/test_e2e_agent_endpoint.py.

What is checked: token exactness (the trained sequence decodes to the chat template of the whole
conversation, the log-probs are the sampled ones on model tokens and 0 on the agent's), a
rewritten history trains as separate sequences, count-based batching (the same batches whatever
the agents' timing), typed errors that leave the round running, timeouts, /v1/completions."""
from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest

from dsrl.agent.endpoint.book import CALL_SEED_STRIDE, Limits
from dsrl.agent.endpoint.server import AgentEndpoint, load_agent
from dsrl.registry import PluginError
from agent_testkit import ScriptedWorker

LIMITS = Limits(max_new_tokens=16, max_episode_tokens=200, max_model_len=512, max_calls=4, temperature=1.0, top_p=1.0)
TASKS = [{"messages": [{"role": "user", "content": f"Compute {g} + 1."}], "answer": str(g + 1)} for g in range(2)]
N = 2  # episodes per task


class RecordingWorker(ScriptedWorker):
    """ScriptedWorker that also records the (episode, call) pairs of each generate call."""

    def __init__(self, tok, texts):
        super().__init__(tok, texts, stride=CALL_SEED_STRIDE)
        self.batches = []

    def generate(self, prompt_ids, **kw):
        self.batches.append(tuple(divmod(int(s), CALL_SEED_STRIDE) for s in kw["seeds"]))
        self.prompts = getattr(self, "prompts", []) + [list(p) for p in prompt_ids]
        return super().generate(prompt_ids, **kw)


def texts(e, t):
    return "<tool>calc: 1 + 2</tool>" if t == 0 else f"answer {e}"


def seeds():
    # seed of task g = its first episode's index * 256: episode e's call t samples with seed e * 256 + t
    return [g * N * CALL_SEED_STRIDE for g in range(len(TASKS))]


def client(base_url, eid):
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60,
                         default_headers={"X-Episode-Id": eid})


def post_reward(base_url, eid, reward):
    return httpx.post(f"{base_url}/episodes/{eid}/reward", json={"reward": reward}, timeout=60)


def history_agent(base_url, episode_id, task):
    """Keeps its history: two calls, then the reward (1 if the reply names the episode)."""
    c = client(base_url, episode_id)
    messages = [{"role": "system", "content": "Use the tool."}, *task["messages"]]
    for _ in range(2):
        reply = c.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "<result>3</result>"}]
    post_reward(base_url, episode_id, float(episode_id.endswith("e1"))).raise_for_status()


@pytest.fixture()
def endpoint(tiny_tokenizer):
    made = []

    def make(agent, worker=None, limits=LIMITS, tokenizer=None, **kw):
        tok = tokenizer or tiny_tokenizer
        w = worker or RecordingWorker(tok, texts)
        ep = AgentEndpoint(w, tok, limits=limits, agent=agent, **kw).start()
        made.append(ep)
        return ep, w

    yield make
    for ep in made:
        ep.close()


def test_history_kept_is_one_token_exact_sequence(endpoint, tiny_tokenizer):
    tok = tiny_tokenizer
    ep, worker = endpoint(history_agent)
    samples, metrics = ep.run_round(TASKS, n=N, seeds=seeds())
    assert len(samples) == len(TASKS) * N
    assert [s.group for s in samples] == [0, 0, 1, 1]
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0, 0.0]  # only episode r1-e1 posted 1
    for e, s in enumerate(samples):
        first = [{"role": "system", "content": "Use the tool."}, *TASKS[s.group]["messages"]]
        assert s.prompt_ids == tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)["input_ids"]
        # The whole sequence is what the chat template writes for the conversation (reference:
        # the template applied to the full text conversation, independent of the endpoint's splicing).
        replies = [tok.decode(worker.sampled[(e, t)], skip_special_tokens=True) for t in range(2)]
        convo = first + [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": "<result>3</result>"},
                         {"role": "assistant", "content": replies[1]}]
        want = tok.apply_chat_template(convo, tokenize=False)
        got = tok.decode(s.prompt_ids + s.response_ids, skip_special_tokens=False)
        assert want.startswith(got) and want[len(got):].strip() == "", (got, want)
        # model tokens are exactly the sampled ones with their log-probs; the agent's are masked, 0.0
        mask = s.extra["model_mask"]
        model_ids = [t for t, m in zip(s.response_ids, mask) if m]
        assert model_ids == worker.sampled[(e, 0)] + worker.sampled[(e, 1)]
        lps = [lp for lp, m in zip(s.rollout_log_probs, mask) if m]
        want_lps = [-(k + 1) / 100 - e for k in range(len(worker.sampled[(e, 0)]))] + \
                   [-(k + 1) / 100 - e for k in range(len(worker.sampled[(e, 1)]))]
        assert lps == pytest.approx(want_lps)
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, mask) if not m)
        assert 0 < mask.count(0) < len(mask) and mask[-1] == 1
        # call 1's prompt sent to the engine = the sequence up to its completion
        span = s.extra["turn_spans"][1]
        assert (s.prompt_ids + s.response_ids[:span[0]]) in worker.prompts
    assert metrics["agent/split_episodes"] == 0.0 and metrics["agent/calls"] == 2.0
    assert metrics["agent/finish_rewarded"] == 1.0 and metrics["agent/refused_requests"] == 0.0
    assert worker.batches == [((0, 0), (1, 0), (2, 0), (3, 0)), ((0, 1), (1, 1), (2, 1), (3, 1))]


def rewriting_agent(base_url, episode_id, task):
    """Drops its first exchange from the history: the second call cannot continue the first."""
    c = client(base_url, episode_id)
    c.chat.completions.create(model="m", messages=task["messages"])
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Start over: 2 + 2?"}])
    post_reward(base_url, episode_id, 0.5).raise_for_status()


def test_rewritten_history_trains_as_separate_sequences(endpoint, tiny_tokenizer):
    ep, worker = endpoint(rewriting_agent)
    samples, metrics = ep.run_round(TASKS[:1], n=1, seeds=[0])
    assert len(samples) == 2 and [s.group for s in samples] == [0, 0] and [s.reward for s in samples] == [0.5, 0.5]
    second = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Start over: 2 + 2?"}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]
    assert samples[1].prompt_ids == second and samples[1].response_ids == worker.sampled[(0, 1)]
    assert samples[1].extra["model_mask"] == [1] * len(second[:0] + samples[1].response_ids)
    assert metrics["agent/split_episodes"] == 1.0 and metrics["agent/sequences"] == 2.0


def jittery_agent(base_url, episode_id, task):
    """history_agent with random sleeps: the batches must not depend on them."""
    c = client(base_url, episode_id)
    messages = list(task["messages"])
    for _ in range(2):
        time.sleep(random.random() * 0.05)
        reply = c.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    time.sleep(random.random() * 0.05)
    post_reward(base_url, episode_id, 1.0).raise_for_status()


def test_batches_are_fixed_by_counts_not_timing(endpoint):
    runs = []
    for _ in range(2):
        ep, worker = endpoint(jittery_agent)
        samples, _ = ep.run_round(TASKS, n=N, seeds=seeds())
        runs.append((worker.batches, [(s.prompt_ids, s.response_ids, s.rollout_log_probs) for s in samples]))
    assert runs[0] == runs[1]
    assert runs[0][0] == [((0, 0), (1, 0), (2, 0), (3, 0)), ((0, 1), (1, 1), (2, 1), (3, 1))]


def test_bad_requests_get_typed_errors_and_the_round_goes_on(endpoint):
    seen = {}

    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        if episode_id.endswith("e0"):  # the misbehaving episode
            other = client(base_url, "no-such-episode")
            for name, fn in [
                ("unknown", lambda: other.chat.completions.create(model="m", messages=task["messages"])),
                ("temperature", lambda: c.chat.completions.create(model="m", messages=task["messages"], temperature=0.3)),
                ("max_tokens", lambda: c.chat.completions.create(model="m", messages=task["messages"], max_tokens=10_000)),
                ("n", lambda: c.chat.completions.create(model="m", messages=task["messages"], n=2)),
                ("huge", lambda: c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 70_000}])),
                ("no_id", lambda: openai.OpenAI(base_url=base_url, api_key="x", max_retries=0).chat.completions.create(
                    model="m", messages=task["messages"])),
            ]:
                try:
                    fn()
                except openai.APIStatusError as e:
                    seen[name] = (e.status_code, e.body.get("code") if isinstance(e.body, dict) else None)
            c.chat.completions.create(model="m", messages=task["messages"])  # a good call still works
            seen["bad_reward"] = httpx.post(f"{base_url}/episodes/{episode_id}/reward", content=b'{"reward": NaN}',
                                            headers={"content-type": "application/json"}).status_code
            seen["reward"] = post_reward(base_url, episode_id, 1.0).status_code
            seen["twice"] = post_reward(base_url, episode_id, 1.0).json()["error"]["code"]
            try:
                c.chat.completions.create(model="m", messages=task["messages"])
            except openai.APIStatusError as e:
                seen["after_close"] = (e.status_code, e.body.get("code"))
            return
        c.chat.completions.create(model="m", messages=task["messages"])
        post_reward(base_url, episode_id, 0.0).raise_for_status()

    ep, _ = endpoint(agent, max_request_bytes=65_536)
    samples, metrics = ep.run_round(TASKS, n=N, seeds=seeds())
    assert seen == {"unknown": (404, "unknown_episode"), "temperature": (400, "sampling_mismatch"),
                    "max_tokens": (413, "max_tokens_too_large"), "n": (400, "unsupported_field"),
                    "huge": (413, "request_too_large"), "no_id": (400, "missing_episode"),
                    "bad_reward": 400, "reward": 200, "twice": "reward_already_set",
                    "after_close": (409, "episode_closed")}
    assert len(samples) == 4 and sorted(s.reward for s in samples) == [0.0, 0.0, 0.0, 1.0]
    assert metrics["agent/refused_requests"] == 9.0
    # a call from an earlier round's episode: closed, not unknown
    with pytest.raises(openai.APIStatusError) as err:
        client(ep.base_url, "r1-e1").chat.completions.create(model="m", messages=TASKS[0]["messages"])
    assert err.value.status_code == 409


def test_call_limit_and_context_limit(endpoint):
    seen = []

    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        messages = list(task["messages"])
        for _ in range(5):
            try:
                reply = c.chat.completions.create(model="m", messages=messages).choices[0].message.content
            except openai.APIStatusError as e:
                seen.append((e.status_code, e.body["code"]))
                break
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more " * 20}]
        post_reward(base_url, episode_id, 1.0)

    ep, _ = endpoint(agent)
    samples, _ = ep.run_round(TASKS[:1], n=1, seeds=[0])
    assert seen == [(429, "call_limit")] and samples[0].extra["turns"] == 4
    small = Limits(max_new_tokens=16, max_episode_tokens=60, max_model_len=512, max_calls=4, temperature=1.0, top_p=1.0)
    seen.clear()
    ep, _ = endpoint(agent, limits=small)
    samples, _ = ep.run_round(TASKS[:1], n=1, seeds=[0])
    assert seen == [(413, "context_length_exceeded")] and len(samples[0].response_ids) <= 60


def test_a_stuck_agent_times_out_and_the_others_train(endpoint):
    release = threading.Event()

    def agent(base_url, episode_id, task):
        if episode_id.endswith("e0"):
            release.wait(30)  # never calls within the timeout
            return
        client(base_url, episode_id).chat.completions.create(model="m", messages=task["messages"])
        post_reward(base_url, episode_id, 1.0).raise_for_status()

    ep, _ = endpoint(agent, timeout_s=2.0)
    t0 = time.monotonic()
    samples, metrics = ep.run_round(TASKS[:1], n=2, seeds=[0])
    release.set()
    assert time.monotonic() - t0 < 20
    assert len(samples) == 1 and samples[0].reward == 1.0
    assert metrics["agent/finish_timeout"] == 0.5 and metrics["agent/finish_rewarded"] == 0.5


def test_completions_continue_by_text_and_user_field(endpoint, tiny_tokenizer):
    def agent(base_url, episode_id, task):
        c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        text = "Q: 1 + 2 =\nA:"
        r = c.completions.create(model="m", prompt=text, user=episode_id, logprobs=1)
        assert r.choices[0].logprobs.token_logprobs[0] == pytest.approx(-0.01 - int(episode_id[-1]))
        text += r.choices[0].text + "\nQ: and again?\nA:"
        c.completions.create(model="m", prompt=text, user=episode_id)
        post_reward(base_url, episode_id, 1.0).raise_for_status()

    ep, worker = endpoint(agent)
    samples, metrics = ep.run_round(TASKS[:1], n=1, seeds=[0])
    s = samples[0]
    assert metrics["agent/split_episodes"] == 0.0
    assert s.prompt_ids == tiny_tokenizer("Q: 1 + 2 =\nA:")["input_ids"]
    added = tiny_tokenizer("\nQ: and again?\nA:", add_special_tokens=False)["input_ids"]
    assert s.response_ids == worker.sampled[(0, 0)] + added + worker.sampled[(0, 1)]
    assert s.extra["model_mask"] == [1] * len(worker.sampled[(0, 0)]) + [0] * len(added) + [1] * len(worker.sampled[(0, 1)])


def test_an_agent_that_never_calls_names_itself():
    with pytest.raises(PluginError, match="rollout.agent"):
        load_agent("no/such/file.py:run")
    with pytest.raises(PluginError, match="has no function 'nope'"):
        load_agent("examples/calculator_agent.py:nope")
    assert callable(load_agent("examples/calculator_agent.py:run"))


def test_no_completion_in_a_round_is_an_error_naming_the_agent(endpoint):
    def agent(base_url, episode_id, task):
        raise ValueError("agent bug")

    ep, _ = endpoint(agent)
    with pytest.raises(RuntimeError, match="rollout.agent: none of the 2 episodes.*ValueError: agent bug"):
        ep.run_round(TASKS[:1], n=2, seeds=[0])


PROGRAM = """
import json, os, sys
import httpx, openai
task = json.load(sys.stdin)
if task["answer"] == "2":
    sys.exit("boom: this program fails on purpose")
c = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment only
reply = c.chat.completions.create(model="m", messages=task["messages"]).choices[0].message.content
history = task["messages"] + [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
c.chat.completions.create(model="m", messages=history)
httpx.post(os.environ["DSRL_REWARD_URL"], json={"reward": 0.25}).raise_for_status()
"""


def test_a_program_agent_needs_only_openai_base_url(endpoint, tmp_path, tiny_tokenizer):
    """`cmd: PROGRAM`: an unmodified OpenAI client program (no header, no episode id in its code)
    trains through the episode's own base URL; a program that exits non-zero is that episode's error."""
    script = tmp_path / "agent.py"
    script.write_text(PROGRAM)
    import sys

    ep, worker = endpoint(load_agent(f"cmd: {sys.executable} {script}"))
    samples, metrics = ep.run_round(TASKS, n=1, seeds=[0, CALL_SEED_STRIDE])
    assert len(samples) == 1 and samples[0].reward == 0.25 and samples[0].extra["turns"] == 2
    assert [t for t, m in zip(samples[0].response_ids, samples[0].extra["model_mask"]) if m] == \
        worker.sampled[(0, 0)] + worker.sampled[(0, 1)]
    assert metrics["agent/finish_rewarded"] == 0.5 and metrics["agent/finish_agent_error"] == 0.5
    with pytest.raises(PluginError, match="no program 'no-such-program-xyz' on PATH"):
        load_agent("cmd: no-such-program-xyz --flag")
