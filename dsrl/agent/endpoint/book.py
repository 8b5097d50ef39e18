"""The episodes of one rollout round served through the OpenAI-compatible endpoint: what every call
sampled (token in, token out), how calls join into training sequences, and when the engine runs.

Token exactness. The server applies the chat template (once, server side) and keeps the token ids
it sampled. A call whose messages are the previous call's messages, then that call's reply as the
server returned it, then new messages (tool results, user turns) continues the previous call's
sequence: its prompt is the previous prompt + the sampled reply + the template's rendering of only
the new messages (dsrl.agent.turns.TurnRenderer), so nothing sampled is re-tokenized. Any other
call (the agent rewrote, trimmed or reordered its history; or its previous call is still in
flight) starts a new sequence of the episode ("split": the episode trains as several sequences,
each with the episode's reward; counted in agent/split_episodes). /v1/completions continues a
sequence when its prompt text is the previous prompt text + the returned text + more;
/inference/v1/generate when its token ids are the previous ids + the sampled ids + more. Chat
requests arrive checked and rendered (dsrl.agent.endpoint.chat.ChatRequest: tools, tool choice,
stop strings); the reply a chat sequence keeps is the assistant message as returned (tool calls
parsed), which is what the next call must repeat to continue it.

Scheduling by counts, never by clocks. The round's thread runs the engine only when every live
episode (agent still running, no reward yet, not timed out) has at least one call waiting; it then
generates all waiting calls in ONE batched `worker.generate`, ordered by (episode, call number),
with the seed `episode seed + call number`. Which calls share a batch therefore depends only on
what the agents do, not on timing, and a run is reproducible when its agents are. The round ends
when every agent has returned. A clock enters only through `agent_timeout_s`: an agent that makes
no call for that long after its last reply (or the round's start) is ended, and through the
barrier's warning (`barrier_warn_s`), which names the episodes that have not called yet while calls
of the others wait for them.

Retries and disconnected clients. A call whose request body is identical to a call of the same
episode still in flight (waiting or in the engine) joins it: it gets the same reply and nothing new
is trained (a client that timed out and retried saw one completion, so one is trained). A call
whose every client disconnected before its reply is an orphan: it is not trained. An orphan still
waiting is dropped when a different call of its episode arrives (or revived by an identical one);
one in the engine is dropped when its completion comes back, its sequence left as it was before.

Secrets. Every episode has a secret; its token `{id}.{secret}` names the episode and proves the
caller is its agent (in the episode's base URL path or as the API key, `Authorization: Bearer`).
With `require_secret` (the endpoint listens off loopback) every call and reward needs it; on
loopback a bare episode id is enough. A token of another episode, or a wrong secret, is refused."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hmac
import json
import logging
import math
import secrets as secrets_mod
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from dsrl.agent.episodes import Trajectory
from dsrl.agent.turns import TurnRenderer, prompt_ids as chat_prompt_ids

log = logging.getLogger("dsrl")

CALL_SEED_STRIDE = 256  # seeds per episode: calls per episode <= 256 (rollout.max_turns)
FAILED_EPISODES = ("zero", "drop")  # rollout.failed_episodes: what trains of an agent that crashed or timed out


class EndpointError(Exception):
    """A request the endpoint refuses: the HTTP status, an OpenAI-style error code, the message
    (naming the field or limit) and the request field at fault."""

    def __init__(self, status: int, code: str, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.code, self.param = int(status), code, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    max_new_tokens: int  # rollout.max_new_tokens: tokens per call at most
    max_episode_tokens: int  # rollout.max_episode_tokens: response tokens per sequence at most
    max_model_len: int  # rollout.max_model_len: prompt + completion of a call at most
    max_calls: int  # rollout.max_turns: calls per episode at most
    temperature: float  # rollout.temperature: what the trainer's log-probs assume
    top_p: float  # rollout.top_p


@dataclasses.dataclass
class Sequence_:
    """One training sequence of an episode (a Trajectory in the making)."""
    traj: Trajectory
    renderer: Optional[TurnRenderer]  # chat sequences: renders what the agent adds between calls
    last_messages: Optional[list] = None  # chat: the last call's messages + its reply
    last_text: Optional[str] = None  # completions: the last call's prompt text + its returned text
    in_flight: bool = False  # a call of this sequence is waiting for the engine
    tokens: bool = False  # token-in (/inference/v1/generate): continued by a call whose ids extend its context

    def context(self) -> list:
        return self.traj.prompt_ids + self.traj.response_ids


@dataclasses.dataclass
class Call:
    episode: "Episode"
    number: int  # the episode's call count before it (its seed offset)
    seq: Sequence_
    added_ids: list  # the agent's tokens this call appends to the sequence (0 in the loss mask)
    prompt_ids: list  # what the engine continues: the sequence so far + added_ids
    max_tokens: int
    future: concurrent.futures.Future
    request: Any = None  # chat: its ChatRequest (dsrl.agent.endpoint.chat: stop strings, tool calls, the reply)
    key: str = ""  # the request (route + body) it answers: an identical request joins it
    clients: int = 1  # requests waiting for its reply; 0 = an orphan, not trained
    new_seq: bool = False  # it opened its sequence (an orphan's sequence is removed)
    undo: tuple = ()  # the sequence's (last_messages, last_text) before it (an orphan's restore)


class Episode:
    def __init__(self, episode_id: str, index: int, group: int, seed: int, task: dict, timeout_s: float,
                 now: float, secret: Optional[str] = None):
        self.id, self.index, self.group, self.seed, self.task = episode_id, index, group, seed, task
        self.secret = secret or secrets_mod.token_urlsafe(18)  # no "." in it: the token splits at the first
        self.timeout_s = float(timeout_s)
        self.stop = threading.Event()  # set when it times out or its round ends: a program agent is killed
        self.pending: Dict[str, Call] = {}  # calls in flight by request key (an identical request joins)
        self.orphans = 0  # calls whose clients all disconnected: not trained
        self.joined = 0  # requests that joined an identical call in flight (client retries)
        self.deadline = now + self.timeout_s  # moved on by each reply: the agent's idle time is what counts
        self.sequences: List[Sequence_] = []
        self.calls = 0  # calls accepted
        self.waiting = 0  # calls waiting for the engine
        self.reward: Optional[float] = None
        self.agent_done = False  # the agent function returned or raised
        self.agent_error: Optional[str] = None
        self.timed_out = False

    @property
    def live(self) -> bool:
        """Still expected to call: the engine waits for its call before it runs."""
        return not (self.agent_done or self.timed_out or self.reward is not None)

    @property
    def running(self) -> bool:
        """Its agent has neither returned nor timed out: the round does not end before it does."""
        return not (self.agent_done or self.timed_out)

    @property
    def token(self) -> str:
        """What names the episode and proves its agent made the call: `{id}.{secret}`."""
        return f"{self.id}.{self.secret}"

    @property
    def finish_reason(self) -> str:
        if self.reward is not None:  # rewarded, even if its agent hung afterwards
            return "rewarded"
        if self.timed_out:
            return "timeout"
        return "agent_error" if self.agent_error else "no_reward"

    @property
    def failed(self) -> bool:
        """Its agent crashed or timed out before it posted a reward (an infrastructure fault, not a 0)."""
        return self.finish_reason in ("agent_error", "timeout")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts
        out = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise EndpointError(400, "invalid_content", f"{where}.content[{k}]: only text parts are supported",
                                    param=f"{where}.content")
            out.append(part["text"])
        return "".join(out)
    raise EndpointError(400, "invalid_content", f"{where}.content must be a string or a list of text parts",
                        param=f"{where}.content")


def request_key(route: str, body: dict) -> str:
    """What makes two requests the same call: the route and the whole body (a client's retry
    sends the same body; its headers may differ)."""
    return route + ":" + json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)


def template_step(render: Callable[[], Any], tokenizer, messages: list, first: int = 0, **template_kwargs) -> Any:
    """`render()`, with a chat template's refusal (jinja2's TemplateError: a template's
    raise_exception, an undefined field) as a 400 naming the message it refuses: the first of
    messages[first:] whose conversation prefix the template does not render (else the last)."""
    from jinja2 import TemplateError

    try:
        return render()
    except TemplateError as e:
        culprit = len(messages) - 1
        for i in range(first, len(messages)):
            try:
                tokenizer.apply_chat_template(messages[:i + 1], tokenize=False, add_generation_prompt=False,
                                              **template_kwargs)
            except TemplateError:
                culprit = i
                break
        role = messages[culprit].get("role") if isinstance(messages[culprit], dict) else None
        raise EndpointError(400, "chat_template_error", f"messages[{culprit}] (role {role!r}): the model's chat "
                            f"template refuses it: {e}", param=f"messages[{culprit}]") from None


class EpisodeBook:
    """The open episodes of the current round, their calls, and the engine schedule."""

    def __init__(self, tokenizer, limits: Limits, *, require_secret: bool = False, barrier_warn_s: float = 30.0):
        self.tok, self.limits = tokenizer, limits
        self.require_secret = bool(require_secret)  # off loopback: every request carries its episode's token
        self.barrier_warn_s = float(barrier_warn_s)  # calls held this long by episodes that never called: warn
        self.cond = threading.Condition()
        self.episodes: Dict[str, Episode] = {}
        self.ended: set = set()  # ids of earlier rounds' episodes (a late call gets 409, not 404)
        self.waiting: List[Call] = []
        self.refused = 0  # refused requests in this round (unknown episodes included)
        self.held_since: Optional[float] = None  # when the waiting calls began to wait for a silent episode
        self.warned: set = set()  # episodes the barrier warning named this round

    # ------------------------------------------------------------------ the round's episodes
    def open(self, episodes: Sequence[Episode]) -> None:
        with self.cond:
            for ep in episodes:
                self.episodes[ep.id] = ep
            self.refused = 0
            self.held_since, self.warned = None, set()

    def close_round(self) -> List[Episode]:
        with self.cond:
            eps = sorted(self.episodes.values(), key=lambda e: e.index)
            self.ended.update(self.episodes)
            self.episodes = {}
            for call in self.waiting:  # an expired episode's call (the round ends without it)
                if call.clients == 0:
                    self._drop_orphan(call)
                call.future.set_exception(EndpointError(408, "episode_timeout", f"episode {call.episode.id}: timed out"))
            self.waiting = []
            for ep in eps:
                ep.stop.set()  # a program agent still running is killed (CommandAgent)
            return eps

    def agent_finished(self, ep: Episode, error: Optional[str]) -> None:
        with self.cond:
            ep.agent_done, ep.agent_error = True, error
            self.cond.notify_all()

    def authorize(self, ref: Optional[str], api_key: Optional[str] = None) -> Optional[str]:
        """The episode id a request may act for. `ref` names it (path, X-Episode-Id or `user`): a
        bare id or a token `{id}.{secret}`; `api_key` (the bearer token) may be a token too, then it
        names the episode when `ref` does not. 401 without a token where one is required, 403 for a
        wrong secret or another episode's token; an unknown or ended id is left to the call (404/409)."""
        key_id = self._check_token(api_key, "the API key", known_only=True) if api_key and "." in api_key else None
        ref_id = self._check_token(ref, "the episode reference") if ref and "." in ref else ref
        if ref_id and key_id and ref_id != key_id:
            raise EndpointError(403, "wrong_episode", f"episode {ref_id!r}: the API key is another episode's token; an "
                                f"agent acts only for its own episode", param="episode")
        eid = ref_id or key_id
        if self.require_secret and not (key_id or (ref and "." in ref)) and eid is not None:
            raise EndpointError(401, "secret_required", f"episode {eid!r}: the endpoint serves agents off loopback, so "
                                "every request carries its episode's token {id}.{secret} (its base URL "
                                "{server}/episodes/{token}/v1, or the API key)", param="episode")
        return eid

    def _check_token(self, token: str, what: str, known_only: bool = False) -> Optional[str]:
        """The episode id of a token whose secret is right; `known_only`: None unless it names an
        episode of this round (an API key of another kind is not a token)."""
        eid, _, secret = token.partition(".")
        with self.cond:
            ep = self.episodes.get(eid)
        if ep is None:  # an unknown or ended episode: 404/409 from the call itself
            return None if known_only or not eid else eid
        if not hmac.compare_digest(secret.encode(), ep.secret.encode()):
            raise EndpointError(403, "wrong_secret", f"episode {eid!r}: {what} carries a wrong secret", param="episode")
        return eid

    def _episode(self, episode_id: Optional[str]) -> Episode:
        """The live episode of a request; 400/404/409 otherwise (under the lock)."""
        if not episode_id:
            raise EndpointError(400, "missing_episode", "no episode id: send the X-Episode-Id header or the `user` field",
                                param="user")
        ep = self.episodes.get(episode_id)
        if ep is None:
            if episode_id in self.ended:
                raise EndpointError(409, "episode_closed", f"episode {episode_id!r} has ended (its round is over)")
            raise EndpointError(404, "unknown_episode", f"episode {episode_id!r} is unknown to this run")
        if ep.reward is not None:
            raise EndpointError(409, "episode_closed", f"episode {episode_id!r} is closed: its reward was set")
        if ep.timed_out:
            raise EndpointError(409, "episode_closed", f"episode {episode_id!r} is closed: it ran past "
                                f"rollout.agent_timeout_s")
        return ep

    def refuse(self) -> None:
        with self.cond:
            self.refused += 1

    # ------------------------------------------------------------------ requests
    def set_reward(self, episode_id: str, reward: Any) -> float:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
            raise EndpointError(400, "invalid_reward", f"reward must be a finite number, got {reward!r}", param="reward")
        with self.cond:
            ep = self.episodes.get(episode_id)
            if ep is not None and ep.reward is not None:
                raise EndpointError(409, "reward_already_set", f"episode {episode_id!r}: its reward was already set "
                                    f"({ep.reward})", param="reward")
            ep = self._episode(episode_id)
            answered = [c for c in ep.pending.values() if c.clients > 0]  # orphans are not trained: no wait
            if answered:
                raise EndpointError(409, "calls_in_flight", f"episode {episode_id!r}: {len(answered)} call(s) still "
                                    "waiting for their completion; set the reward after they return")
            ep.reward = float(reward)
            self.cond.notify_all()
            return ep.reward

    def _check_sampling(self, body: dict) -> int:
        lim = self.limits
        for key in ("stream", "tools", "functions", "logit_bias", "stop", "response_format"):
            if body.get(key) not in (None, False, [], {}):
                raise EndpointError(400, "unsupported_field", f"{key} is not supported by the training endpoint",
                                    param=key)
        if body.get("n", 1) != 1:
            raise EndpointError(400, "unsupported_field", f"n={body.get('n')}: one completion per call (make n calls)",
                                param="n")
        if body.get("top_logprobs"):
            raise EndpointError(400, "unsupported_field", "top_logprobs: only the sampled tokens' log-probs are returned",
                                param="top_logprobs")
        for key, want in (("temperature", lim.temperature), ("top_p", lim.top_p)):
            got = body.get(key)
            if got is not None and (not isinstance(got, (int, float)) or float(got) != float(want)):
                raise EndpointError(400, "sampling_mismatch", f"{key}={got!r}: this run samples at rollout.{key}="
                                    f"{want} (what the trainer's log-probs assume); omit it or send {want}", param=key)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is None:
            return lim.max_new_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise EndpointError(400, "invalid_max_tokens", f"max_tokens={mt!r} must be a positive integer", param="max_tokens")
        if mt > lim.max_new_tokens:
            raise EndpointError(413, "max_tokens_too_large", f"max_tokens={mt} is over rollout.max_new_tokens="
                                f"{lim.max_new_tokens}", param="max_tokens")
        return mt

    def submit_chat(self, episode_id: Optional[str], body: dict, request) -> Call:
        """`request`: the body checked and rendered as a dsrl.agent.endpoint.chat.ChatRequest."""
        messages, kwargs = request.messages, request.template_kwargs
        with self.cond:
            ep = self._episode(episode_id)
            seq, added = None, []
            last = ep.sequences[-1] if ep.sequences else None
            if (last is not None and last.renderer is not None and not last.in_flight and last.last_messages
                    and last.renderer.template_kwargs == kwargs):
                k = len(last.last_messages)
                if len(messages) > k and messages[:k] == last.last_messages:
                    sampled = last.traj.response_ids[last.traj.turn_spans[-1][0]:]
                    added = template_step(lambda: last.renderer.observation_ids(sampled, messages[k:]), self.tok,
                                          messages, k, **kwargs)
                    seq = last
            if seq is None:
                system = messages[0] if messages[0]["role"] == "system" else None
                seq = template_step(lambda: Sequence_(Trajectory(prompt_ids=chat_prompt_ids(self.tok, messages, **kwargs),
                                                                 messages=list(messages)),
                                                      TurnRenderer(self.tok, system, **kwargs)),
                                    self.tok, messages, **kwargs)
            else:
                seq.traj.messages += messages[len(seq.last_messages):]
            call = self._enqueue(ep, seq, added + request.prefill_ids, request.max_tokens)
            call.request = request
            seq.last_messages = messages  # the reply is appended when it is recorded
            return call

    def submit_completion(self, episode_id: Optional[str], body: dict) -> Call:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise EndpointError(400, "invalid_prompt", "prompt must be a non-empty string (one prompt per call)",
                                param="prompt")
        if body.get("echo") or body.get("suffix"):
            raise EndpointError(400, "unsupported_field", "echo/suffix are not supported", param="echo")
        max_tokens = self._check_sampling(body)
        with self.cond:
            ep = self._episode(episode_id)
            seq, added = None, []
            last = ep.sequences[-1] if ep.sequences else None
            if (last is not None and last.renderer is None and not last.in_flight and last.last_text is not None
                    and len(prompt) > len(last.last_text) and prompt.startswith(last.last_text)):
                seq = last
                added = list(self.tok(prompt[len(last.last_text):], add_special_tokens=False)["input_ids"])
            if seq is None:
                seq = Sequence_(Trajectory(prompt_ids=list(self.tok(prompt)["input_ids"])), None)
            call = self._enqueue(ep, seq, added, max_tokens)
            seq.last_text = prompt
            return call

    def submit_tokens(self, episode_id: Optional[str], token_ids: list, max_tokens: int) -> Call:
        """Token in (/inference/v1/generate): a call whose ids are the previous call's ids + its
        sampled ids + more continues that sequence (the more as the agent's tokens)."""
        with self.cond:
            ep = self._episode(episode_id)
            seq, added = None, []
            last = ep.sequences[-1] if ep.sequences else None
            if last is not None and last.tokens and not last.in_flight:
                ctx = last.context()
                if len(token_ids) > len(ctx) and token_ids[:len(ctx)] == ctx:
                    seq, added = last, list(token_ids[len(ctx):])
            if seq is None:
                seq = Sequence_(Trajectory(prompt_ids=list(token_ids)), None, tokens=True)
            return self._enqueue(ep, seq, added, max_tokens)

    # ------------------------------------------------------------------ retries and disconnects
    def submit(self, episode_id: Optional[str], key: str, make: Callable[[], Call]) -> Call:
        """The call of a request: the call in flight that an identical request (`key`: its route and
        body) joins, a client's retry; else `make()`, one of the submit_* methods, whose call is then
        joinable. Before a new call, the episode's orphans still waiting are dropped: the agent moved
        on without them."""
        with self.cond:  # a re-entrant lock: make() takes it again
            ep = self._episode(episode_id)
            call = ep.pending.get(key)
            if call is not None:
                call.clients += 1
                ep.joined += 1
                return call
            for orphan in [c for c in self.waiting if c.episode is ep and c.clients == 0]:
                self.waiting.remove(orphan)
                ep.waiting -= 1
                self._drop_orphan(orphan)
                orphan.future.set_exception(EndpointError(499, "client_closed", "every client of this call disconnected"))
            call = make()
            call.key = key
            ep.pending[key] = call
            return call

    def detach(self, call: Call) -> None:
        """A client of `call` disconnected before its reply; with no client left it is an orphan."""
        with self.cond:
            call.clients -= 1

    def _drop_orphan(self, call: Call) -> None:
        """Forget a call no client waits for: its sequence as it was before it (under the lock)."""
        ep, seq = call.episode, call.seq
        ep.pending.pop(call.key, None)
        ep.orphans += 1
        seq.in_flight = False
        if call.new_seq:
            if seq in ep.sequences:
                ep.sequences.remove(seq)
        else:
            seq.last_messages, seq.last_text = call.undo
            if seq.renderer is not None:  # chat: the conversation so far is last_messages
                del seq.traj.messages[len(seq.last_messages or []):]
        log.info("agent endpoint: episode %s: call %d is not trained (every client disconnected before its reply)",
                 ep.id, call.number)

    def _enqueue(self, ep: Episode, seq: Sequence_, added: list, max_tokens: int) -> Call:
        lim = self.limits
        if ep.calls >= lim.max_calls:
            raise EndpointError(429, "call_limit", f"episode {ep.id!r}: {ep.calls} calls made, rollout.max_turns="
                                f"{lim.max_calls} per episode")
        prompt = seq.context() + list(added)
        room = min(lim.max_model_len - len(prompt), lim.max_episode_tokens - len(seq.traj.response_ids) - len(added))
        if room < 1:
            raise EndpointError(413, "context_length_exceeded",
                                f"episode {ep.id!r}: the prompt has {len(prompt)} tokens ({len(seq.traj.response_ids) + len(added)} "
                                f"after the first message); no room under rollout.max_model_len={lim.max_model_len} and "
                                f"rollout.max_episode_tokens={lim.max_episode_tokens}", param="messages")
        new_seq = seq not in ep.sequences
        call = Call(ep, ep.calls, seq, list(added), prompt, min(max_tokens, room), concurrent.futures.Future(),
                    new_seq=new_seq, undo=(seq.last_messages, seq.last_text))
        if new_seq:
            ep.sequences.append(seq)
        seq.in_flight = True
        ep.calls += 1
        ep.waiting += 1
        self.waiting.append(call)
        self.cond.notify_all()
        return call

    # ------------------------------------------------------------------ the engine side
    def next_batch(self, clock=time.monotonic) -> Optional[List[Call]]:
        """Block until every live episode has a call waiting; the waiting calls in (episode, call)
        order. None once every agent has returned (or timed out) and no call waits: the round is
        over. An agent with no call waiting for longer than its timeout since its last reply (or
        the round's start) is timed out; one waiting for the engine never is."""
        with self.cond:
            while True:
                now = clock()
                for ep in self.episodes.values():
                    if ep.running and not ep.waiting and now >= ep.deadline:
                        ep.timed_out = True
                        ep.stop.set()  # a program agent is killed (CommandAgent)
                        log.warning("agent endpoint: the agent of episode %s made no call for rollout.agent_timeout_s"
                                    "=%g s; its calls so far are kept%s", ep.id, ep.timeout_s,
                                    "" if ep.reward is not None else ", its reward is 0")
                live = [ep for ep in self.episodes.values() if ep.live]
                if self.waiting and all(ep.waiting for ep in live):
                    batch = sorted(self.waiting, key=lambda c: (c.episode.index, c.number))
                    self.waiting, self.held_since = [], None
                    return batch
                running = [ep for ep in self.episodes.values() if ep.running]
                if not running and not self.waiting:
                    return None
                wake = [ep.deadline for ep in running if not ep.waiting]
                if self.waiting:
                    self.held_since = now if self.held_since is None else self.held_since
                    warn_at = self.held_since + self.barrier_warn_s
                    if now >= warn_at:
                        self._warn_silent(live, now - self.held_since)
                    else:
                        wake.append(warn_at)
                self.cond.wait(timeout=max(min(wake, default=now + 1.0) - now, 0.01))

    def _warn_silent(self, live: Sequence[Episode], held_s: float) -> None:
        """Calls wait at the barrier for episodes whose agents have not made a single call: name
        them once a round. Typically their requests are queued in the agent's own HTTP client, whose
        connection pool is smaller than the round's episodes (each waiting call holds a connection)."""
        silent = [ep.id for ep in live if ep.calls == 0 and not ep.waiting and ep.id not in self.warned]
        if not silent:
            return
        self.warned.update(silent)
        log.warning("agent endpoint: %d call(s) have waited %.1f s for episode(s) that have made no call yet: %s. The "
                    "engine runs when every live episode has a call waiting; an agent that shares one HTTP client "
                    "across episodes needs a connection pool of at least %d connections (this round's episodes), "
                    "else the episodes wait until rollout.agent_timeout_s=%g s", len(self.waiting), held_s,
                    ", ".join(silent), len(self.episodes), max(ep.timeout_s for ep in live))

    def record(self, call: Call, ids: list, logprobs: list, finish: str) -> dict:
        """Append the call's added tokens and its completion to its sequence; the reply."""
        with self.cond:
            seq, ep = call.seq, call.episode
            if len(logprobs) != len(ids):
                raise RuntimeError(f"episode {ep.id}: the engine returned {len(logprobs)} log-probs for {len(ids)} tokens")
            ep.pending.pop(call.key, None)
            if call.clients == 0:  # no client will see this completion: it is not trained
                ep.waiting -= 1
                self._drop_orphan(call)
                ep.deadline = time.monotonic() + ep.timeout_s
                self.cond.notify_all()
                return None
            cut = len(ids) > call.max_tokens or finish == "length"  # the kept tokens are a prefix of the sampled ones
            ids, logprobs = [int(t) for t in ids[:call.max_tokens]], [float(x) for x in logprobs[:call.max_tokens]]
            t = seq.traj
            t.response_ids += call.added_ids
            t.model_mask += [0] * len(call.added_ids)
            t.rollout_log_probs += [0.0] * len(call.added_ids)
            start = len(t.response_ids)
            t.response_ids += ids
            t.model_mask += [1] * len(ids)
            t.rollout_log_probs += logprobs
            t.turn_spans.append((start, start + len(ids)))
            t.turn_finish.append("length" if cut else finish)
            text = self.tok.decode(ids, skip_special_tokens=True)
            finish = "length" if cut else finish
            message = None
            if call.request is not None:  # chat: the reply as returned (stop strings cut, tool calls parsed)
                message, text, finish = call.request.reply(text, finish, f"{ep.id}_{call.number}")
                seq.last_messages = seq.last_messages + [message]
                t.messages.append(message)
            # (a token-in sequence keeps only ids: its client holds the text)
            elif seq.renderer is not None and not seq.tokens:
                seq.last_messages = seq.last_messages + [{"role": "assistant", "content": text}]
                t.messages.append({"role": "assistant", "content": text})
            elif not seq.tokens:
                seq.last_text = seq.last_text + text
            seq.in_flight = False
            ep.waiting -= 1
            ep.deadline = time.monotonic() + ep.timeout_s
            self.cond.notify_all()
            return {"text": text, "finish_reason": finish, "prompt_tokens": len(call.prompt_ids),
                    "completion_tokens": len(ids), "token_ids": list(ids), "logprobs": list(logprobs), "message": message}

    def fail(self, calls: Sequence[Call], error: BaseException) -> None:
        with self.cond:
            for c in calls:
                c.episode.waiting -= 1
                c.episode.pending.pop(c.key, None)
                c.seq.in_flight = False
                if not c.future.done():
                    c.future.set_exception(EndpointError(500, "engine_error", f"the rollout engine failed: {error!r}"))
            self.cond.notify_all()


def episode_trajectories(ep: Episode) -> List[Trajectory]:
    """The episode's sequences that hold a completion, each with the episode's reward (0 without one)."""
    out = []
    for seq in ep.sequences:
        t = seq.traj
        if not t.turn_spans:
            continue
        t.turn_rewards = [float(ep.reward or 0.0)]
        t.finish_reason = ep.finish_reason
        t.infos = [{"calls": len(t.turn_spans), "episode": ep.id}]
        out.append(t)
    return out


def round_metrics(episodes: Sequence[Episode], trajectories: Sequence[Trajectory], refused: int,
                  dropped: int = 0) -> dict:
    """agent/* means per episode (calls, sequences, tokens, reward, finish reasons, failed and
    dropped episodes, retried and orphaned calls) and counts."""
    n = max(len(episodes), 1)
    out = {"agent/reward": sum(float(e.reward or 0.0) for e in episodes) / n,
           "agent/calls": sum(e.calls for e in episodes) / n,
           "agent/turns": sum(e.calls for e in episodes) / n,
           "agent/sequences": sum(len([s for s in e.sequences if s.traj.turn_spans]) for e in episodes) / n,
           "agent/split_episodes": sum(len([s for s in e.sequences if s.traj.turn_spans]) > 1 for e in episodes) / n,
           "agent/model_tokens": sum(t.model_tokens for t in trajectories) / n,
           "agent/env_tokens": sum(len(t.response_ids) - t.model_tokens for t in trajectories) / n,
           "agent/refused_requests": float(refused),
           "agent/failed_episodes": sum(e.failed for e in episodes) / n,  # agent crashed or timed out, no reward
           "agent/dropped_episodes": dropped / n,  # rollout.failed_episodes=drop: left out of their groups
           "agent/joined_calls": sum(e.joined for e in episodes) / n,  # identical requests joined (retries)
           "agent/orphan_calls": sum(e.orphans for e in episodes) / n}  # calls not trained: clients disconnected
    for reason in ("rewarded", "no_reward", "agent_error", "timeout"):
        out[f"agent/finish_{reason}"] = sum(e.finish_reason == reason for e in episodes) / n
    return out
