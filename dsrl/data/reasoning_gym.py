"""reasoning-gym's procedural tasks as a prompt source (`data=reasoning_gym`, reasoning-gym==0.1.25).

    data.tasks=[chain_sum, basic_arithmetic]
    data.knobs={chain_sum: {min_terms: 2, max_terms: 2}}   # create_dataset(name, size, seed, **knobs)

Each task is one `reasoning_gym.create_dataset(task, size=..., seed=data.seed, **knobs)`; its item i is
generated from `Random(seed + i)`, so the split is by item index and by question text:

- held out: per task, the first distinct questions of items 0, 1, 2, ... (data.num_eval shared out
  over the tasks, the first tasks taking one more when it does not divide);
- training: items past the last one the held-out scan read, drawn with the run's stream RNG, any
  whose question text is held out drawn again (small task spaces repeat: 1-digit sums have ~200
  distinct problems).

Same seed, same prompts: the held-out set depends on data.seed, data.num_eval, the tasks and their
knobs only; the training stream on those and the stream's RNG.

Each prompt keeps the item in its meta (`task`, `question`, `metadata`): the `reasoning_gym` verifier
(dsrl/reward/reasoning_gym.py) scores with the task's own scorer. Eval prompts carry the task's name
as their `split`, so the greedy eval reports accuracy per task (eval/accuracy[chain_sum], ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from dsrl.data.errors import DataError
from dsrl.data.registry import RngLike, as_random, register_source
from dsrl.data.types import Prompt

# Items of each task the training stream draws from (after the held-out scan's items).
TRAIN_WINDOW = 1_000_000
# Held-out scan: at most this many items read per wanted question (a tiny task space ends it early).
SCAN_FACTOR = 50
# Redraws of one training prompt whose question is held out before the task counts as exhausted.
MAX_REDRAWS = 1000
# Knobs dsrl sets itself (create_dataset's size and seed).
RESERVED_KNOBS = ("size", "seed")


def _registry() -> dict:
    """reasoning-gym's task registry {name: (dataset class, config dataclass)}; importing the
    package registers every task."""
    try:
        import reasoning_gym  # noqa: F401  (registers the tasks)
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise DataError(f"data.name=reasoning_gym needs the reasoning-gym package (pinned in "
                        f"launch/requirements.txt: reasoning-gym==0.1.25): {e}") from e
    return DATASETS


def task_names() -> list:
    return sorted(_registry())


def task_knobs(task: str) -> list:
    """The knobs task `task` takes (its config dataclass's fields, less size and seed)."""
    _, config_cls = _registry()[task]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_KNOBS]


def _plain(value: Any) -> Any:
    """OmegaConf containers (ListConfig of operators, ...) -> plain Python values."""
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return value


def config_errors(tasks: Sequence[Any], knobs: Optional[Mapping]) -> list:
    """Every problem with data.tasks / data.knobs, each naming the task and the knobs it takes."""
    errors = []
    tasks = list(_plain(tasks) or [])
    knobs = dict(_plain(knobs) or {})
    if not tasks:
        return ["data.tasks is empty: name one or more reasoning-gym tasks, e.g. data.tasks=[chain_sum,basic_arithmetic]"]
    registry = _registry()
    for t in tasks:
        if not isinstance(t, str) or t not in registry:
            errors.append(f"data.tasks: unknown reasoning-gym task {t!r}; the {len(registry)} tasks are: "
                          f"{', '.join(sorted(registry))}")
    if len(set(map(str, tasks))) != len(tasks):
        errors.append(f"data.tasks={tasks} names a task twice")
    for t, given in knobs.items():
        if t not in tasks:
            errors.append(f"data.knobs.{t}: {t!r} is not in data.tasks={tasks} (knobs are per listed task)")
            continue
        if t not in registry:
            continue
        if not isinstance(given, Mapping):
            errors.append(f"data.knobs.{t} must be a mapping of knob -> value, not {given!r}")
            continue
        takes = task_knobs(t)
        for k in given:
            if k in RESERVED_KNOBS:
                errors.append(f"data.knobs.{t}.{k}: set by dsrl (seed: data.seed; size: the held-out scan and "
                              f"training window); task {t!r} takes: {', '.join(takes)}")
            elif k not in takes:
                errors.append(f"data.knobs.{t}.{k}: task {t!r} has no knob {k!r}; it takes: {', '.join(takes)}")
        if not any(k in RESERVED_KNOBS or k not in takes for k in given):
            try:
                _make_dataset(t, dict(given), seed=0, size=1)
            except Exception as e:  # noqa: BLE001 - the task's own validate() (assertions, type errors)
                errors.append(f"data.knobs.{t}={dict(given)}: rejected by the task: {type(e).__name__}: {e}; "
                              f"it takes: {', '.join(takes)}")
    return errors


def _make_dataset(task: str, knobs: dict, seed: int, size: int) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **knobs)


@register_source("reasoning_gym")
class ReasoningGymSource:
    default_verifier = "reasoning_gym"
    # Appended to each question (after a blank line); "" = the question alone. Measured baseline of
    # SmolLM2-135M-Instruct with this instruction in docs/guides/environments.md.
    instruction = "Give only the final answer."

    def __init__(self, tasks: Sequence[str] = (), knobs: Optional[Mapping] = None, seed: int = 0,
                 num_eval: int = 100, instruction: Optional[str] = None):
        problems = config_errors(tasks, knobs)
        if problems:
            raise DataError("; ".join(problems))
        self.tasks = [str(t) for t in _plain(tasks)]
        self.knobs = {t: dict(_plain((knobs or {}).get(t, {}))) for t in self.tasks}
        self.seed = int(seed)
        self.num_eval = int(num_eval)
        if instruction is not None:
            self.instruction = instruction
        self._eval: Optional[dict] = None  # task -> (prompts, scanned item count, held-out questions)
        self._datasets: dict = {}

    @classmethod
    def check_config(cls, d) -> list:
        """data.tasks and data.knobs (run by validate.py before anything loads)."""
        try:
            return config_errors(d.tasks, d.knobs)
        except DataError as e:
            return [str(e)]

    # ---------------------------------------------------------------- items
    def _scan_limit(self, task: str) -> int:
        """Items the held-out scan may read for `task`."""
        want = self._eval_counts(self.num_eval)[self.tasks.index(task)]
        return max(want, 1) * SCAN_FACTOR

    def _dataset(self, task: str) -> Any:
        """The task's one dataset: the held-out scan's items, then the training window."""
        if task not in self._datasets:
            self._datasets[task] = _make_dataset(task, self.knobs[task], seed=self.seed,
                                                 size=self._scan_limit(task) + TRAIN_WINDOW)
        return self._datasets[task]

    def _prompt(self, task: str, index: int, item: Mapping, split: str) -> Prompt:
        question = str(item["question"])
        content = f"{question}\n\n{self.instruction}" if self.instruction else question
        return Prompt(messages=({"role": "user", "content": content},), answer=str(item["answer"]),
                      meta={"task": task, "id": f"{task}:{self.seed}:{index}", "index": index, "split": split,
                            "question": question, "metadata": item.get("metadata", {})})

    def _eval_counts(self, n: int) -> list:
        k, extra = divmod(n, len(self.tasks))
        return [k + (1 if i < extra else 0) for i in range(len(self.tasks))]

    def _held_out(self) -> dict:
        """Per task: the held-out prompts (the first distinct questions), the number of items the scan
        read (training starts past them) and the held-out question texts."""
        if self._eval is None:
            self._eval = {}
            for task, want in zip(self.tasks, self._eval_counts(self.num_eval)):
                limit = self._scan_limit(task)
                ds = self._dataset(task)
                prompts, seen, i = [], set(), 0
                while len(prompts) < want and i < limit:
                    item = ds[i]
                    if item["question"] not in seen:
                        seen.add(item["question"])
                        prompts.append(self._prompt(task, i, item, task))
                    i += 1
                if len(prompts) < want:
                    raise DataError(f"data.tasks: task {task!r} has only {len(prompts)} distinct "
                                    f"questions in its first {limit} items, fewer than the {want} held out for it "
                                    f"(data.num_eval={self.num_eval}); lower data.num_eval or widen its data.knobs")
                self._eval[task] = (prompts, i, frozenset(seen))
        return self._eval

    # ---------------------------------------------------------------- PromptSource
    def sample_train(self, n: int, rng: RngLike) -> list[Prompt]:
        rng = as_random(rng)
        held = self._held_out()
        out = []
        for _ in range(n):
            task = self.tasks[rng.randrange(len(self.tasks))]
            _, start, questions = held[task]
            ds = self._dataset(task)
            for _ in range(MAX_REDRAWS):
                index = start + rng.randrange(TRAIN_WINDOW)
                item = ds[index]
                if item["question"] not in questions:
                    out.append(self._prompt(task, index, item, "train"))
                    break
            else:
                raise DataError(f"data.tasks: task {task!r}: {MAX_REDRAWS} training draws in a row were held-out "
                                f"questions; its question space is too small for data.num_eval={self.num_eval} "
                                f"(lower it or widen data.knobs.{task})")
        return out

    def eval_set(self, n: int) -> list[Prompt]:
        if n > self.num_eval:
            raise DataError(f"eval_set({n}): the held-out set is data.num_eval={self.num_eval} prompts (the "
                            f"training stream excludes exactly those)")
        held = self._held_out()
        return [p for task, k in zip(self.tasks, self._eval_counts(n)) for p in held[task][0][:k]]

    def eval_pool_size(self) -> int:
        return self.num_eval

    def __repr__(self) -> str:
        return f"ReasoningGymSource(tasks={self.tasks}, knobs={self.knobs}, seed={self.seed})"
