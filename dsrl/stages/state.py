"""The loop's state that must survive a crash, in one object: what a checkpoint's rank file holds
besides the RNGs, and what a resume restores. A field added here is saved and restored without
another line (`state_dict` walks the fields; tests/trainer/test_loop_state.py holds the list)."""
from __future__ import annotations

import dataclasses
import random
from typing import Optional

from dsrl.actor.nonfinite import SkipCounter
from dsrl.rollout.async_buffer import AsyncBuffer
from dsrl.rollout.overlap import BackgroundRollout
from dsrl.rollout.weight_sync import SyncSchedule


@dataclasses.dataclass
class LoopState:
    # The prompt stream of this rank (data.seed * 1000 + rank).
    prompt_rng: random.Random
    # Non-finite optimizer steps of the actor and of the critic (gae), counted apart.
    skips: SkipCounter
    critic_skips: SkipCounter
    # algo.off_policy_steps=1: the next step's rollout, generated in the background; a finished one
    # is checkpointed so that resume trains it as the uninterrupted run would.
    next_rollout: BackgroundRollout
    # The step whose weights the rollout engine holds (0: the initial ones).
    weights_step: int = 0
    # The weight sync's probe schedule (pushes counted, checks run, the probe sequences).
    sync: SyncSchedule = dataclasses.field(default_factory=SyncSchedule)
    # algo.async_schedule clock|deterministic: the asynchronous buffer (groups in flight with their
    # partial trajectories and versions, finished groups, closed batches, the prompt stream's
    # position), as snapshotted at the last push; None for the other loops.
    async_buffer: Optional[AsyncBuffer] = None
    # Training prompts this rank has drawn from prompt_rng (the next one's draw number; each prompt's
    # identity in prompts.jsonl). The asynchronous schedules number their draws in the buffer
    # instead (a group's admission index), snapshotted with the stream's position.
    prompts_drawn: int = 0

    @classmethod
    def fresh(cls, *, seed: int, rank: int, max_skipped_steps: int,
              async_buffer: Optional[AsyncBuffer] = None) -> "LoopState":
        return cls(prompt_rng=random.Random(seed * 1000 + rank), skips=SkipCounter(max_skipped_steps),
                   critic_skips=SkipCounter(max_skipped_steps), next_rollout=BackgroundRollout(),
                   async_buffer=async_buffer)

    def state_dict(self) -> dict:
        """Every field, as plain data (a running background rollout is not state: only a finished one)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, random.Random):
                value = value.getstate()
            elif isinstance(value, SkipCounter):
                value = value.state_dict()
            elif isinstance(value, BackgroundRollout):
                held = value.finished_value()
                value = None if held is None else (value.step, held)
            elif isinstance(value, SyncSchedule):
                value = dataclasses.asdict(value)
            elif isinstance(value, AsyncBuffer):
                value = value.state_dict()
            out[f.name] = value
        return out

    def load_state_dict(self, state: dict) -> list:
        """The inverse of state_dict. A field a checkpoint lacks (written before the field existed)
        keeps its fresh value, and says so in `missing` (returned)."""
        missing = []
        for f in dataclasses.fields(self):
            if f.name not in state:
                missing.append(f.name)
                continue
            value, current = state[f.name], getattr(self, f.name)
            if isinstance(current, random.Random):
                current.setstate(value)
            elif isinstance(current, SkipCounter):
                current.load_state_dict(value)
            elif isinstance(current, BackgroundRollout):
                if value is not None:
                    current.preload(*value)
            elif isinstance(current, SyncSchedule):  # in place: the weight sync holds this object
                for k, v in value.items():
                    setattr(current, k, v)
            elif isinstance(current, AsyncBuffer):  # in place: the generator holds this object
                current.load_state_dict(value)
            elif f.name == "async_buffer":
                if value is not None:
                    raise ValueError("the checkpoint holds an asynchronous buffer (algo.async_schedule clock or "
                                     "deterministic) but this run has none")
            else:
                setattr(self, f.name, value)
        return missing
