"""Shared pieces of the endpoint protocol tests (tools, streaming, Responses, token-in): an
endpoint factory over the scripted worker of agent_testkit (the completion of episode e's call t
is texts(e, t), read from the request seed e * 256 + t), the tool the agents call, and the
trained-sequence reference built by hand."""
from __future__ import annotations

import httpx
import openai
import pytest

from dsrl.agent.endpoint.book import CALL_SEED_STRIDE, Limits
from dsrl.agent.endpoint.server import AgentEndpoint
from agent_testkit import ScriptedWorker

LIMITS = Limits(max_new_tokens=96, max_episode_tokens=400, max_model_len=1024, max_calls=4, temperature=1.0, top_p=1.0)
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                         "b": {"type": "integer"}},
                                                       "required": ["a", "b"]}}}
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
SYSTEM = {"role": "system", "content": "Use the tool."}
USER = {"role": "user", "content": "What is 1 + 2?"}


class RecordingWorker(ScriptedWorker):
    """ScriptedWorker that also keeps every prompt and per-call max_tokens / stop it was given."""

    def __init__(self, tok, texts):
        super().__init__(tok, texts, stride=CALL_SEED_STRIDE)
        self.prompts, self.kwargs = [], []

    def generate(self, prompt_ids, **kw):
        self.prompts += [list(p) for p in prompt_ids]
        self.kwargs.append({k: kw.get(k) for k in ("max_tokens", "stop")})
        return super().generate(prompt_ids, **kw)


def make_endpoint(tok, agent, texts, made: list, **kw):
    worker = RecordingWorker(tok, texts)
    ep = AgentEndpoint(worker, tok, limits=kw.pop("limits", LIMITS), agent=agent, **kw).start()
    made.append(ep)
    return ep, worker


def client(base_url, eid):
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60,
                         default_headers={"X-Episode-Id": eid})


def post_reward(base_url, eid, reward):
    httpx.post(f"{base_url}/episodes/{eid}/reward", json={"reward": reward}, timeout=60).raise_for_status()


def ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def model_part(sample):
    return [t for t, m in zip(sample.response_ids, sample.extra["model_mask"]) if m]


def trained(sample):
    """What trains of a sample, for bit-for-bit comparisons."""
    return sample.prompt_ids, sample.response_ids, sample.extra["model_mask"], sample.rollout_log_probs


@pytest.fixture()
def made():
    """The endpoints a test started (make_endpoint's `made`), closed after it."""
    eps = []
    yield eps
    for ep in eps:
        ep.close()
