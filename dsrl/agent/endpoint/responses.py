"""The Responses API subset agent frameworks use (POST /v1/responses, streamed and not).

A request is translated to the chat form and goes the chat way (dsrl.agent.endpoint.chat): the
same template, tool parser, stop and token bookkeeping. `instructions` is the system message;
`input` is a string (one user message) or items: `message` (role + text or input_text /
output_text parts), `function_call` (call_id, name, arguments) and `function_call_output`
(call_id, output). An assistant message item and the function_call items after it are one
assistant turn, so an input that is the previous call's input + its output items + new items
continues the previous call's token sequence, like a chat history does.

Server-side state is not kept: `previous_response_id` and `conversation` are refused (send the
whole input each call; nothing is stored, whatever `store` says)."""
from __future__ import annotations

import time
from typing import Any, List, Optional

from dsrl.agent.endpoint.book import EndpointError, _text
from dsrl.agent.endpoint.chat import ChatRequest, canonical_messages

_REFUSED = {
    "previous_response_id": "server-side conversation state is not kept: send the whole conversation as `input`",
    "conversation": "server-side conversation state is not kept: send the whole conversation as `input`",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported",
    "top_logprobs": "only the sampled tokens' log-probs exist",
}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, list):
        out = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise EndpointError(400, "invalid_content", f"{where}.content[{k}]: type {kind!r}: only text parts "
                                    "are supported", param=f"{where}.content")
            out.append(part["text"])
        return "".join(out)
    return _text(content, where)


def input_messages(body: dict) -> list:
    """The request's instructions + input as chat messages (before canonical_messages)."""
    messages: List[dict] = []
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise EndpointError(400, "invalid_instructions", "instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise EndpointError(400, "invalid_input", "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise EndpointError(400, "invalid_input", f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            msg = {"role": role, "content": _parts_text(item.get("content"), where)}
            messages.append(msg)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise EndpointError(400, "invalid_input", f"{where}: a function_call needs name and call_id", param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "_open" in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call], "_open": True})
            continue
        elif kind == "function_call_output":
            out = item.get("output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                             "content": out if isinstance(out, str) else _parts_text(out, where)})
        else:
            raise EndpointError(400, "unsupported_item", f"{where}: item type {kind!r} is not supported (message, "
                                "function_call, function_call_output)", param=f"{where}.type")
        if messages[-1]["role"] == "assistant":
            messages[-1]["_open"] = True  # function_call items that follow belong to this turn
    for m in messages:
        m.pop("_open", None)
    return messages


def _tools(tools: Any) -> Any:
    """The Responses API's flat function tools ({type, name, description, parameters}) in the chat
    shape; anything else is left as it is for ChatProtocol's check (which refuses it by name)."""
    if not isinstance(tools, list):
        return tools
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            if isinstance(t, dict) and t.get("type") == "function" and "function" not in t else t for t in tools]


def chat_body(body: dict) -> dict:
    """The chat-shaped body ChatProtocol.request checks (sampling fields, tools, tool_choice)."""
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False, [], {}, 0, ""):
            raise EndpointError(400, "unsupported_field", f"{key}: {why}", param=key)
    fmt = ((body.get("text") or {}).get("format") or {}).get("type", "text") if isinstance(body.get("text"), dict) else "text"
    if fmt != "text":
        raise EndpointError(400, "unsupported_field", f"text.format={fmt!r}: structured output needs constrained "
                            "decoding, which changes the sampling distribution the trainer's log-probs assume",
                            param="text.format")
    out = {"tools": _tools(body.get("tools")), "stream": body.get("stream"),
           "parallel_tool_calls": body.get("parallel_tool_calls")}
    for src, dst in (("tool_choice", "tool_choice"), ("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p")):
        if body.get(src) is not None:
            out[dst] = body[src]
    return out


def responses_request(protocol, body: dict) -> ChatRequest:
    return protocol.request(chat_body(body), messages=canonical_messages(input_messages(body)))


# ---------------------------------------------------------------------------------------- replies
def output_items(message: dict, rid: str) -> List[dict]:
    """The assistant message as Responses output: a message item (when it has text or no call),
    then one function_call item per call."""
    items = []
    calls = message.get("tool_calls") or []
    if message["content"] or not calls:
        items.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}]})
    for c in calls:
        items.append({"type": "function_call", "id": f"fc_{c['id']}", "call_id": c["id"], "name": c["function"]["name"],
                      "arguments": c["function"]["arguments"], "status": "completed"})
    return items


def response_object(rid: str, model: str, body: dict, out: Optional[dict], output: List[dict], created: int) -> dict:
    done = out is not None
    status = "in_progress" if not done else ("incomplete" if out["finish_reason"] == "length" else "completed")
    use = None
    if done:
        use = {"input_tokens": out["prompt_tokens"], "output_tokens": out["completion_tokens"],
               "total_tokens": out["prompt_tokens"] + out["completion_tokens"],
               "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": use, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": None,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False}


def responses_reply(tokenizer, model: str, out: dict, request: ChatRequest, body: dict, episode_id: Optional[str]):
    """The reply to a Responses call: a response object, or its events when the request streams."""
    from dsrl.agent.endpoint.chat import openai_message
    from dsrl.agent.endpoint.sse import sse_response, token_pieces

    created = int(time.time())
    rid = f"resp_{episode_id}_{out['prompt_tokens']}"
    items = output_items(openai_message(out["message"]), rid)
    final = response_object(rid, model, body, out, items, created)
    if not request.stream:
        return final

    def events():
        seq = iter(range(1 << 30))

        def ev(kind: str, **fields) -> dict:
            return {"type": kind, "sequence_number": next(seq), **fields}

        yield ev("response.created", response=response_object(rid, model, body, None, [], created))
        yield ev("response.in_progress", response=response_object(rid, model, body, None, [], created))
        for k, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                yield ev("response.output_item.added", output_index=k,
                         item=dict(item, status="in_progress", content=[]))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield ev("response.content_part.added", item_id=item["id"], output_index=k, content_index=0, part=part)
                pieces = ([text] if out["message"].get("tool_calls") else
                          token_pieces(tokenizer, out["token_ids"], text, request.prefill))
                for piece in pieces:
                    yield ev("response.output_text.delta", item_id=item["id"], output_index=k, content_index=0,
                             delta=piece, logprobs=[])
                yield ev("response.output_text.done", item_id=item["id"], output_index=k, content_index=0, text=text,
                         logprobs=[])
                yield ev("response.content_part.done", item_id=item["id"], output_index=k, content_index=0,
                         part=dict(part, text=text))
            else:
                yield ev("response.output_item.added", output_index=k,
                         item=dict(item, arguments="", status="in_progress"))
                yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                         delta=item["arguments"])
                yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                         name=item["name"], arguments=item["arguments"])
            yield ev("response.output_item.done", output_index=k, item=item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield ev(kind, response=final)

    return sse_response(events(), done=False, named=True)
