"""Chat Completions as agent frameworks send them: function tools, tool_choice,
parallel_tool_calls, stop strings, per-call max_tokens / max_completion_tokens, stream.

A request becomes a `ChatRequest` (ChatProtocol.request), which the episode book submits
(EpisodeBook.submit_chat) and whose `reply` turns the sampled text into the assistant message as
returned. Messages are kept in one canonical form (`canonical_messages`): that form is what the book
compares to decide that a call continues the previous one, so an agent that sends back the
assistant message as it got it (content null or text, `tool_calls` with the same ids, names and
arguments; its arguments re-serialized with other whitespace are the same) continues the sequence.

Rendering. A request with tools (or with tool calls / tool results in its messages) is rendered by
the model's own chat template when that template takes `tools`, otherwise by dsrl's ChatML tool
template (dsrl/agent/templates/chatml_tools.jinja); `rollout.tool_template` picks (`auto`, `model`,
`chatml`, or a .jinja file). A request without any tool is rendered by the model's own template as
before.

tool_choice. `auto`: the output is parsed (rollout.tool_parser); what does not parse is content.
`none`: the tools are still shown to the model (as OpenAI does), the output is returned as content.
`required` / a named function: the parser's call opening (e.g. `<tool_call>\\n{"name": "` or, for a
named function, up to the `{` of its arguments) is written after the generation prompt as the agent's
tokens (masked out of the loss) and the model continues it; the returned text includes it.
`parallel_tool_calls: false`: only the first parsed call is returned.

Stop strings. The engine stops at the first stop string; the returned text ends before it (as
OpenAI's), the trained tokens are every sampled token, the stop string's included. The next
call's rendering follows those tokens, so the trained sequence is what the model sampled, not the
returned text.

Refused, typed: n > 1, logit_bias, response_format, top_logprobs, a temperature/top_p other than
the run's (EpisodeBook._check_sampling), tools other than functions, stop strings on a backend
without them (rollout.backend=hf)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, List, Optional, Sequence, Tuple

from dsrl.agent.endpoint.book import EndpointError, _text
from dsrl.agent.tool_parsers import ToolParser, get_tool_parser

TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates")
TOOL_TEMPLATES = {"chatml": os.path.join(TEMPLATES_DIR, "chatml_tools.jinja")}

# Fields a chat request may carry that change nothing about sampling (accepted, ignored).
_IGNORED = ("model", "user", "metadata", "store", "seed", "service_tier", "prompt_cache_key", "safety_identifier",
            "reasoning_effort", "modalities", "frequency_penalty", "presence_penalty")
_REFUSED = {
    "logit_bias": "it changes the sampling distribution the trainer's log-probs assume",
    "response_format": "structured output needs constrained decoding, which changes the sampling distribution "
                       "the trainer's log-probs assume (ask for JSON in the prompt and parse it)",
    "functions": "the legacy `functions` field is not supported: send `tools`",
    "function_call": "the legacy `function_call` field is not supported: send `tool_choice`",
    "audio": "only text is generated",
    "prediction": "predicted outputs are not supported",
}
MAX_STOP_STRINGS = 4


def _nonzero(v: Any) -> bool:
    return v not in (None, False, [], {}, 0, 0.0, "")


def takes_tools(chat_template: Any) -> bool:
    """Whether a chat template renders `tools`: the template reads a variable named `tools` (its
    parsed source, so a comment or a string that mentions tools does not count). A tokenizer's
    template may be a dict of named templates: its `tool_use` one (what transformers picks for a
    request with tools), else its `default`. A template jinja cannot parse (an extension tag of its
    own) is searched for a `tools` name in its `{{ }}` / `{% %}` blocks."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default") or ""
    if not chat_template:
        return False
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template))
    except jinja2.TemplateSyntaxError:
        blocks = re.findall(r"\{[{%](.*?)[%}]\}", chat_template, flags=re.S)
        return any(re.search(r"\btools\b", block) for block in blocks)


def tool_template_source(tokenizer: Any, choice: str) -> Optional[str]:
    """The template that renders tool requests: None for the model's own (it takes `tools`), or
    a template's text. `choice`: auto | model | chatml | path/to/template.jinja."""
    own = takes_tools(getattr(tokenizer, "chat_template", None))
    if choice == "auto":
        return None if own else _read(TOOL_TEMPLATES["chatml"], choice)
    if choice == "model":
        if not own:
            raise ValueError("rollout.tool_template=model: the model's chat template does not take `tools`; use "
                             "auto or chatml (dsrl's ChatML tool template) or a .jinja file")
        return None
    if choice in TOOL_TEMPLATES:
        return _read(TOOL_TEMPLATES[choice], choice)
    if choice.endswith(".jinja"):
        return _read(choice, choice)
    raise ValueError(f"rollout.tool_template={choice!r}: not auto, model, {', '.join(TOOL_TEMPLATES)} or a .jinja file")


def _read(path: str, choice: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"rollout.tool_template={choice!r}: no file {os.path.abspath(path)}")
    with open(path) as f:
        return f.read()


# ---------------------------------------------------------------------------------------- messages
def _arguments(raw: Any, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            obj = json.loads(raw or "{}")
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return obj
    raise EndpointError(400, "invalid_messages", f"{where}.function.arguments must be a JSON object (as a string)",
                        param=f"{where}.function.arguments")


def canonical_messages(messages: Any) -> list:
    """Messages in the endpoint's one form: {role, content: str}; an assistant's `tool_calls` as
    [{id, type: function, function: {name, arguments: dict}}]; a tool result's `tool_call_id`.
    `developer` is a system message. Anything else is refused naming the message."""
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "invalid_messages", "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise EndpointError(400, "invalid_messages", f"{where} needs a string 'role'", param=where)
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise EndpointError(400, "invalid_messages", f"{where}: role {m['role']!r} is not one of system, "
                                "developer, user, assistant, tool", param=f"{where}.role")
        calls = m.get("tool_calls") if role == "assistant" else None
        if m.get("function_call"):
            raise EndpointError(400, "unsupported_field", f"{where}.function_call: the legacy form is not supported "
                                "(send tool_calls)", param=f"{where}.function_call")
        content = m.get("content")
        if content is None and not (calls or role == "assistant"):
            raise EndpointError(400, "invalid_messages", f"{where} needs a 'content'", param=f"{where}.content")
        msg = {"role": role, "content": "" if content is None else _text(content, where)}
        if calls:
            if not isinstance(calls, list):
                raise EndpointError(400, "invalid_messages", f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            msg["tool_calls"] = []
            for k, c in enumerate(calls):
                cw = f"{where}.tool_calls[{k}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise EndpointError(400, "invalid_messages", f"{cw} needs function.name", param=cw)
                msg["tool_calls"].append({"id": str(c.get("id") or ""), "type": "function",
                                          "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), cw)}})
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        out.append(msg)
    return out


def has_tool_messages(messages: Sequence[dict]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def openai_message(message: dict) -> dict:
    """A canonical assistant message as Chat Completions returns it (arguments as JSON strings,
    content null when there are tool calls and no text)."""
    calls = message.get("tool_calls")
    if not calls:
        return {"role": "assistant", "content": message["content"]}
    return {"role": "assistant", "content": message["content"] or None,
            "tool_calls": [{"id": c["id"], "type": "function",
                            "function": {"name": c["function"]["name"],
                                         "arguments": json.dumps(c["function"]["arguments"])}} for c in calls]}


# ---------------------------------------------------------------------------------------- tools
def check_tools(tools: Any) -> List[dict]:
    """Function tools as [{type: function, function: {name, description?, parameters?}}]."""
    if tools in (None, []):
        return []
    if not isinstance(tools, list):
        raise EndpointError(400, "invalid_tools", "tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise EndpointError(400, "unsupported_tool", f"{where}: type {kind!r}: only function tools are supported",
                                param=where)
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise EndpointError(400, "invalid_tools", f"{where} needs function.name", param=f"{where}.function.name")
        spec = {"name": fn["name"]}
        if fn.get("description"):
            spec["description"] = str(fn["description"])
        spec["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": spec})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise EndpointError(400, "invalid_tools", f"tools: a function name is given twice ({names})", param="tools")
    return out


def check_tool_choice(choice: Any, names: Sequence[str]) -> Tuple[str, Optional[str]]:
    """(mode, forced function name): mode auto | none | required | function."""
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise EndpointError(400, "invalid_tool_choice", f"tool_choice={choice!r}: not auto, none, required or "
                                "a named function", param="tool_choice")
        if choice == "required" and not names:
            raise EndpointError(400, "invalid_tool_choice", "tool_choice=required without tools", param="tool_choice")
        return (choice if names else "none"), None
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")  # Chat Completions / Responses shape
    if not isinstance(name, str) or name not in names:
        raise EndpointError(400, "invalid_tool_choice", f"tool_choice={choice!r}: names no function of `tools` "
                            f"({list(names)})", param="tool_choice")
    return "function", name


def check_stop(stop: Any, supported: bool) -> List[str]:
    if stop in (None, "", []):
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise EndpointError(400, "invalid_stop", f"stop must be a non-empty string or a list of at most "
                            f"{MAX_STOP_STRINGS}", param="stop")
    if not supported:
        raise EndpointError(400, "unsupported_field", "stop strings need a vLLM rollout backend (rollout.backend=hf "
                            "has none)", param="stop")
    return list(stops)


def cut_at_stop(text: str, stops: Sequence[str]) -> Tuple[str, bool]:
    """The text before the first stop string (what the client sees), and whether one was found."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


# ---------------------------------------------------------------------------------------- requests
@dataclasses.dataclass
class ChatRequest:
    """One chat call as the book submits it."""
    messages: list  # canonical (continuation compares these)
    template_kwargs: dict  # to apply_chat_template: tools, chat_template (a sequence continues only under the same)
    prefill: str  # the forced opening of a tool call (tool_choice required / named); "" otherwise
    prefill_ids: list
    max_tokens: int
    stop: List[str]
    parser: Optional[ToolParser]  # None: the output is content (no tools, or tool_choice none)
    names: List[str]
    parallel: bool
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False

    def reply(self, text: str, finish: str, call_tag: str) -> Tuple[dict, str, str]:
        """(the canonical assistant message as returned, its text, finish_reason) of a completion
        whose decoded text (after the prefill) is `text`."""
        full = self.prefill + text
        if self.stop:
            full, stopped = cut_at_stop(full, self.stop)
            if stopped:
                finish = "stop"
        if self.parser is not None:
            parsed = self.parser.parse(full, self.names)
            calls = parsed.calls if self.parallel else parsed.calls[:1]
            if calls:
                message = {"role": "assistant", "content": parsed.content or "",
                           "tool_calls": [{"id": f"call_{call_tag}_{k}", "type": "function",
                                           "function": {"name": c.name, "arguments": c.arguments}}
                                          for k, c in enumerate(calls)]}
                return message, full, "tool_calls"
        return {"role": "assistant", "content": full}, full, finish


class ChatProtocol:
    """Builds ChatRequests for one endpoint: the tokenizer, the tool parser and template."""

    def __init__(self, tokenizer: Any, book, *, tool_parser: str = "hermes", tool_template: str = "auto",
                 stop_strings: bool = True):
        self.tok, self.book = tokenizer, book
        self.parser = get_tool_parser(tool_parser)
        self.template = tool_template_source(tokenizer, tool_template)
        self.stop_strings = bool(stop_strings)

    def request(self, body: dict, *, messages: Optional[list] = None) -> ChatRequest:
        """Check a Chat Completions body (or one the Responses API made) and build its request."""
        for key, why in _REFUSED.items():
            if _nonzero(body.get(key)):
                raise EndpointError(400, "unsupported_field", f"{key}: {why}", param=key)
        messages = canonical_messages(body.get("messages")) if messages is None else messages
        if messages[-1]["role"] == "assistant":
            raise EndpointError(400, "invalid_messages", "the last message is the assistant's: nothing to answer "
                                "(continuing an assistant message is not supported)", param=f"messages[{len(messages) - 1}]")
        tools = check_tools(body.get("tools"))
        names = [t["function"]["name"] for t in tools]
        mode, forced = check_tool_choice(body.get("tool_choice"), names)
        stop = check_stop(body.get("stop"), self.stop_strings)
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise EndpointError(400, "invalid_stream_options", "stream_options must be an object", param="stream_options")
        plain = {k: v for k, v in body.items() if k not in ("stream", "tools", "stop", "stream_options", "tool_choice",
                                                            "parallel_tool_calls", "messages", *_IGNORED)}
        max_tokens = self.book._check_sampling(plain)  # n, temperature, top_p, max_tokens, top_logprobs
        kwargs = {}
        if tools or has_tool_messages(messages):
            kwargs["tools"] = [t["function"] for t in tools] if self.template is not None else tools
            if self.template is not None:
                kwargs["chat_template"] = self.template
        prefill = ""
        if mode in ("required", "function"):
            prefill = self.parser.prefix(forced)
        prefill_ids = list(self.tok(prefill, add_special_tokens=False)["input_ids"]) if prefill else []
        return ChatRequest(messages=messages, template_kwargs=kwargs, prefill=prefill, prefill_ids=prefill_ids,
                           max_tokens=max_tokens, stop=stop, parser=None if mode == "none" else self.parser,
                           names=names, parallel=body.get("parallel_tool_calls") is not False,
                           stream=bool(body.get("stream")), include_usage=bool(opts.get("include_usage")),
                           logprobs=bool(body.get("logprobs")))


# ---------------------------------------------------------------------------------------- replies
def chat_reply(tokenizer, model: str, out: dict, request: ChatRequest, episode_id: Optional[str]):
    """The reply to a chat call: a chat.completion, or its chunks as server-sent events when the
    request streams (`out` is what EpisodeBook.record returned)."""
    import time

    from dsrl.agent.endpoint.sse import sampled_logprobs, sse_response, token_pieces, usage

    created = int(time.time())
    rid = f"chatcmpl-{episode_id}-{out['prompt_tokens']}"
    message = openai_message(out["message"])
    lps = sampled_logprobs(tokenizer, out["token_ids"], out["logprobs"]) if request.logprobs else None
    use = usage(out["prompt_tokens"], out["completion_tokens"])
    if not request.stream:
        choice = {"index": 0, "message": message, "finish_reason": out["finish_reason"], "logprobs": lps}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                "usage": use}

    def chunk(delta: dict, finish=None, logprobs=None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def events():
        yield chunk({"role": "assistant", "content": ""})
        calls = message.get("tool_calls") or []
        if calls:
            if message["content"]:
                yield chunk({"content": message["content"]})
            for k, c in enumerate(calls):
                yield chunk({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                             "function": {"name": c["function"]["name"], "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": k, "function": {"arguments": c["function"]["arguments"]}}]})
        else:
            for piece in token_pieces(tokenizer, out["token_ids"], out["text"], request.prefill):
                yield chunk({"content": piece})
        yield chunk({}, out["finish_reason"], lps)
        if request.include_usage:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                   "usage": use}

    return sse_response(events())
