"""The endpoint's request protocols, one entry per route kind: how a request body becomes a call
in the episode book, and how the call's completion becomes the reply.

- chat:        POST /v1/chat/completions (dsrl.agent.endpoint.chat)
- completions: POST /v1/completions (a plain prompt string)
- responses:   POST /v1/responses (dsrl.agent.endpoint.responses)
- generate:    POST /inference/v1/generate, token in / token out (dsrl.agent.endpoint.generate)"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from dsrl.agent.endpoint.book import EndpointError
from dsrl.agent.endpoint.chat import ChatProtocol, chat_reply
from dsrl.agent.endpoint.generate import check_generate, generate_reply, stop_ids
from dsrl.agent.endpoint.responses import responses_reply, responses_request

ROUTES = ("chat", "completions", "responses", "generate")


class Protocols:
    """The request protocols of one endpoint (its book, tokenizer and model name)."""

    def __init__(self, endpoint, *, tool_parser: str = "hermes", tool_template: str = "auto",
                 stop_strings: bool = True):
        self.endpoint, self.book, self.tok = endpoint, endpoint.book, endpoint.tok
        self.chat = ChatProtocol(self.tok, self.book, tool_parser=tool_parser, tool_template=tool_template,
                                 stop_strings=stop_strings)
        self.eos = stop_ids(self.tok)
        self.vocab = len(self.tok)

    def prepare(self, route: str, episode_id: Optional[str], body: dict) -> Tuple[Callable[[], Any], Callable[[dict], Any]]:
        """The body checked (refusals raised here, before the book sees it): (the function that
        submits its call to the book, the function that makes the reply of its completion)."""
        model, book = self.endpoint.model_name, self.book
        if route == "chat":
            req = self.chat.request(body)
            return (lambda: book.submit_chat(episode_id, body, req),
                    lambda out: chat_reply(self.tok, model, out, req, episode_id))
        if route == "responses":
            req = responses_request(self.chat, body)
            return (lambda: book.submit_chat(episode_id, body, req),
                    lambda out: responses_reply(self.tok, model, out, req, body, episode_id))
        if route == "generate":
            ids, max_tokens, skip = check_generate(book, body, self.vocab, self.eos)
            return (lambda: book.submit_tokens(episode_id, ids, max_tokens),
                    lambda out: generate_reply(self.tok, model, out, skip, episode_id))
        if route == "completions":
            return (lambda: book.submit_completion(episode_id, body),
                    lambda out: self.endpoint.openai_reply(out, with_logprobs=bool(body.get("logprobs")),
                                                           episode_id=episode_id))
        raise EndpointError(404, "unknown_route", f"no route {route!r}")
