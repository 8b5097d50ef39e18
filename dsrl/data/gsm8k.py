"""GSM8K from the files inside the installed `textarena==0.6.3` package
(`textarena/envs/ClassicalReasoningEvals/data/gsm8k/{train,test}.jsonl`, identical to the
official release: 7473 train / 1319 test). The package is located, never imported.
Train split -> training stream; test split -> eval set. Answer = the number after "####"."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

from dsrl.packaged import package_dirs
from dsrl.data.registry import RngLike, as_random, register_source
from dsrl.data.types import Prompt

DATA_SUBDIR = ("envs", "ClassicalReasoningEvals", "data")


def textarena_data_dir() -> Path:
    dirs = package_dirs("textarena", "textarena==0.6.3")
    for loc in dirs:
        d = loc.joinpath(*DATA_SUBDIR)
        if d.is_dir():
            return d
    raise FileNotFoundError(f"no {'/'.join(DATA_SUBDIR)} inside textarena ({dirs}); need textarena==0.6.3")


def parse_gsm8k_answer(solution: str) -> str:
    """Final answer after '####', commas removed ("1,080" -> "1080")."""
    if "####" not in solution:
        raise ValueError(f"no '####' in GSM8K solution: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()


@functools.lru_cache(maxsize=4)
def load_gsm8k_split(split: str, data_dir: Optional[str] = None) -> tuple:
    """Rows of one split as (question, answer, solution, idx) tuples."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split must be 'train' or 'test', got {split!r}")
    base = Path(data_dir) if data_dir else textarena_data_dir() / "gsm8k"
    rows = []
    with open(base / f"{split}.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            r = json.loads(line)
            rows.append((r["question"].strip(), parse_gsm8k_answer(r["answer"]), r["answer"],
                         int(r.get("idx", i))))
    return tuple(rows)


@register_source("gsm8k")
class GSM8KSource:
    default_verifier = "gsm8k"
    instruction = "Solve the problem step by step. End with the final answer as a number."

    def __init__(self, data_dir: Optional[str] = None, instruction: Optional[str] = None):
        self.data_dir = data_dir
        if instruction is not None:
            self.instruction = instruction

    @property
    def train_rows(self) -> tuple:
        return load_gsm8k_split("train", self.data_dir)

    @property
    def test_rows(self) -> tuple:
        return load_gsm8k_split("test", self.data_dir)

    def _prompt(self, row: tuple, split: str) -> Prompt:
        question, answer, solution, idx = row
        content = f"{question}\n{self.instruction}" if self.instruction else question
        return Prompt(messages=({"role": "user", "content": content},), answer=answer,
                      meta={"task": "gsm8k", "id": f"gsm8k:{split}:{idx}", "split": split,
                            "index": idx, "question": question})

    def sample_train(self, n: int, rng: RngLike) -> list[Prompt]:
        rng = as_random(rng)
        rows = self.train_rows
        if n <= len(rows):
            idx = rng.sample(range(len(rows)), n)  # no repeats within one draw
        else:
            idx = [rng.randrange(len(rows)) for _ in range(n)]
        return [self._prompt(rows[i], "train") for i in idx]

    def eval_set(self, n: int) -> list[Prompt]:
        return [self._prompt(r, "test") for r in self.test_rows[:n]]

    def eval_pool_size(self) -> int:
        return len(self.test_rows)

    def __repr__(self) -> str:
        return "GSM8KSource()"
