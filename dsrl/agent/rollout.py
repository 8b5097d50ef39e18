"""The trainer's entry to multi-turn rollouts: the same shape as
dsrl.rollout.samples.generate_samples (prompts in, scored Samples out), with each of the
`n` samples of a prompt being one episode of the environment named by `rollout.env`.

Seeds: a prompt's request seed s (dsrl.rollout.seeds, spaced 2^16 apart) gives episode k of
that prompt the seed s + k * EPISODE_SEED_STRIDE and its turn t the seed s + k * STRIDE + t,
so every (prompt, episode, turn) samples with its own seed and a resumed run draws the same."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from dsrl.actor.batch import Sample
from dsrl.agent.environments import make_env
from dsrl.agent.episodes import episode_metrics, run_episodes, trajectories_to_samples

EPISODE_SEED_STRIDE = 256  # seeds per episode: max_turns <= 256, n_samples_per_prompt <= 256 (2^16 per prompt)


def generate_episode_samples(worker, tokenizer, prompts: Sequence[Any], *, env: str, env_kwargs: Optional[dict],
                             n: int, max_turns: int, max_episode_tokens: int, max_turn_tokens: int,
                             temperature: float, top_p: float, seeds: Optional[Sequence[int]] = None,
                             max_context: Optional[int] = None, index_offset: int = 0,
                             show_progress: bool = False) -> Tuple[List[Sample], dict]:
    """`n` episodes per prompt (group g = prompt g), all run together; returns the Samples
    (reward = episode reward, extra["model_mask"] = loss mask) and the episode metrics."""
    if max_turns > EPISODE_SEED_STRIDE:
        raise ValueError(f"rollout.max_turns={max_turns} must be <= {EPISODE_SEED_STRIDE}")
    if n > EPISODE_SEED_STRIDE:
        raise ValueError(f"algo.n_samples_per_prompt={n} must be <= {EPISODE_SEED_STRIDE} with rollout.env")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    envs, episode_prompts, groups, episode_seeds = [], [], [], []
    for g, prompt in enumerate(prompts):
        for k in range(n):
            envs.append(make_env(env, env_kwargs))
            episode_prompts.append(prompt)
            groups.append(g)
            if seeds is not None:
                episode_seeds.append(int(seeds[g]) + k * EPISODE_SEED_STRIDE)
    trajs = run_episodes(worker, tokenizer, envs, episode_prompts, max_turns=max_turns,
                         max_episode_tokens=max_episode_tokens, max_turn_tokens=max_turn_tokens,
                         temperature=temperature, top_p=top_p, seeds=episode_seeds if seeds is not None else None,
                         max_context=max_context, show_progress=show_progress)
    return trajectories_to_samples(trajs, groups, tokenizer, index_offset), episode_metrics(trajs)


def mean_episode_metrics(rounds) -> dict:
    """The agent/* metrics of one step's rollout rounds [(episodes, metrics), ...] (dynamic
    sampling may run several): their means weighted by each round's episode count."""
    total = sum(n for n, _ in rounds)
    if total == 0:
        return {}
    return {k: sum(n * m.get(k, 0.0) for n, m in rounds) / total for k in rounds[0][1]}
