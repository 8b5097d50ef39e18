"""Chat Completions as agent frameworks send them, through the real `openai` client over HTTP, on
the SmolLM2 tokenizer (its ChatML template has no tool format: dsrl's ChatML tool template renders
tools) and the scripted engine of agent_testkit: function tools and tool calls token-exact across
turns (bit for bit against a hand-written rendering), output that does not parse comes back as
content, streaming records the same episode as the same calls unstreamed, stop strings, per-call
max_tokens, tool_choice, typed refusals, /v1/models."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from dsrl.agent.endpoint.chat import TOOL_TEMPLATES
from endpoint_kit import (ADD, CALL_TEXT, SYSTEM, USER, client, ids, made, make_endpoint, model_part,  # noqa: F401
                          post_reward, trained)

EOT = "<|im_end|>"


def chatml_tools():
    with open(TOOL_TEMPLATES["chatml"]) as f:
        return f.read()


def tool_texts(e, t):
    return CALL_TEXT if t == 0 else "The sum is 3."


def streamed(c, **kw):
    """One streamed call, its chunks put together the way frameworks do; (message, finish,
    usage, content pieces)."""
    content, calls, finish, usage, pieces, roles = "", {}, None, None, [], []
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            d = choice.delta
            roles += [d.role] if d.role else []
            if d.content:
                content += d.content
                pieces.append(d.content)
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    message = {"role": "assistant", **({"content": content} if content else {})}  # as model_dump(exclude_none=True)
    if calls:
        message["tool_calls"] = [{"id": s["id"], "type": "function",
                                  "function": {"name": s["name"], "arguments": s["arguments"]}}
                                 for _, s in sorted(calls.items())]
    return message, finish, usage, pieces


def tool_agent(stream: bool, seen: dict):
    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        messages = [SYSTEM, USER]
        replies = []
        for _ in range(2):
            if stream:
                message, finish, usage, pieces = streamed(c, model="m", messages=messages, tools=[ADD])
                replies.append((message, finish, usage.completion_tokens, pieces))
            else:
                r = c.chat.completions.create(model="m", messages=messages, tools=[ADD])
                message = r.choices[0].message.model_dump(exclude_none=True)
                replies.append((message, r.choices[0].finish_reason, r.usage.completion_tokens, None))
            messages.append(message)
            for call in message.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
        seen[episode_id] = replies
        post_reward(base_url, episode_id, 1.0)

    return agent


def test_tool_turns_are_token_exact(made, tiny_tokenizer):
    tok = tiny_tokenizer
    seen = {}
    ep, worker = make_endpoint(tok, tool_agent(False, seen), tool_texts, made)
    samples, metrics = ep.run_round([{"q": 0}], n=2, seeds=[0])
    assert metrics["agent/split_episodes"] == 0.0 and metrics["agent/refused_requests"] == 0.0
    first, second = seen["r1-e0"]
    assert first[1] == "tool_calls" and first[0].get("content") is None
    assert first[0]["tool_calls"] == [{"id": "call_r1-e0_0_0", "type": "function",
                                       "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    assert second[0] == {"role": "assistant", "content": "The sum is 3."} and second[1] == "stop"
    for e, s in enumerate(samples):
        # the prompt: the system turn carries the tools (dsrl's ChatML tool template)
        assert s.prompt_ids == tok.apply_chat_template([SYSTEM, USER], tools=[ADD], chat_template=chatml_tools(),
                                                       add_generation_prompt=True, tokenize=True)["input_ids"]
        head = tok.decode(s.prompt_ids)
        assert head.startswith("<|im_start|>system\nUse the tool.\n\n# Tools\n") and '"name": "add"' in head
        # bit for bit: trained ids = sampled ids + the rendering of the new (tool) message alone, written by hand
        obs = ids(tok, "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>" + EOT + "\n<|im_start|>assistant\n")
        s0, s1 = worker.sampled[(e, 0)], worker.sampled[(e, 1)]
        assert s0 == ids(tok, CALL_TEXT) + [tok.eos_token_id]
        assert s.response_ids == s0 + obs + s1
        assert s.extra["model_mask"] == [1] * len(s0) + [0] * len(obs) + [1] * len(s1)
        assert [lp for lp, m in zip(s.rollout_log_probs, s.extra["model_mask"]) if not m] == [0.0] * len(obs)
        # ... and the whole sequence is what the template writes for the conversation as the agent saw it
        convo = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
            {"role": "tool", "tool_call_id": "x", "content": "3"}, {"role": "assistant", "content": "The sum is 3."}]
        want = tok.apply_chat_template(convo, tools=[ADD], chat_template=chatml_tools(), tokenize=False)
        assert tok.decode(s.prompt_ids + s.response_ids) + "\n" == want  # the template's newline after the last turn


def test_streamed_calls_record_the_same_episode(made, tiny_tokenizer):
    tok = tiny_tokenizer
    runs = []
    for stream in (False, True):
        seen = {}
        ep, worker = make_endpoint(tok, tool_agent(stream, seen), tool_texts, made)
        samples, _ = ep.run_round([{"q": 0}], n=2, seeds=[0])
        runs.append(([trained(s) for s in samples],
                     {k: [(m, f, n) for m, f, n, _ in v] for k, v in seen.items()}))
        if stream:
            first, second = seen["r1-e0"]
            assert second[3] == [p for p in second[3] if p] and len(second[3]) >= 3  # one piece per sampled token
            assert "".join(second[3]) == tok.decode(worker.sampled[(0, 1)], skip_special_tokens=True)
            assert second[2] == len(worker.sampled[(0, 1)])  # the usage chunk
    assert runs[0][0] == runs[1][0]  # the same trained sequences, bit for bit
    assert runs[0][1] == runs[1][1]  # the same replies (tool call ids, arguments, finish reasons, usage)


def test_output_that_does_not_parse_is_content(made, tiny_tokenizer):
    bad = ['<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # not JSON
           '<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>',  # not one of the tools
           '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2} and more']  # never closed, not JSON
    seen = []

    def agent(base_url, episode_id, task):
        r = client(base_url, episode_id).chat.completions.create(model="m", messages=[USER], tools=[ADD])
        seen.append((int(episode_id[-1]), r.choices[0].message.content, r.choices[0].message.tool_calls,
                     r.choices[0].finish_reason))
        post_reward(base_url, episode_id, 0.0)

    ep, _ = make_endpoint(tiny_tokenizer, agent, lambda e, t: bad[e], made)
    samples, _ = ep.run_round([{"q": 0}], n=3, seeds=[0])
    assert sorted(seen) == [(e, bad[e], None, "stop") for e in range(3)] and len(samples) == 3


def test_stop_strings_cut_the_text_and_train_every_sampled_token(made, tiny_tokenizer):
    tok = tiny_tokenizer
    seen = []

    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        messages = [USER]
        r = c.chat.completions.create(model="m", messages=messages, stop=["STOP"])
        seen.append((r.choices[0].message.content, r.choices[0].finish_reason))
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
        c.chat.completions.create(model="m", messages=messages)
        post_reward(base_url, episode_id, 1.0)

    ep, worker = make_endpoint(tok, agent, lambda e, t: "abc STOP def" if t == 0 else "ok", made)
    samples, metrics = ep.run_round([{"q": 0}], n=1, seeds=[0])
    assert seen == [("abc ", "stop")] and worker.kwargs[0]["stop"] == [["STOP"]]
    s0, s1 = worker.sampled[(0, 0)], worker.sampled[(0, 1)]
    assert tok.decode(s0).endswith("STOP") and "def" not in tok.decode(s0)  # sampled through the stop string
    # no end-of-turn was sampled: the template's whole closing follows, as the agent's tokens
    obs = ids(tok, EOT + "\n<|im_start|>user\nmore" + EOT + "\n<|im_start|>assistant\n")
    s = samples[0]
    assert metrics["agent/split_episodes"] == 0.0
    assert s.response_ids == s0 + obs + s1 and model_part(s) == s0 + s1


def test_each_call_generates_up_to_its_own_limit(made, tiny_tokenizer):
    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        e = int(episode_id[-1])
        kw = {"max_tokens": 3} if e == 0 else {"max_completion_tokens": 5} if e == 1 else {}
        r = c.chat.completions.create(model="m", messages=[USER], **kw)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == [3, 5, 96][e]
        post_reward(base_url, episode_id, 0.0)

    ep, worker = make_endpoint(tiny_tokenizer, agent, lambda e, t: "word " * 120, made)
    samples, _ = ep.run_round([{"q": 0}], n=3, seeds=[0])
    assert worker.kwargs[0]["max_tokens"] == [3, 5, 96] and worker.kwargs[0]["stop"] is None
    assert [len(model_part(s)) for s in samples] == [3, 5, 96]


def test_tool_choice_required_named_none_and_parallel(made, tiny_tokenizer):
    tok = tiny_tokenizer
    texts = {0: '"a": 1, "b": 2}}\n</tool_call>',  # named: the model continues the arguments object
             1: 'add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',  # required: after {"name": "
             2: CALL_TEXT,  # none: content
             3: CALL_TEXT + "\n" + CALL_TEXT}  # parallel_tool_calls=false: the first call only
    choice = {0: {"type": "function", "function": {"name": "add"}}, 1: "required", 2: "none", 3: "auto"}
    seen = {}

    def agent(base_url, episode_id, task):
        e = int(episode_id[-1])
        r = client(base_url, episode_id).chat.completions.create(
            model="m", messages=[USER], tools=[ADD], tool_choice=choice[e],
            **({"parallel_tool_calls": False} if e == 3 else {}))
        m = r.choices[0].message
        seen[e] = (m.content, [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []],
                   r.choices[0].finish_reason)
        post_reward(base_url, episode_id, 0.0)

    ep, worker = make_endpoint(tok, agent, lambda e, t: texts[e], made)
    samples, _ = ep.run_round([{"q": 0}], n=4, seeds=[0])
    call = ("add", {"a": 1, "b": 2})
    assert seen == {0: (None, [call], "tool_calls"), 1: (None, [call], "tool_calls"),
                    2: (CALL_TEXT, [], "stop"), 3: (None, [call], "tool_calls")}
    for e, prefix in ((0, '<tool_call>\n{"name": "add", "arguments": {'), (1, '<tool_call>\n{"name": "')):
        forced = ids(tok, prefix)  # written after the generation prompt as the agent's tokens
        s = samples[e]
        assert s.response_ids == forced + worker.sampled[(e, 0)]
        assert s.extra["model_mask"] == [0] * len(forced) + [1] * len(worker.sampled[(e, 0)])


def test_refusals_are_typed_and_models_reports_the_context(made, tiny_tokenizer):
    seen = {}

    def agent(base_url, episode_id, task):
        c = client(base_url, episode_id)
        cases = {
            "n": dict(n=2), "logit_bias": dict(logit_bias={"1": 5}), "temperature": dict(temperature=0.5),
            "response_format": dict(response_format={"type": "json_object"}),
            "tool_type": dict(tools=[{"type": "web_search"}]),
            "tool_choice": dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_message": dict(messages=[USER, {"role": "tool", "tool_call_id": "x"}]),
        }
        for name, kw in cases.items():
            try:
                c.chat.completions.create(**{"model": "m", "messages": [USER], **kw})
            except openai.APIStatusError as e:
                seen[name] = (e.status_code, e.body["code"], e.body["param"])
        c.chat.completions.create(model="m", messages=[USER])  # a good call still works
        post_reward(base_url, episode_id, 0.0)

    ep, _ = make_endpoint(tiny_tokenizer, agent, lambda e, t: "fine", made)
    ep.run_round([{"q": 0}], n=1, seeds=[0])
    assert seen == {"n": (400, "unsupported_field", "n"), "logit_bias": (400, "unsupported_field", "logit_bias"),
                    "temperature": (400, "sampling_mismatch", "temperature"),
                    "response_format": (400, "unsupported_field", "response_format"),
                    "tool_type": (400, "unsupported_tool", "tools[0]"),
                    "tool_choice": (400, "invalid_tool_choice", "tool_choice"),
                    "tool_message": (400, "invalid_messages", "messages[1].content")}
    root = ep.base_url[:-len("/v1")]
    for url in (f"{root}/v1/models", f"{root}/episodes/r1-e0/v1/models"):  # also under an episode's base URL
        assert httpx.get(url).json()["data"][0]["max_model_len"] == 1024


def test_tool_keys_are_checked_before_anything_loads(tmp_path, tiny_tokenizer):
    """rollout.tool_parser / rollout.tool_template: named in the error (config validation, no
    tokenizer needed); `model` with a template that does not take tools is refused when the
    tokenizer is there."""
    from dsrl.agent.config_checks import _tool_errors
    from dsrl.agent.endpoint.chat import tool_template_source

    assert _tool_errors("hermes", "auto") == [] and _tool_errors("hermes", "chatml") == []
    assert _tool_errors("nope", "x.jinja") == [
        "rollout.tool_parser='nope': not one of ['hermes']",
        f"rollout.tool_template='x.jinja': no file {(Path.cwd() / 'x.jinja')}"]
    assert _tool_errors("hermes", "fancy") == ["rollout.tool_template='fancy': not auto, model, chatml or a .jinja file"]
    with pytest.raises(ValueError, match="rollout.tool_template=model: the model's chat template does not take `tools`"):
        tool_template_source(tiny_tokenizer, "model")
    own = tmp_path / "mine.jinja"
    own.write_text("{{ messages[0]['content'] }}")
    assert tool_template_source(tiny_tokenizer, str(own)) == "{{ messages[0]['content'] }}"
    assert tool_template_source(tiny_tokenizer, "auto") == chatml_tools()  # SmolLM2's template has no tools


@pytest.mark.parametrize("template, takes", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    # the word alone is not a template that renders tools: a comment, a string, an attribute
    ("{# tools are not supported #}{{ messages[0]['content'] }}", False),
    ("{{ 'no tools here' }}{{ messages[0].tools }}", False),
    ("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{{ messages[0]['content'] }}", True),
    ("{%- set tool_list = tools or [] -%}{{ tool_list | length }}", True),
    # a tag of transformers' own (no jinja extension here): the `{% %}` / `{{ }}` blocks are searched
    ("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}{{ tools }}", True),
    ("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}{# tools #}", False),
    # a tokenizer's named templates: transformers renders a request with tools by `tool_use`
    ({"default": "{{ messages[0]['content'] }}", "tool_use": "{{ tools | tojson }}"}, True),
    ({"default": "{{ messages[0]['content'] }}"}, False),
    (None, False),
])
def test_auto_finds_a_template_that_takes_tools_by_its_parsed_source(template, takes):
    from dsrl.agent.endpoint.chat import takes_tools

    assert takes_tools(template) is takes
