"""The user's own prompt data: `data=jsonl`, `data=parquet`, `data=hf` (a save_to_disk folder).

    python -m dsrl.main +exp=grpo_reuse data=jsonl data.path=my/train.jsonl \
        data.prompt_key=question data.answer_key=answer reward.fn=gsm8k

Each row gives one prompt: `data.prompt_key` holds plain text or chat messages, `data.answer_key`
the reference answer the verifier (`reward.fn`) compares against. Held-out prompts come from
`data.eval_path` (or, for a DatasetDict folder, `data.eval_split`), else from a deterministic
split of about `data.eval_fraction` of the distinct prompts (by a fixed hash of the prompt: a
prompt's side never depends on the seed, the order or the other rows; duplicates fall on the
same side, so train and eval never share a prompt).

Bad rows (malformed JSON, missing field, wrong type, empty prompt, and once the tokenizer is
there, over-long prompt) raise a DataError naming file and row, or with `data.on_bad_row=skip`
are dropped, counted (`skipped_rows`) and logged once. Nothing is ever truncated."""
from __future__ import annotations

import abc
import hashlib
import json
import logging
from typing import Any, Callable, List, Optional

from dsrl.data.errors import ON_BAD_ROW, BadRows, DataError, RowProblem
from dsrl.data.readers import hf_layout, read_hf, read_jsonl, read_parquet, resolve_files
from dsrl.data.registry import RngLike, as_random, register_source
from dsrl.data.rows import record_to_prompt
from dsrl.data.types import Prompt
from dsrl.distributed.ranks import is_main_rank

log = logging.getLogger("dsrl")

DEFAULT_EVAL_FRACTION = 0.1
_SALT = b"dsrl-file-split-v1"


def prompt_hash(prompt: Prompt) -> float:
    """A fixed number in [0, 1) for the prompt's messages (same text, same number)."""
    key = json.dumps(prompt.messages, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(_SALT + key, digest_size=8).digest(), "big") / 2**64


def split_by_hash(prompts: List[Prompt], fraction: float) -> tuple:
    """(train, eval): prompts whose hash is below `fraction` are held out. With two or more
    distinct prompts, each side gets at least one; file order is kept on both sides."""
    hashes = [prompt_hash(p) for p in prompts]
    held = {h for h in hashes if h < fraction}
    distinct = sorted(set(hashes))
    if not held and len(distinct) >= 2:
        held = {distinct[0]}
    if distinct and len(held) == len(distinct):  # training keeps at least one prompt
        held.discard(distinct[-1])
    train = [p for p, h in zip(prompts, hashes) if h not in held]
    evals = [p for p, h in zip(prompts, hashes) if h in held]
    return train, evals


class FileSource(abc.ABC):
    """Prompts read from the user's files (see the module docstring). Subclasses set `format`."""

    format = ""
    # No verifier fits every data set: reward.fn names one (validate.py says so before any model).
    default_verifier = None

    def __init__(self, path: Optional[str] = None, prompt_key: str = "prompt", answer_key: Optional[str] = "answer",
                 eval_path: Optional[str] = None, eval_fraction: Optional[float] = None, split: str = "train",
                 eval_split: Optional[str] = None, on_bad_row: str = "error"):
        problems = self.check_config(dict(path=path, prompt_key=prompt_key, answer_key=answer_key,
                                          eval_path=eval_path, eval_fraction=eval_fraction, split=split,
                                          eval_split=eval_split, on_bad_row=on_bad_row))
        if eval_fraction is not None and not 0 < eval_fraction < 1:
            problems.append(f"data.eval_fraction={eval_fraction} must be in (0, 1)")
        if on_bad_row not in ON_BAD_ROW:
            problems.append(f"data.on_bad_row={on_bad_row!r} is not one of {list(ON_BAD_ROW)}")
        if problems:  # validate.py reports these before any model loads; a direct caller gets them here
            raise DataError("; ".join(problems))
        self.path, self.eval_path, self.split, self.eval_split = path, eval_path, split, eval_split
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.eval_fraction = DEFAULT_EVAL_FRACTION if eval_fraction is None else float(eval_fraction)
        self.bad = BadRows(on_bad_row)
        train = self._read(path, "data.path", split, "data.split", "train")
        if eval_path:
            evals = self._read(eval_path, "data.eval_path", eval_split or split, "data.eval_split", "eval")
        elif eval_split:
            evals = self._read(path, "data.path", eval_split, "data.eval_split", "eval")
        else:
            train, evals = split_by_hash(train, self.eval_fraction)
            for p in evals:
                p.meta["split"] = "eval"
        self.train, self.evals = train, evals
        self.bad.report(0, "bad row(s)")
        self._require_rows()
        if not is_main_rank():  # every rank reads the data; one says so
            return
        if not evals:
            log.warning("data: no held-out prompts (%s): greedy evaluation will score nothing", path)
        log.info("data: %d training / %d held-out prompts from %s%s", len(train), len(evals), path,
                 f" ({len(self.bad)} bad rows skipped)" if len(self.bad) else "")

    # ---------------------------------------------------------------- config
    @classmethod
    def check_config(cls, d: Any) -> List[str]:
        """Problems of this format's own `data` keys (paths exist, field names given, splits
        exist), each naming its key; validate.py runs this before any model loads (no row is read)."""
        get = d.get if isinstance(d, dict) else (lambda k, default=None: getattr(d, k, default))
        errors = []
        for key in ("path", "eval_path"):
            value = get(key)
            if key == "eval_path" and value is None:
                continue
            try:
                resolve_files(cls.format, value, f"data.{key}")
            except DataError as e:
                errors.append(str(e))
        pk, ak = get("prompt_key"), get("answer_key")
        if not isinstance(pk, str) or not pk:
            errors.append(f"data.prompt_key={pk!r} must name the field that holds the prompt")
        if ak is not None and (not isinstance(ak, str) or not ak):
            errors.append(f"data.answer_key={ak!r} must name the field that holds the answer (or be null)")
        errors += cls._check_splits(get)
        return errors

    @classmethod
    def _check_splits(cls, get: Callable) -> List[str]:
        if get("eval_split") is not None:
            return [f"data.eval_split={get('eval_split')!r}: only a data.name=hf DatasetDict folder has splits "
                    f"(data.name={cls.format}: use data.eval_path or data.eval_fraction)"]
        return []

    # ---------------------------------------------------------------- reading
    @abc.abstractmethod
    def _rows(self, file: str, split: str, split_key: str):
        """(where, row number, record) of every row of one file (jsonl / parquet / hf folder)."""

    def _needed(self) -> list:
        needed = [(self.prompt_key, "data.prompt_key")]
        if self.answer_key is not None:
            needed.append((self.answer_key, "data.answer_key"))
        return needed

    def _read(self, path: str, key: str, split: str, split_key: str, side: str) -> List[Prompt]:
        out = []
        for file in resolve_files(self.format, path, key):
            for where, n, record in self._rows(file, split, split_key):
                if isinstance(record, RowProblem):
                    self.bad.add(where, record)
                    continue
                meta = {"task": self.format, "id": where, "where": where, "file": file, "row": n, "split": side}
                try:
                    out.append(record_to_prompt(record, self.prompt_key, self.answer_key, meta))
                except RowProblem as problem:
                    self.bad.add(where, problem)
        return out

    def _require_rows(self) -> None:
        if not self.train:
            kinds = self.bad.by_kind()
            raise DataError(f"data.path={self.path!r}: no usable training rows"
                            + (f" ({len(self.bad)} bad rows skipped: {kinds})" if kinds else ""))

    # ---------------------------------------------------------------- lengths
    def check_prompt_lengths(self, count_tokens: Callable[[Prompt], int], limit: int, key: str) -> None:
        """Drop (skip) or refuse (error) prompts longer than `limit` tokens, as counted by
        `count_tokens` (the rollout's own encoding): a prompt is never truncated."""
        first = len(self.bad)
        for side in ("train", "evals"):
            kept = []
            for p in getattr(self, side):
                n = count_tokens(p)
                if n > limit:
                    self.bad.add(p.meta["where"], RowProblem(
                        "over-long prompt", f"prompt of {n} tokens is longer than {key}={limit} "
                                            "(prompts are never truncated)"))
                else:
                    kept.append(p)
            setattr(self, side, kept)
        self.bad.report(first, f"prompt(s) longer than {key}={limit} tokens")
        self._require_rows()

    # ---------------------------------------------------------------- PromptSource
    def sample_train(self, n: int, rng: RngLike) -> List[Prompt]:
        rng = as_random(rng)
        rows = self.train
        idx = rng.sample(range(len(rows)), n) if n <= len(rows) else [rng.randrange(len(rows)) for _ in range(n)]
        return [rows[i] for i in idx]

    def eval_set(self, n: int) -> List[Prompt]:
        return list(self.evals[:n])

    def eval_pool_size(self) -> int:
        return len(self.evals)

    @property
    def skipped_rows(self) -> int:
        """Rows dropped under data.on_bad_row=skip (reported as data/skipped_rows)."""
        return len(self.bad)

    def metrics(self) -> dict:
        return {"data/skipped_rows": float(self.skipped_rows)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r}, train={len(self.train)}, eval={len(self.evals)})"


@register_source("jsonl")
class JsonlSource(FileSource):
    """JSON-lines files (one object per line); rows are named by their 1-based line number."""

    format = "jsonl"

    def _rows(self, file, split, split_key):
        return read_jsonl(file)


@register_source("parquet")
class ParquetSource(FileSource):
    """Parquet files; rows are named by their 1-based row number."""

    format = "parquet"

    def _rows(self, file, split, split_key):
        return read_parquet(file, self._needed())


@register_source("hf")
class HFDiskSource(FileSource):
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`; a DatasetDict's
    training split is `data.split`, its held-out split `data.eval_split` (if set)."""

    format = "hf"

    def _rows(self, file, split, split_key):
        return read_hf(file, split, split_key, self._needed())

    @classmethod
    def _check_splits(cls, get: Callable) -> List[str]:
        eval_split = get("eval_split")
        checks = [("path", get("split"), "data.split")]
        if get("eval_path") is not None:  # held-out rows from eval_path: its eval_split, else data.split
            checks.append(("eval_path", eval_split or get("split"), "data.eval_split" if eval_split else "data.split"))
        elif eval_split is not None:  # held-out rows from another split of data.path
            checks.append(("path", eval_split, "data.eval_split"))
        errors = []
        for path_key, split, split_key in checks:
            try:
                splits = hf_layout(get(path_key), f"data.{path_key}")
            except DataError:
                continue  # a missing or unreadable folder is reported by check_config
            if splits is None:  # a single Dataset: data.split does not apply, an explicit eval_split is wrong
                if split_key == "data.eval_split":
                    errors.append(f"data.eval_split={split!r}: data.{path_key}={get(path_key)!r} holds a single "
                                  "Dataset, not a DatasetDict with splits")
            elif split not in splits:
                errors.append(f"{split_key}={split!r} is not a split of data.{path_key}={get(path_key)!r}; "
                              f"its splits: {splits}")
        return errors
