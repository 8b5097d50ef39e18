"""One step's rollout on one rank, with DAPO's dynamic sampling as an option.

Without dynamic sampling a step is one generation of the rank's share of prompts
(`rollout_batch_size / world`), exactly as always. With it (`algo.dynamic_sampling`), a group
whose rewards are all equal carries zero advantage under group-normalized estimators and only
dilutes the batch, so it is dropped and fresh prompts are generated in further rounds until the
rank holds its share of informative groups, or `algo.max_sampling_rounds` rounds have run (then
the step trains on the informative groups it has; the shortfall is logged).

Each rank fills its own share: ranks never wait for each other here and nothing in this module
is collective, so it may run in a background thread (dsrl.rollout.overlap). A rank that ends
short trains fewer groups; the trainer's normalizers are global sums and it pads microbatch
counts across ranks, so unequal counts are handled downstream.

An extra round asks for as many prompts as the informative rate seen so far in the step
predicts it needs (at most the rank's share): on a CPU every generated sequence costs, and
informative groups beyond the share are discarded (`surplus`)."""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, List, Sequence

from dsrl.actor.batch import Sample
from dsrl.actor.masks import model_tokens

# generate_round(round, count) -> the samples of `count` fresh prompts, groups numbered 0..count-1
GenerateRound = Callable[[int, int], List[Sample]]


@dataclass
class Rollout:
    """One step's samples on this rank and how they were obtained (local counts: the trainer
    reduces them over ranks)."""
    samples: List[Sample]  # kept groups, renumbered 0..G-1 (samples 0..N-1), groups adjacent
    rounds: int = 1  # generations run
    kept_groups: int = 0  # informative groups in `samples` (all of them without dynamic sampling)
    dropped_groups: int = 0  # groups with all-equal rewards, not trained (dynamic sampling only)
    filler_groups: int = 0  # all-equal groups trained to fill a shortfall after the last round
    surplus_groups: int = 0  # informative groups beyond the share, discarded
    generated: int = 0  # samples generated in all rounds (dropped ones included)
    reward_sum: float = 0.0  # over every generated sample
    length_sum: int = 0  # response tokens the model sampled, over every generated sample
    weights_step: int = 0  # the step whose weights generated it (0 = the initial weights)
    seconds: float = 0.0  # wall time of the generation and scoring
    fault_counts: dict = field(default_factory=dict)  # this rank's fault counters of the rollout (not reduced)
    source_metrics: dict = field(default_factory=dict)  # the prompt source's metrics after its draws
    async_counts: dict = field(default_factory=dict)  # algo.async_schedule clock|deterministic: local sums
    # The prompts' identities: each training prompt's draw number in this rank's prompt stream (0, 1,
    # ... over the run). `drawn`: prompts this rollout drew; `trained_draws`: the groups in `samples`,
    # in their order; `dropped_draws`: drawn and never trained (dynamic sampling's all-equal and
    # surplus groups; the asynchronous schedules' stale groups). `*_prompts`: their Prompt.uid, in
    # the same order (set by the caller, which holds the prompts). Immutable defaults: a rollout
    # pickled in a checkpoint before they existed reads them as empty.
    drawn: int = 0
    trained_draws: Sequence[int] = ()
    dropped_draws: Sequence[int] = ()
    trained_prompts: Sequence[str] = ()
    dropped_prompts: Sequence[str] = ()


def is_informative(rewards: Sequence[float]) -> bool:
    """A group teaches something only if its rewards differ (exact float comparison, as DAPO)."""
    return len(set(float(r) for r in rewards)) > 1


def split_groups(samples: Sequence[Sample]) -> List[List[Sample]]:
    """The groups of one generation, in order (a group's samples are adjacent)."""
    return [list(g) for _, g in itertools.groupby(samples, key=lambda s: s.group)]


def next_round_size(need: int, informative: int, drawn: int, share: int) -> int:
    """Prompts for the next round: `need` divided by the informative rate seen so far (so at
    least `need`), at most `share` (the full share while no informative group was seen)."""
    if informative == 0:
        return share
    return min(share, math.ceil(need * drawn / informative))


def collect_rollout(generate_round: GenerateRound, *, share: int, dynamic: bool, max_rounds: int,
                    first_draw: int = 0) -> Rollout:
    """This rank's samples of one step: `share` prompts in one generation, or, with `dynamic`,
    up to `max_rounds` generations keeping only informative groups until `share` are kept. A
    shortfall after the last round is filled with the latest all-equal groups (zero advantage
    under group-normalized estimators, as a step without dynamic sampling would hold them), so
    every rank trains exactly `share` groups. `first_draw`: the draw number of the first prompt
    drawn (each round draws its prompts in group order)."""
    if max_rounds < 1:
        raise ValueError(f"algo.max_sampling_rounds={max_rounds} must be >= 1")
    kept: List[tuple] = []  # (draw number, the group's samples)
    uninformative: List[tuple] = []
    surplus: List[int] = []  # draw numbers of informative groups beyond the share
    out = Rollout(samples=[], rounds=0)
    drawn = informative = 0
    while out.rounds < (max_rounds if dynamic else 1) and len(kept) < share:
        count = share if out.rounds == 0 else next_round_size(share - len(kept), informative, drawn, share)
        samples = generate_round(out.rounds, count)
        out.rounds += 1
        drawn += count
        out.generated += len(samples)
        out.reward_sum += sum(float(s.reward) for s in samples)
        out.length_sum += sum(model_tokens(s) for s in samples)  # episodes: environment tokens not counted
        for group in split_groups(samples):
            drew = first_draw + drawn - count + group[0].group  # group g is the round's g-th prompt
            if dynamic and not is_informative([s.reward for s in group]):
                uninformative.append((drew, group))
            elif len(kept) < share:
                informative += 1
                kept.append((drew, group))
            else:
                informative += 1
                out.surplus_groups += 1
                surplus.append(drew)
    out.kept_groups = len(kept)
    fill = share - len(kept)  # > 0 only when max_rounds ran out; round 0 drew `share` groups, so enough
    fillers = uninformative[max(0, len(uninformative) - fill):] if fill > 0 else []
    out.filler_groups = len(fillers)
    out.dropped_groups = len(uninformative) - len(fillers)
    out.samples = renumber([g for _, g in kept + fillers])
    out.drawn = drawn
    out.trained_draws = [d for d, _ in kept + fillers]
    out.dropped_draws = surplus + [d for d, _ in uninformative[:len(uninformative) - len(fillers)]]
    return out


def renumber(groups: Sequence[Sequence[Sample]]) -> List[Sample]:
    """Flatten groups with group ids 0..G-1 and sample indices 0..N-1 (the trainer's labels);
    samples already labelled so are kept as they are (identical objects)."""
    out: List[Sample] = []
    for g, group in enumerate(groups):
        for s in group:
            out.append(s if (s.group, s.index) == (g, len(out)) else dataclasses.replace(s, group=g, index=len(out)))
    return out
