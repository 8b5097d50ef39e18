"""The Responses API subset (POST /v1/responses, streamed and not) through the real `openai`
client, and token-in generation (POST /inference/v1/generate), on the scripted engine of
agent_testkit: each token-exact across calls (bit for bit against a hand-written rendering), the
Responses call trains what the same conversation through Chat Completions trains, a streamed
call records what the unstreamed one does, refusals are typed."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from endpoint_kit import (ADD, CALL_TEXT, SYSTEM, USER, client, ids, made, make_endpoint, model_part,  # noqa: F401
                          post_reward, trained)

EOT = "<|im_end|>"
FN = {"type": "function", **ADD["function"]}  # the Responses API's flat tool shape


def texts(e, t):
    return CALL_TEXT if t == 0 else "The sum is 3."


def responses_agent(stream: bool, seen: dict):
    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        items = [{"role": "user", "content": USER["content"]}]
        outs = []
        for _ in range(2):
            kw = dict(model="m", instructions=SYSTEM["content"], input=items, tools=[FN])
            if stream:
                kinds, final, deltas = [], None, ""
                for ev in c.responses.create(stream=True, **kw):
                    kinds.append(ev.type)
                    if ev.type == "response.output_text.delta":
                        deltas += ev.delta
                    if ev.type == "response.completed":
                        final = ev.response
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                assert deltas == final.output_text
                r = final
            else:
                r = c.responses.create(**kw)
            outs.append([o.model_dump(exclude_none=True) for o in r.output])
            items += [o.model_dump(exclude_none=True) for o in r.output]
            for o in r.output:
                if o.type == "function_call":
                    args = json.loads(o.arguments)
                    items.append({"type": "function_call_output", "call_id": o.call_id, "output": str(args["a"] + args["b"])})
        seen[episode_id] = (outs, r.usage.output_tokens)
        post_reward(base_url, episode_id, 1.0)

    return agent


def test_responses_tool_turns_are_token_exact_streamed_or_not(made, tiny_tokenizer):
    tok = tiny_tokenizer
    runs = []
    for stream in (False, True):
        seen = {}
        ep, worker = make_endpoint(tok, responses_agent(stream, seen), texts, made)
        samples, metrics = ep.run_round([{"q": 0}], n=1, seeds=[0])
        assert metrics["agent/split_episodes"] == 0.0 and metrics["agent/refused_requests"] == 0.0
        s = samples[0]
        s0, s1 = worker.sampled[(0, 0)], worker.sampled[(0, 1)]
        obs = ids(tok, "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>" + EOT + "\n<|im_start|>assistant\n")
        assert s.response_ids == s0 + obs + s1 and model_part(s) == s0 + s1
        outs, used = seen["r1-e0"]
        assert [o["type"] for o in outs[0]] == ["function_call"]
        assert (outs[0][0]["name"], json.loads(outs[0][0]["arguments"])) == ("add", {"a": 1, "b": 2})
        assert outs[1][0]["type"] == "message" and outs[1][0]["content"][0]["text"] == "The sum is 3."
        assert used == len(s1)
        runs.append(trained(s))
    assert runs[0] == runs[1]

    # the same conversation through Chat Completions trains the same tokens
    def chat_agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        messages = [SYSTEM, USER]
        r = c.chat.completions.create(model="m", messages=messages, tools=[ADD])
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "3"}]
        c.chat.completions.create(model="m", messages=messages, tools=[ADD])
        post_reward(base_url, episode_id, 1.0)

    ep, _ = make_endpoint(tok, chat_agent, texts, made)
    s = ep.run_round([{"q": 0}], n=1, seeds=[0])[0][0]
    assert trained(s) == runs[0]


def test_responses_refusals(made, tiny_tokenizer):
    seen = {}

    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        for name, kw in {"previous_response_id": dict(previous_response_id="resp_1"),
                         "tool_type": dict(tools=[{"type": "web_search"}]),
                         "item": dict(input=[{"type": "reasoning", "summary": []}]),
                         "format": dict(text={"format": {"type": "json_object"}})}.items():
            try:
                c.responses.create(**{"model": "m", "input": "hi", **kw})
            except openai.APIStatusError as e:
                seen[name] = (e.status_code, e.body["code"])
        r = c.responses.create(model="m", input="hi", max_output_tokens=2)
        seen["incomplete"] = (r.status, r.incomplete_details.reason, r.usage.output_tokens)
        post_reward(base_url, episode_id, 0.0)

    ep, _ = make_endpoint(tiny_tokenizer, agent, lambda e, t: "a long enough answer", made)
    ep.run_round([{"q": 0}], n=1, seeds=[0])
    assert seen == {"previous_response_id": (400, "unsupported_field"), "tool_type": (400, "unsupported_tool"),
                    "item": (400, "unsupported_item"), "format": (400, "unsupported_field"),
                    "incomplete": ("incomplete", "max_output_tokens", 2)}


def test_token_in_generation_continues_the_sequence(made, tiny_tokenizer):
    tok = tiny_tokenizer
    first = tok.apply_chat_template([USER], add_generation_prompt=True, tokenize=True)["input_ids"]
    more = ids(tok, "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    seen = {}

    def agent(base_url, episode_id, task):
        root = base_url[:-len("/v1")]
        url = f"{root}/episodes/{episode_id}/inference/v1/generate"  # the episode's own base URL
        params = {"max_tokens": 20, "logprobs": 1, "skip_special_tokens": False, "stop_token_ids": [tok.eos_token_id]}
        r1 = httpx.post(url, json={"model": "m", "token_ids": first, "sampling_params": params}).json()
        got = r1["choices"][0]["token_ids"]
        r2 = httpx.post(url, json={"model": "m", "token_ids": first + got + more, "sampling_params": params}).json()
        bad = httpx.post(url, json={"model": "m", "token_ids": first, "sampling_params": {"top_k": 5}})
        seen.update(r1=r1, r2=r2, bad=(bad.status_code, bad.json()["error"]["param"]))
        post_reward(base_url, episode_id, 1.0)

    ep, worker = make_endpoint(tok, agent, lambda e, t: f"answer {t}", made)
    samples, metrics = ep.run_round([{"q": 0}], n=1, seeds=[0])
    s0, s1 = worker.sampled[(0, 0)], worker.sampled[(0, 1)]
    c1 = seen["r1"]["choices"][0]
    assert c1["token_ids"] == s0 and c1["text"] == "answer 0" + EOT and c1["finish_reason"] == "stop"
    assert [x["token"] for x in c1["logprobs"]["content"]] == [f"token_id:{t}" for t in s0]
    assert [x["logprob"] for x in c1["logprobs"]["content"]] == pytest.approx([-(k + 1) / 100 for k in range(len(s0))])
    assert seen["r2"]["choices"][0]["token_ids"] == s1
    assert seen["bad"] == (400, "sampling_params.top_k")
    # the trained ids are exactly the ids the client sent and received
    s = samples[0]
    assert metrics["agent/split_episodes"] == 0.0
    assert s.prompt_ids == first and s.response_ids == s0 + more + s1
    assert s.extra["model_mask"] == [1] * len(s0) + [0] * len(more) + [1] * len(s1)
