"""Multi-turn episodes on the rollout engine, kept token-exact for training.

Many episodes run at once: each turn, the current token ids of every live episode go to ONE
`worker.generate(..., n=1)` call, so the engine batches them as it batches a GRPO step. The
sampled token ids and their log-probs are appended as returned; the environment's answer is
appended as the token ids of the chat template's rendering of only the new messages
(dsrl.agent.turns). The trainer then scores exactly the ids that were sampled, and the
per-token model mask keeps environment tokens out of the loss.

An episode ends when the environment says done ("done"), after `max_turns` model turns
("max_turns"), when its response (everything after the first observation, model and
environment tokens) would exceed `max_episode_tokens` ("budget"), or when the environment
raises ("env_error"; counted, the episode keeps the rewards it had)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from dsrl.actor.batch import Sample
from dsrl.agent.env import StepResult, as_messages
from dsrl.agent.turns import TurnRenderer, prompt_ids as first_prompt_ids

log = logging.getLogger(__name__)

FINISH_REASONS = ("done", "max_turns", "budget", "env_error")


@dataclass
class Trajectory:
    prompt_ids: list  # the first observation through the chat template (with the generation prompt)
    response_ids: list = field(default_factory=list)  # everything after the prompt: model and env tokens
    model_mask: list = field(default_factory=list)  # per response token: 1 = sampled by the model, 0 = env
    rollout_log_probs: list = field(default_factory=list)  # sampling log-prob per model token, 0.0 on env tokens
    turn_rewards: list = field(default_factory=list)  # reward of each environment step
    turn_spans: list = field(default_factory=list)  # (start, end) of each model turn in response_ids
    turn_finish: list = field(default_factory=list)  # the engine's finish reason of each turn (stop/length)
    finish_reason: str = ""  # one of FINISH_REASONS
    messages: list = field(default_factory=list)  # the conversation as text (for logs; never re-tokenized)
    infos: list = field(default_factory=list)  # StepResult.info of each environment step

    @property
    def reward(self) -> float:
        """The episode's reward: the sum of its turn rewards."""
        return float(sum(self.turn_rewards))

    @property
    def turns(self) -> int:
        return len(self.turn_spans)

    @property
    def model_tokens(self) -> int:
        return int(sum(self.model_mask))

    def to_sample(self, group: int, index: int, text: str = "") -> Sample:
        """The trajectory as a training Sample: response_ids cover model and env tokens, the
        rollout log-probs are 0.0 on env tokens, and `extra["model_mask"]` is the loss mask the
        trainer must use (collate / train_on: see dsrl/agent/README.md)."""
        return Sample(prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
                      rollout_log_probs=list(self.rollout_log_probs), group=group, index=index,
                      reward=self.reward, finish_reason=self.finish_reason, text=text,
                      extra={"model_mask": list(self.model_mask), "turn_rewards": list(self.turn_rewards),
                             "turn_spans": [tuple(s) for s in self.turn_spans], "turns": self.turns})


class _Episode:
    def __init__(self, env, tokenizer, prompt, seed: Optional[int], budget: int, index: int):
        self.env, self.seed, self.budget, self.index = env, seed, budget, index
        messages = as_messages(env.reset(prompt, seed), key=f"episode {index}: reset()")
        system = messages[0] if messages[0]["role"] == "system" else None
        self.renderer = TurnRenderer(tokenizer, system)
        self.traj = Trajectory(prompt_ids=first_prompt_ids(tokenizer, messages), messages=messages)

    @property
    def room(self) -> int:
        """Response tokens this episode may still add."""
        return self.budget - len(self.traj.response_ids)

    def context(self) -> list:
        return self.traj.prompt_ids + self.traj.response_ids


def run_episodes(worker, tokenizer, envs: Sequence[Any], prompts: Optional[Sequence[Any]] = None, *,
                 max_turns: int, max_episode_tokens: int, max_turn_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seeds: Optional[Sequence[int]] = None, max_context: Optional[int] = None,
                 show_progress: bool = False) -> List[Trajectory]:
    """Run one episode per environment in `envs` (reset with `prompts[i]` and `seeds[i]`), all at
    once, one batched generate call per turn. Turn t of episode i samples with seed
    `seeds[i] + t` (dsrl.rollout.seeds spaces episode seeds 2^16 apart).

    max_turn_tokens caps each model turn; max_episode_tokens caps the response (model + env
    tokens); max_context (the engine's max_model_len) lowers an episode's cap to what fits after
    its prompt. A turn longer than its episode's room is cut to it (the kept tokens are a prefix
    of what was sampled, so their log-probs stand) and ends the episode ("budget")."""
    if max_turns < 1:
        raise ValueError(f"rollout.max_turns={max_turns} must be >= 1")
    if max_episode_tokens < 1 or max_turn_tokens < 1:
        raise ValueError(f"rollout.max_episode_tokens={max_episode_tokens} and rollout.max_new_tokens="
                         f"{max_turn_tokens} must be >= 1")
    n = len(envs)
    if prompts is not None and len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} environments")
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} environments")
    episodes = []
    for i, env in enumerate(envs):
        ep = _Episode(env, tokenizer, None if prompts is None else prompts[i],
                      None if seeds is None else int(seeds[i]), max_episode_tokens, i)
        if max_context is not None:
            ep.budget = min(ep.budget, int(max_context) - len(ep.traj.prompt_ids))
            if ep.budget < 1:
                raise ValueError(f"episode {i}: its first observation has {len(ep.traj.prompt_ids)} tokens, "
                                 f"no room left under rollout.max_model_len={max_context}")
        episodes.append(ep)

    live = list(episodes)
    turn = 0
    while live:
        max_tokens = min(max_turn_tokens, max(ep.room for ep in live))
        turn_seeds = None if seeds is None else [ep.seed + turn for ep in live]
        groups = worker.generate([ep.context() for ep in live], n=1, temperature=temperature, top_p=top_p,
                                 max_tokens=max_tokens, show_progress=show_progress, seeds=turn_seeds)
        if len(groups) != len(live):
            raise RuntimeError(f"the engine answered {len(groups)} of {len(live)} episodes")
        still = []
        for ep, group in zip(live, groups):
            if _model_turn(ep, group[0], tokenizer, greedy=temperature == 0.0, max_turns=max_turns):
                still.append(ep)
        live = still
        turn += 1
    return [ep.traj for ep in episodes]


def _model_turn(ep: _Episode, completion, tokenizer, *, greedy: bool, max_turns: int) -> bool:
    """Append one sampled turn, step the environment, append its answer. True if the episode goes on."""
    traj = ep.traj
    ids = [int(t) for t in completion.token_ids]
    lps = [float(x) for x in completion.logprobs]
    if not lps and greedy:
        lps = [0.0] * len(ids)  # greedy requests carry no log-probs (evaluation only)
    if len(lps) != len(ids):
        raise RuntimeError(f"episode {ep.index}: the engine returned {len(lps)} log-probs for {len(ids)} tokens")
    cut = len(ids) > ep.room
    ids, lps = ids[:ep.room], lps[:ep.room]
    start = len(traj.response_ids)
    traj.response_ids += ids
    traj.model_mask += [1] * len(ids)
    traj.rollout_log_probs += lps
    traj.turn_spans.append((start, start + len(ids)))
    traj.turn_finish.append("length" if cut else str(completion.finish_reason))
    action = tokenizer.decode(ids, skip_special_tokens=True)
    traj.messages.append({"role": "assistant", "content": action})
    if cut:
        traj.finish_reason = "budget"
        return False
    try:
        result = ep.env.step(action)
        if not isinstance(result, StepResult):
            result = StepResult(*result)  # a plain (observation, reward, done[, info]) tuple
    except Exception as e:  # a broken environment ends its episode, not the rollout
        log.warning("episode %d: environment %s raised at turn %d: %r", ep.index, type(ep.env).__name__,
                    traj.turns, e)
        traj.infos.append({"error": repr(e)})
        traj.finish_reason = "env_error"
        return False
    traj.turn_rewards.append(float(result.reward))
    traj.infos.append(dict(result.info or {}))
    if result.done:
        traj.finish_reason = "done"
        return False
    if traj.turns >= max_turns:
        traj.finish_reason = "max_turns"
        return False
    new = as_messages(result.observation, key=f"episode {ep.index}: step() observation")
    obs = ep.renderer.observation_ids(ids, new)
    if len(obs) >= ep.room:  # no room for the observation and at least one model token
        traj.finish_reason = "budget"
        return False
    traj.response_ids += obs
    traj.model_mask += [0] * len(obs)
    traj.rollout_log_probs += [0.0] * len(obs)
    traj.messages += new
    return True


def trajectories_to_samples(trajectories: Sequence[Trajectory], groups: Sequence[int], tokenizer=None,
                            index_offset: int = 0) -> List[Sample]:
    """Samples for the trainer (group ids as for GRPO: the episodes of one prompt share a group);
    `tokenizer` decodes each response (model and env tokens) into Sample.text for logs."""
    if len(groups) != len(trajectories):
        raise ValueError(f"{len(groups)} group ids for {len(trajectories)} trajectories")
    out = []
    for k, (t, g) in enumerate(zip(trajectories, groups)):
        text = tokenizer.decode(t.response_ids, skip_special_tokens=False) if tokenizer is not None else ""
        out.append(t.to_sample(group=int(g), index=index_offset + k, text=text))
    return out


def episode_numbers(samples: Sequence[Sample]) -> List[int]:
    """A number per sample, shared by the samples of one episode (Sample.extra["episode"], set by
    the agent endpoint, whose episodes may train as several sequences); a sample without one is
    an episode of its own. The advantage's group statistics count each episode once."""
    numbers: dict = {}
    return [numbers.setdefault(s.extra.get("episode", ("sample", k)), len(numbers)) for k, s in enumerate(samples)]


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict:
    """Per-step means: reward, turns, model/env tokens, finish-reason fractions, tool calls."""
    n = max(len(trajectories), 1)
    out = {"agent/reward": sum(t.reward for t in trajectories) / n,
           "agent/turns": sum(t.turns for t in trajectories) / n,
           "agent/model_tokens": sum(t.model_tokens for t in trajectories) / n,
           "agent/env_tokens": sum(len(t.response_ids) - t.model_tokens for t in trajectories) / n,
           "agent/tool_calls": sum(i.get("tool_calls", 0) for t in trajectories for i in t.infos) / n}
    for reason in FINISH_REASONS:
        out[f"agent/finish_{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    return out
