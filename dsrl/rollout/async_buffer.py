"""Asynchronous rollouts with a staleness bound (`algo.off_policy_steps=k` with
`algo.async_schedule=clock|deterministic`).

The engine keeps generating while the trainer trains. Generation runs in chunks of
`rollout.chunk_tokens` tokens: each chunk is one engine call over every unfinished trajectory
(prompt plus the tokens so far; the prefix cache keeps the re-prefill short), so between two chunks
the engine holds no request and new weights load there: a push waits for the current chunk, loads,
and the next chunk continues every trajectory with the new weights. This is abort-and-continue at
fixed token counts, on vLLM's plain generate (the engine's `sleep(mode="keep")` pause has no way to
report where each request stood when it paused, and a pause by the clock cannot be replayed). Every
sampled token records the policy version (the trainer step whose weights sampled it); a trajectory
may span versions. Each chunk of each trajectory is sampled with its own seed, a function of (run
seed, rank, group, sample, chunk) alone.

Groups (one prompt, n samples) are admitted in order while fewer than a batch's worth are in flight
and the batch they would join (counting the groups ahead of them) is at most k versions ahead of the
engine's weights; a finished group is scored and joins the open batch (completion order: a long
group does not hold a batch back). A group whose oldest token is still more than k versions behind
the step that trains it (overtaken by later groups while the weights moved on) is dropped
(`algo.stale_groups=drop`, counted) or trained with its staleness logged (`keep`; the objective's
correction, TIS or the rollout log-probs as the old policy, weighs it). Completion order favours
short generations: under `drop` the long ones are the ones overtaken and dropped. `admission`
bounds staleness where it starts instead: group i joins batch i // B + 1 (admission order), and
is admitted only while that batch is at most k versions ahead of the engine's weights, so no group
is ever staler than k and none is dropped; a long group holds its batch (and the trainer) back.
Batch b is step b's rollout.

Two schedules:
- `clock`: a push loads as soon as the trainer has new weights (at the next chunk boundary);
- `deterministic`: the engine loads version v exactly when the generator closes batch v + k, and
  not before: the interleaving of chunks and pushes is a function of counts, so two runs with one
  seed generate the same tokens, and the trainer waits for the generator to ask for its weights.
  The admission rule then fills exactly the open batch, so each batch is sampled by one version
  (v for batch v + k + 1) and none is dropped; trajectories that span versions come with `clock`.

The buffer (admitted groups with their partial trajectories and versions, finished groups, closed
batches, the prompt stream's position) goes into every checkpoint as a snapshot taken between two
chunks (the engine lock). Only what a chunk can still change is copied: the groups in flight;
finished groups and closed batches are never modified again and are shared with the snapshot.
- `deterministic`: the snapshot is taken at every push, after the load, where the engine's prefix
  cache has just been dropped and nothing is in flight (a batch just closed), so it costs a few
  list copies; a point fixed by counts, so a run resumed from it is the uninterrupted run bit for bit.
- `clock`: the snapshot is taken when a checkpoint is written (`checkpoint_snapshot`), at the next
  chunk boundary; a resumed run trains no group twice and loses none (the interleaving after it
  depends on timing, as the uninterrupted run's does).
A snapshot the schedule cannot continue exactly (written after a step without a push, a stop by
TrainingDiverged; a finished run resumed with a larger trainer.total_steps; batch s + k still open)
is continued with one warning naming why (`AsyncBuffer.resume`): the engine holds the checkpoint's
weights, which sample every chunk until the schedule asks for the next push.

Each admission draws one prompt, so a group's admission index is its prompt's draw number in the
rank's stream: prompts.jsonl lists, per step, the numbers a batch trains and those dropped while it
was open; after a resume, the numbers of a snapshot's groups in flight are kept and new admissions
continue from its count, so over the whole history each number is trained or dropped once (the
groups still in flight when the run ends, in the last checkpoint's buffer, are neither).

`AsyncBuffer` is the state and its transitions (no threads, no engine); `AsyncGenerator` drives it
from a daemon thread. Nothing here is collective: each rank generates its own share."""
from __future__ import annotations

import collections
import copy
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Sequence

from dsrl.actor.batch import Sample

_SEED_MAX = 1 << 62


def chunk_seed(seed: int, rank: int, group: int, sample: int, chunk: int) -> int:
    """The seed of one chunk of one trajectory: a 62-bit function of its coordinates alone."""
    key = f"async:{seed}:{rank}:{group}:{sample}:{chunk}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % _SEED_MAX


@dataclass
class Trajectory:
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # sampling log-prob of each response token
    versions: list = field(default_factory=list)  # the policy version that sampled each response token
    finish_reason: str = ""  # "" while unfinished
    chunks: int = 0  # chunks run


@dataclass
class Group:
    # admission order on this rank (0, 1, ...): the prompt's draw number in this rank's prompt stream
    # (one draw per admission), its identity in prompts.jsonl; snapshotted with the groups in flight
    index: int
    prompt: object  # the data item the verifier scores against
    trajectories: List[Trajectory]
    rewards: List[float] = field(default_factory=list)
    texts: List[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(t.finish_reason for t in self.trajectories)

    @property
    def oldest_version(self) -> int:
        return min(v for t in self.trajectories for v in (t.versions or [0]))


@dataclass
class Batch:
    """One step's groups, in completion order, and the groups dropped while it was open."""
    index: int  # 1-based: the step that trains it
    groups: List[Group]
    dropped_ids: List[int] = field(default_factory=list)  # admission indices of the dropped groups
    dropped_prompts: tuple = ()  # their prompts, in the same order
    dropped_samples: int = 0
    dropped_reward_sum: float = 0.0
    dropped_length_sum: int = 0

    @property
    def dropped(self) -> int:
        return len(self.dropped_ids)


@dataclass
class AsyncBuffer:
    """The generator's state: counts, groups in flight, the open batch, closed batches waiting for
    the trainer, and the engine's weights version. Transitions are methods; a snapshot is a deep
    copy (`snapshot()`), which `state_dict()` returns."""
    groups_per_batch: int  # this rank's share of algo.rollout_batch_size
    n: int  # samples per group
    k: int  # algo.off_policy_steps
    total_batches: int  # trainer.total_steps: no group is admitted once that many batches closed
    drop_stale: bool = True  # algo.stale_groups=drop
    bind: bool = False  # algo.stale_groups=admission: group i joins batch i // groups_per_batch + 1
    admitted: int = 0
    closed: int = 0  # batches closed so far
    taken: int = 0  # batches handed to the trainer
    version: int = 0  # the trainer step whose weights the engine holds
    chunks: int = 0  # chunks run
    version_chunks: int = 0  # chunks the current version ran (reset at each push)
    version_tokens: int = 0  # tokens the current version sampled (reset at each push)
    active: List[Group] = field(default_factory=list)
    open_batch: List[Group] = field(default_factory=list)
    open_dropped: List[Group] = field(default_factory=list)
    waiting: List[Group] = field(default_factory=list)  # bind: finished groups of batches after the open one
    ready: Deque[Batch] = field(default_factory=collections.deque)
    prompt_state: Optional[tuple] = None  # the prompt RNG's state at the snapshot
    # deterministic after an inexact resume: the version the chunks need at least (the checkpoint's
    # weights serve every chunk until the schedule asks for a newer version); 0 otherwise
    floor: int = 0
    saved: Optional[dict] = None  # the last snapshot (state_dict returns it)

    # ------------------------------------------------------------------ schedule
    @property
    def done(self) -> bool:
        return self.closed >= self.total_batches

    @property
    def required_version(self) -> int:
        """deterministic: the version the engine must hold for the next chunk (batch v + k closed)."""
        return max(0, min(self.closed, self.total_batches) - self.k, self.floor)

    def may_admit(self) -> bool:
        """Admit a new group while fewer than a batch's worth are in flight and the batch it would
        join, counting the groups ahead of it (finished in the open batch, or in flight), is at
        most k versions ahead of the engine's weights. Under `deterministic` (version = closed - k)
        that admits exactly what fills the open batch: nothing is in flight when a batch closes."""
        if self.done or len(self.active) >= self.groups_per_batch:
            return False
        if self.bind:  # the batch this group joins, fixed now
            batch = self.admitted // self.groups_per_batch + 1
            return batch <= self.total_batches and batch - 1 - self.version <= self.k
        ahead = (len(self.open_batch) + len(self.active)) // self.groups_per_batch
        return self.closed + ahead - self.version <= self.k

    def admit(self, prompt, prompt_ids: Sequence[int]) -> Group:
        group = Group(self.admitted, prompt, [Trajectory(list(prompt_ids)) for _ in range(self.n)])
        self.active.append(group)
        self.admitted += 1
        return group

    # ------------------------------------------------------------------ chunks
    def live(self) -> List[tuple]:
        """(group, sample index, trajectory) of every unfinished trajectory, in admission order."""
        return [(g, j, t) for g in self.active for j, t in enumerate(g.trajectories) if not t.finish_reason]

    def extend(self, t: Trajectory, token_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str,
               max_tokens: int) -> None:
        """Append one chunk's tokens (sampled by `self.version`); finished at EOS/stop or at max_tokens."""
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"the engine returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
        t.response_ids += list(token_ids)
        t.logprobs += [float(x) for x in logprobs]
        t.versions += [self.version] * len(token_ids)
        t.chunks += 1
        self.version_tokens += len(token_ids)
        if finish_reason != "length" or len(t.response_ids) >= max_tokens:
            t.finish_reason = finish_reason

    def complete(self, group: Group) -> None:
        """A scored group leaves the flight: it joins the open batch, or is dropped as too stale
        for the step that would train it (bind: it joins the batch fixed at its admission, now or
        when that batch opens); a full open batch closes."""
        self.active.remove(group)
        if self.bind:
            if group.index // self.groups_per_batch == self.closed:
                self.open_batch.append(group)
            else:
                self.waiting.append(group)
        elif self.drop_stale and self.closed - group.oldest_version > self.k:
            self.open_dropped.append(group)
        else:
            self.open_batch.append(group)
        while len(self.open_batch) == self.groups_per_batch:
            self._close()

    def _close(self) -> None:
        dropped = self.open_dropped
        self.ready.append(Batch(self.closed + 1, self.open_batch, dropped_ids=[g.index for g in dropped],
                                dropped_prompts=tuple(g.prompt for g in dropped),
                                dropped_samples=sum(len(g.trajectories) for g in dropped),
                                dropped_reward_sum=sum(sum(g.rewards) for g in dropped),
                                dropped_length_sum=sum(len(t.response_ids) for g in dropped
                                                       for t in g.trajectories)))
        self.open_batch, self.open_dropped = [], []
        self.closed += 1
        # at the end, the groups in flight stay in the buffer (never trained by this run; a
        # resume with a larger trainer.total_steps continues them)
        if self.bind and not self.done:  # the finished groups of the batch that opens now join it
            joins = [g for g in self.waiting if g.index // self.groups_per_batch == self.closed]
            self.waiting = [g for g in self.waiting if g not in joins]
            self.open_batch = joins

    def take(self, step: int) -> Batch:
        batch = self.ready.popleft()
        if batch.index != step:
            raise RuntimeError(f"the asynchronous buffer holds batch {batch.index}, not step {step}'s")
        self.taken += 1
        return batch

    # ------------------------------------------------------------------ checkpoints
    _STATE = ("admitted", "closed", "taken", "version", "chunks", "version_chunks", "version_tokens", "active",
              "open_batch", "open_dropped", "waiting", "ready", "prompt_state", "floor")
    _DEFAULTS = {"floor": 0, "waiting": []}  # fields a checkpoint written before they existed lacks

    def snapshot(self, prompt_state) -> None:
        """The state as it stands (called between two chunks). The groups in flight are copied;
        finished groups and closed batches are never modified again, so they are shared."""
        self.prompt_state = prompt_state
        saved = {name: getattr(self, name) for name in self._STATE}
        saved["active"] = copy.deepcopy(self.active)
        for name in ("open_batch", "open_dropped", "waiting", "ready"):
            saved[name] = list(saved[name])
        saved["total_batches"] = self.total_batches  # not restored: says where the saved run would end
        self.saved = saved

    def state_dict(self) -> Optional[dict]:
        return self.saved

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is None:
            return
        for name in self._STATE:
            value = copy.deepcopy(state[name]) if name in state else self._DEFAULTS[name]
            setattr(self, name, collections.deque(value) if name == "ready" else value)
        self.saved = copy.deepcopy(state)

    def resume(self, step: int, *, deterministic: bool) -> Optional[str]:
        """After load_state_dict from the checkpoint of `step`, whose weights the engine gets: the
        generator continues from the snapshot. Returns None when the continuation is the
        uninterrupted run's (deterministic: bit for bit; clock: no group trained twice or lost),
        else why it is not (the run continues: the engine's weights serve every chunk until the
        schedule asks for the next push). Raises when the snapshot is not this step's."""
        if self.taken != step:
            raise RuntimeError(f"the checkpoint of step {step} holds the asynchronous buffer as it stood after "
                               f"step {self.taken}: it cannot be resumed")
        why = []
        if self.version != step:
            why.append(f"it was written after a step that pushed no weights (a stop by TrainingDiverged): tokens "
                       f"the uninterrupted schedule samples with version {self.version} are sampled with the "
                       f"checkpoint's weights, labelled version {step}")
            self.version = step
        saved_total = (self.saved or {}).get("total_batches", self.total_batches)
        if saved_total < self.total_batches and self.closed >= saved_total:
            why.append(f"its run had finished (trainer.total_steps={saved_total}, now {self.total_batches}): "
                       f"batches after {saved_total} are sampled with step {step}'s weights, where an "
                       f"uninterrupted {self.total_batches}-step run samples batch b with version b - "
                       f"{self.k} - 1; its groups in flight at the end continue")
        if deterministic and not self.done and max(0, min(self.closed, self.total_batches) - self.k) < self.version:
            if not why:
                why.append(f"its buffer was saved while batch {self.closed + 1} was open, which the schedule "
                           f"samples with version {max(0, self.closed + 1 - self.k - 1)}: the checkpoint's "
                           f"weights (version {self.version}) sample it")
            self.floor = max(self.floor, self.version)
        return "; ".join(why) or None


class AsyncGenerator:
    """Drives an AsyncBuffer from a daemon thread: admits groups, runs chunks on the worker, scores
    finished groups, closes batches. The trainer thread takes batches (`take`) and pushes weights
    through `push`, which holds the engine between chunks. An error in the thread is raised in the
    trainer's thread at its next `take` or `push`."""

    def __init__(self, buffer: AsyncBuffer, *, worker, draw_prompt: Callable[[], object],
                 prompt_ids_fn: Callable[[object], list], score: Callable[[List[str], object, Group], List[float]],
                 decode: Callable[[list], str], prompt_rng, deterministic: bool, chunk_tokens: int,
                 max_tokens: int, temperature: float, top_p: float, seed: int, rank: int,
                 max_model_len: int = 0):
        self.buffer, self.worker, self.draw_prompt, self.prompt_ids = buffer, worker, draw_prompt, prompt_ids_fn
        self.score, self.decode, self.prompt_rng = score, decode, prompt_rng
        self.deterministic, self.chunk_tokens, self.max_tokens = deterministic, int(chunk_tokens), int(max_tokens)
        self.temperature, self.top_p, self.seed, self.rank = temperature, top_p, seed, rank
        self.max_model_len = int(max_model_len)
        self.cond = threading.Condition()  # buffer counts and flags: the two threads wait on it
        self.engine = threading.Lock()  # one engine user at a time: a chunk, or a push
        self.error: Optional[BaseException] = None
        self.stopping = False
        self.thread: Optional[threading.Thread] = None
        self.generation_seconds = 0.0  # engine time of chunks since the last take

    # ------------------------------------------------------------------ the generator thread
    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._main, name=f"dsrl-async-rollout-rank{self.rank}", daemon=True)
            self.thread.start()

    def _blocked(self) -> bool:
        b = self.buffer
        if b.done:
            return False
        if self.deterministic and b.version < b.required_version:
            return True
        return not b.active and not b.may_admit()

    def _main(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stopping and self._blocked():
                        self.cond.wait()
                    if self.stopping or self.buffer.done:
                        return
                with self.engine:
                    self.run_chunk()
                with self.cond:
                    self.cond.notify_all()
        except BaseException as e:  # raised in the trainer's thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def run_chunk(self) -> None:
        """Admit what the bound allows, then one chunk over every unfinished trajectory; finished
        groups are scored and complete. Called with the engine held."""
        b = self.buffer
        if self.deterministic and b.version != b.required_version:
            raise RuntimeError(f"deterministic schedule: the engine holds version {b.version}, the chunk needs "
                               f"{b.required_version}")
        while b.may_admit():
            prompt = self.draw_prompt()
            b.admit(prompt, self.prompt_ids(prompt))
        live = b.live()
        t0 = time.perf_counter()
        by_budget: dict = {}
        for entry in live:  # one engine call per distinct token budget (the last chunk may be shorter)
            t = entry[2]
            budget = min(self.chunk_tokens, self.max_tokens - len(t.response_ids))
            if self.max_model_len:
                budget = min(budget, self.max_model_len - len(t.prompt_ids) - len(t.response_ids))
            by_budget.setdefault(budget, []).append(entry)
        for budget, entries in sorted(by_budget.items(), reverse=True):
            if budget <= 0:
                for _, _, t in entries:
                    t.finish_reason = "length"
                continue
            prompts = [t.prompt_ids + t.response_ids for _, _, t in entries]
            seeds = [chunk_seed(self.seed, self.rank, g.index, j, t.chunks) for g, j, t in entries]
            outs = self.worker.generate(prompts, n=1, temperature=self.temperature, top_p=self.top_p,
                                        max_tokens=budget, show_progress=False, seeds=seeds)
            for (_, _, t), group in zip(entries, outs):
                c = group[0]
                b.extend(t, c.token_ids, c.logprobs, c.finish_reason, self.max_tokens)
        b.chunks += 1
        b.version_chunks += 1
        self.generation_seconds += time.perf_counter() - t0
        for g in [g for g in b.active if g.finished]:
            if b.done:  # the last batch closed: what is still in flight is never trained
                break
            g.texts = [self.decode(t.response_ids) for t in g.trajectories]
            g.rewards = [float(r) for r in self.score(g.texts, g.prompt, g)]
            b.complete(g)

    # ------------------------------------------------------------------ the trainer's side
    def _raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            self.stopping = True
            error.add_note("(raised in the asynchronous rollout thread)")
            raise error

    def take(self, step: int) -> Batch:
        """Step `step`'s batch (waits for it to close)."""
        self.start()
        with self.cond:
            while not self.buffer.ready:
                self._raise_error()
                if self.thread is not None and not self.thread.is_alive():
                    raise RuntimeError(f"the asynchronous rollout thread ended before step {step}'s batch closed")
                self.cond.wait(timeout=1.0)
            return self.buffer.take(step)

    def push(self, step: int, push_fn: Callable[[], dict]) -> dict:
        """Load step `step`'s weights between two chunks (deterministic: once the generator asks for
        them, and snapshot the buffer there). Returns push_fn's metrics plus the engine's pause."""
        t0 = time.perf_counter()
        with self.cond:
            while (self.deterministic and self.buffer.required_version < step and not self.buffer.done
                   and self.thread is not None and self.thread.is_alive()):
                self._raise_error()
                self.cond.wait(timeout=1.0)
            self._raise_error()
        t1 = time.perf_counter()
        with self.engine:
            t2 = time.perf_counter()
            metrics = push_fn()
            b = self.buffer
            # what the outgoing version generated, complete now (no chunk runs between two versions)
            metrics["async/version_tokens"] = float(b.version_tokens)
            metrics["async/version_chunks"] = float(b.version_chunks)
            b.version, b.version_tokens, b.version_chunks = step, 0, 0
            if self.deterministic:  # a point fixed by counts, nothing in flight: cheap, and exact to resume from
                b.snapshot(self.prompt_rng.getstate())
            paused = time.perf_counter() - t2
        with self.cond:
            self.cond.notify_all()
        metrics["timing/push_wait"] = t2 - t0  # deterministic: until the generator asks; then the chunk's end
        metrics["timing/engine_pause"] = paused  # the engine held by the push (export, load, probe)
        return metrics

    def restore_prompt_rng(self) -> None:
        """After a restore: the prompt stream where the snapshot left it."""
        if self.buffer.prompt_state is not None:
            self.prompt_rng.setstate(self.buffer.prompt_state)

    def checkpoint_snapshot(self, step: int) -> float:
        """Before the checkpoint of `step` is written: deterministic, the snapshot of step `step`'s
        push when there was one; otherwise (clock; a step without a push, TrainingDiverged) the
        buffer as it stands at the next chunk boundary. Returns the seconds the engine was held."""
        saved = self.buffer.saved
        if self.deterministic and saved is not None and saved["taken"] == step and saved["version"] == step:
            return 0.0
        with self.engine:
            t0 = time.perf_counter()
            self.buffer.snapshot(self.prompt_rng.getstate())
            return time.perf_counter() - t0

    def stop(self, wait: bool = True) -> None:
        """End the thread at its next boundary; `wait`: join it (a run that ended; a failed run does
        not wait on an engine that may hang: the thread is a daemon, closing the engine ends it)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if wait and self.thread is not None:
            self.thread.join()
            self.thread = None


def batch_samples(batch: Batch) -> List[Sample]:
    """The batch's samples, groups numbered 0..G-1 in batch order, samples adjacent per group;
    extra["versions"]: the policy version of each response token."""
    out = []
    for g, group in enumerate(batch.groups):
        for t, reward, text in zip(group.trajectories, group.rewards, group.texts):
            out.append(Sample(prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids),
                              rollout_log_probs=list(t.logprobs), group=g, index=len(out), reward=reward,
                              finish_reason=t.finish_reason, text=text, extra={"versions": list(t.versions)}))
    return out
