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
sequence when its prompt text is the previous prompt text + the returned text + more.

Scheduling by counts, never by clocks. The round's thread runs the engine only when every live
episode (agent still running, no reward yet, not timed out) has at least one call waiting; it then
generates all waiting calls in ONE batched `worker.generate`, ordered by (episode, call number),
with the seed `episode seed + call number`. Which calls share a batch therefore depends only on
what the agents do, not on timing, and a run is reproducible when its agents are. The round ends
when every agent has returned. A clock enters only through `agent_timeout_s`: an agent that makes
no call for that long after its last reply (or the round's start) is ended."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from dsrl.agent.episodes import Trajectory
from dsrl.agent.turns import TurnRenderer, prompt_ids as chat_prompt_ids

log = logging.getLogger("dsrl")

CALL_SEED_STRIDE = 256  # seeds per episode: calls per episode <= 256 (rollout.max_turns)


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


class Episode:
    def __init__(self, episode_id: str, index: int, group: int, seed: int, task: dict, timeout_s: float,
                 now: float):
        self.id, self.index, self.group, self.seed, self.task = episode_id, index, group, seed, task
        self.timeout_s = float(timeout_s)
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
    def finish_reason(self) -> str:
        if self.reward is not None:  # rewarded, even if its agent hung afterwards
            return "rewarded"
        if self.timed_out:
            return "timeout"
        return "agent_error" if self.agent_error else "no_reward"


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


def normalize_messages(messages: Any) -> list:
    """[{role, content}] with text content; anything else refused naming the message."""
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "invalid_messages", "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise EndpointError(400, "invalid_messages", f"{where} needs a string 'role' and a 'content'", param=where)
        if m.get("tool_calls") or m.get("function_call"):
            raise EndpointError(400, "unsupported_field", f"{where}: tool_calls are not supported (write tool "
                                "calls as text the agent parses)", param=f"{where}.tool_calls")
        out.append({"role": m["role"], "content": _text(m["content"], where)})
    return out


class EpisodeBook:
    """The open episodes of the current round, their calls, and the engine schedule."""

    def __init__(self, tokenizer, limits: Limits):
        self.tok, self.limits = tokenizer, limits
        self.cond = threading.Condition()
        self.episodes: Dict[str, Episode] = {}
        self.ended: set = set()  # ids of earlier rounds' episodes (a late call gets 409, not 404)
        self.waiting: List[Call] = []
        self.refused = 0  # refused requests in this round (unknown episodes included)

    # ------------------------------------------------------------------ the round's episodes
    def open(self, episodes: Sequence[Episode]) -> None:
        with self.cond:
            for ep in episodes:
                self.episodes[ep.id] = ep
            self.refused = 0

    def close_round(self) -> List[Episode]:
        with self.cond:
            eps = sorted(self.episodes.values(), key=lambda e: e.index)
            self.ended.update(self.episodes)
            self.episodes = {}
            for call in self.waiting:  # an expired episode's call (the round ends without it)
                call.future.set_exception(EndpointError(408, "episode_timeout", f"episode {call.episode.id}: timed out"))
            self.waiting = []
            return eps

    def agent_finished(self, ep: Episode, error: Optional[str]) -> None:
        with self.cond:
            ep.agent_done, ep.agent_error = True, error
            self.cond.notify_all()

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
            if ep.waiting:
                raise EndpointError(409, "calls_in_flight", f"episode {episode_id!r}: {ep.waiting} call(s) still "
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

    def submit_chat(self, episode_id: Optional[str], body: dict) -> Call:
        messages = normalize_messages(body.get("messages"))
        if messages[-1]["role"] == "assistant":
            raise EndpointError(400, "invalid_messages", "the last message is the assistant's: nothing to answer "
                                "(continuing an assistant message is not supported)", param=f"messages[{len(messages) - 1}]")
        max_tokens = self._check_sampling(body)
        with self.cond:
            ep = self._episode(episode_id)
            seq, added = None, []
            last = ep.sequences[-1] if ep.sequences else None
            if last is not None and last.renderer is not None and not last.in_flight and last.last_messages:
                k = len(last.last_messages)
                if len(messages) > k and messages[:k] == last.last_messages:
                    sampled = last.traj.response_ids[last.traj.turn_spans[-1][0]:]
                    added = last.renderer.observation_ids(sampled, messages[k:])
                    seq = last
            if seq is None:
                system = messages[0] if messages[0]["role"] == "system" else None
                seq = Sequence_(Trajectory(prompt_ids=chat_prompt_ids(self.tok, messages), messages=list(messages)),
                                TurnRenderer(self.tok, system))
            else:
                seq.traj.messages += messages[len(seq.last_messages):]
            call = self._enqueue(ep, seq, added, max_tokens)
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
        if seq not in ep.sequences:
            ep.sequences.append(seq)
        seq.in_flight = True
        call = Call(ep, ep.calls, seq, list(added), prompt, min(max_tokens, room), concurrent.futures.Future())
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
                        log.warning("agent endpoint: the agent of episode %s made no call for rollout.agent_timeout_s"
                                    "=%g s; its calls so far are kept%s", ep.id, ep.timeout_s,
                                    "" if ep.reward is not None else ", its reward is 0")
                live = [ep for ep in self.episodes.values() if ep.live]
                if self.waiting and all(ep.waiting for ep in live):
                    batch = sorted(self.waiting, key=lambda c: (c.episode.index, c.number))
                    self.waiting = []
                    return batch
                running = [ep for ep in self.episodes.values() if ep.running]
                if not running and not self.waiting:
                    return None
                idle = [ep.deadline for ep in running if not ep.waiting]
                self.cond.wait(timeout=max(min(idle, default=now + 1.0) - now, 0.01))

    def record(self, call: Call, ids: list, logprobs: list, finish: str) -> dict:
        """Append the call's added tokens and its completion to its sequence; the reply."""
        with self.cond:
            seq, ep = call.seq, call.episode
            if len(logprobs) != len(ids):
                raise RuntimeError(f"episode {ep.id}: the engine returned {len(logprobs)} log-probs for {len(ids)} tokens")
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
            if seq.renderer is not None:
                seq.last_messages = seq.last_messages + [{"role": "assistant", "content": text}]
                t.messages.append({"role": "assistant", "content": text})
            else:
                seq.last_text = seq.last_text + text
            seq.in_flight = False
            ep.waiting -= 1
            ep.deadline = time.monotonic() + ep.timeout_s
            self.cond.notify_all()
            return {"text": text, "finish_reason": "length" if cut else finish, "prompt_tokens": len(call.prompt_ids),
                    "completion_tokens": len(ids), "token_ids": list(ids), "logprobs": list(logprobs)}

    def fail(self, calls: Sequence[Call], error: BaseException) -> None:
        with self.cond:
            for c in calls:
                c.episode.waiting -= 1
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


def round_metrics(episodes: Sequence[Episode], trajectories: Sequence[Trajectory], refused: int) -> dict:
    """agent/* means per episode (calls, sequences, tokens, reward, finish reasons) and counts."""
    n = max(len(episodes), 1)
    out = {"agent/reward": sum(float(e.reward or 0.0) for e in episodes) / n,
           "agent/calls": sum(e.calls for e in episodes) / n,
           "agent/turns": sum(e.calls for e in episodes) / n,
           "agent/sequences": sum(len([s for s in e.sequences if s.traj.turn_spans]) for e in episodes) / n,
           "agent/split_episodes": sum(len([s for s in e.sequences if s.traj.turn_spans]) > 1 for e in episodes) / n,
           "agent/model_tokens": sum(t.model_tokens for t in trajectories) / n,
           "agent/env_tokens": sum(len(t.response_ids) - t.model_tokens for t in trajectories) / n,
           "agent/refused_requests": float(refused)}
    for reason in ("rewarded", "no_reward", "agent_error", "timeout"):
        out[f"agent/finish_{reason}"] = sum(e.finish_reason == reason for e in episodes) / n
    return out
