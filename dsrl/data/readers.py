"""Reading the user's files with the `datasets` library, row by row, each row with its location.

    for where, record in read_rows("jsonl", "data/train.jsonl"): ...   # record: dict or RowProblem

- jsonl: datasets' `text` builder gives the file's lines (universal newlines), each decoded here
  with `json.loads`. Why not the `json` builder: one bad line fails a whole file there, without a
  line number, and mixed-type columns are coerced or re-encoded; here every line is its own row,
  named by its 1-based line number, and a bad one can be skipped.
- parquet: datasets' `parquet` builder, rows named by 1-based row number.
- hf: a folder written by `save_to_disk` (`load_from_disk`): a Dataset, or a DatasetDict whose
  split is chosen by name.
Any failure to read a file becomes a DataError naming it; a bad row becomes a RowProblem."""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Iterator, List, Optional, Tuple

from dsrl.data.errors import DataError, RowProblem

# File name endings a folder is scanned for, per format.
EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
FORMATS = ("jsonl", "parquet", "hf")
_GLOB_CHARS = set("*?[")


@contextlib.contextmanager
def quiet_datasets():
    """No "Generating train split" bars or INFO lines from datasets while loading."""
    from datasets.utils import logging as dlog

    bars, level = dlog.is_progress_bar_enabled(), dlog.get_verbosity()
    dlog.disable_progress_bar()
    dlog.set_verbosity(dlog.ERROR)
    try:
        yield
    finally:
        dlog.set_verbosity(level)
        if bars:
            dlog.enable_progress_bar()


def resolve_files(fmt: str, path: str, key: str) -> List[str]:
    """`path` (a file, a glob or a folder) -> the sorted files it names; DataError naming `key`
    when it names none. For `hf` the folder itself."""
    if not isinstance(path, str) or not path.strip():
        raise DataError(f"{key} is required for data.name={fmt}: a file, a glob or a folder")
    full = os.path.expanduser(path)
    if fmt == "hf":
        hf_layout(full, key)
        return [full]
    if _GLOB_CHARS & set(full):
        files = sorted(f for f in glob.glob(full, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{key}={path!r}: no file matches this pattern")
        return files
    if os.path.isdir(full):
        exts = EXTENSIONS[fmt]
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(full) for f in names if f.endswith(exts))
        if not files:
            raise DataError(f"{key}={path!r}: the folder holds no {' or '.join('*' + e for e in exts)} file")
        return files
    if os.path.isfile(full):
        return [full]
    raise DataError(f"{key}={path!r}: no such file or folder")


def hf_layout(folder: str, key: str) -> Optional[List[str]]:
    """The split names of a save_to_disk folder holding a DatasetDict, None for a single Dataset;
    DataError naming `key` when the folder is neither."""
    if not isinstance(folder, str) or not folder.strip():
        raise DataError(f"{key} is required for data.name=hf: a folder written by save_to_disk")
    folder = os.path.expanduser(folder)
    if not os.path.isdir(folder):
        raise DataError(f"{key}={folder!r}: no such folder (data.name=hf reads a folder written by save_to_disk)")
    dict_file = os.path.join(folder, "dataset_dict.json")
    if os.path.isfile(dict_file):
        try:
            with open(dict_file, encoding="utf-8") as f:
                splits = json.load(f)["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{key}={folder!r}: unreadable dataset_dict.json: {e}") from e
        return [str(s) for s in splits]
    if os.path.isfile(os.path.join(folder, "state.json")):
        return None
    raise DataError(f"{key}={folder!r}: not a folder written by datasets' save_to_disk "
                    "(no dataset_dict.json or state.json)")


def _caused_by(e: BaseException, kind: type) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _load(builder: str, file: str, **kwargs: Any):
    import datasets
    from datasets import load_dataset

    # A local file needs no network, but `datasets` pings the Hub to count a download of the packaged
    # builder on every load; without a network each ping waits out its 3 s timeout (a fuzz test of 200
    # files took minutes). Switched off for this call only.
    saved = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        with quiet_datasets():
            return load_dataset(builder, data_files={"train": [file]}, split="train", **kwargs)
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = saved


def _bad_utf8_lines(file: str) -> set:
    """1-based numbers of the lines holding bytes that are not UTF-8 (same line splitting as
    datasets' text builder: universal newlines). Only run after a decode failure, to name them."""
    bad = set()
    with open(file, encoding="utf-8", errors="surrogateescape") as f:
        for n, line in enumerate(f, 1):
            if any("\udc80" <= ch <= "\udcff" for ch in line):
                bad.add(n)
    return bad


def _jsonl_lines(file: str) -> Tuple[List[str], set]:
    """The lines of `file` read by datasets, and the line numbers that are not valid UTF-8."""
    try:
        return list(_load("text", file)["text"]), set()
    except Exception as e:  # noqa: BLE001 - every read failure is reported naming the file
        if not _caused_by(e, UnicodeDecodeError):
            raise DataError(f"{file}: cannot be read as a text file: {e}") from e
    bad = _bad_utf8_lines(file)
    try:
        return list(_load("text", file, encoding_errors="replace")["text"]), bad
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{file}: cannot be read as a text file: {e}") from e


def read_jsonl(file: str) -> Iterator[Tuple[str, int, Any]]:
    """(where, line number, record or RowProblem) for every non-blank line of a JSON-lines file."""
    lines, bad_utf8 = _jsonl_lines(file)
    for n, line in enumerate(lines, 1):
        where = f"{file}, line {n}"
        if n == 1:
            line = line.lstrip("\ufeff")  # a UTF-8 byte-order mark is not part of the JSON
        if not line.strip():
            continue
        if n in bad_utf8:
            yield where, n, RowProblem("not valid UTF-8", "the line holds bytes that are not valid UTF-8")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:  # its own "line 1" would be the line's, not the file's
            yield where, n, RowProblem("malformed JSON", f"malformed JSON at column {e.colno}: {e.msg}")
            continue
        except (ValueError, RecursionError) as e:  # e.g. an integer too long, nesting too deep
            yield where, n, RowProblem("malformed JSON", f"malformed JSON: {_short(e)}")
            continue
        yield where, n, record


def _short(e: BaseException, limit: int = 200) -> str:
    s = str(e) or type(e).__name__
    return s if len(s) <= limit else s[:limit] + "..."


def _table_rows(ds: Any, label: str, needed: List[Tuple[str, str]]) -> Iterator[Tuple[str, int, Any]]:
    columns = list(ds.column_names)
    for col, key in needed:
        if col not in columns:
            raise DataError(f"{label}: no column {col!r} ({key}); its columns: {columns}")
    for n, record in enumerate(ds.to_list(), 1):
        yield f"{label}, row {n}", n, record


def read_parquet(file: str, needed: List[Tuple[str, str]]) -> Iterator[Tuple[str, int, Any]]:
    try:
        ds = _load("parquet", file)
    except Exception as e:  # noqa: BLE001 - a file that is not parquet is named, not a traceback
        raise DataError(f"{file}: cannot be read as parquet: {_short(e)}") from e
    yield from _table_rows(ds, file, needed)


def read_hf(folder: str, split: Optional[str], key: str,
            needed: List[Tuple[str, str]]) -> Iterator[Tuple[str, int, Any]]:
    """Rows of a save_to_disk folder; `split` picks the split of a DatasetDict (config `key`)."""
    from datasets import load_from_disk

    splits = hf_layout(folder, key)
    if splits is not None and split not in splits:
        raise DataError(f"{key}: split {split!r} is not in {folder!r}; its splits: {splits}")
    try:
        with quiet_datasets():
            ds = load_from_disk(folder)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{folder}: cannot be loaded with datasets.load_from_disk: {_short(e)}") from e
    label = folder
    if splits is not None:
        ds, label = ds[split], f"{folder} [split {split}]"
    yield from _table_rows(ds, label, needed)
