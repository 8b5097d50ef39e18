"""A per-step JSON-lines file of the run folder (``metrics.jsonl``, ``prompts.jsonl``): one JSON
object per row, appended and flushed as the run logs it, written by the main rank only. Its rows
so far (``history``) go into each checkpoint; a resume rewrites the file to hold exactly the
checkpoint's rows, so the rows a crashed run wrote after its last checkpoint are replaced by the
resumed run's and each step appears once."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

__all__ = ["JsonlLog"]


class JsonlLog:
    def __init__(self, path: "str | os.PathLike[str]", *, enabled: bool) -> None:
        """``enabled`` False (every rank but the main one): no file, no rows kept."""
        self.path = Path(path)
        self.enabled = bool(enabled)
        self.history: List[Dict[str, Any]] = []
        self._file = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def append(self, record: Mapping[str, Any]) -> None:
        """Write ``record`` (strict JSON: no NaN) as one line, flushed, and keep it in ``history``."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"{self.path.name}: a row logged after close()")
        line = json.dumps(dict(record), allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()
        self.history.append(dict(record))

    def rewrite(self, history: Sequence[Mapping[str, Any]]) -> None:
        """A resume: ``history`` (the checkpoint's rows) becomes the rows so far, and the file holds
        exactly those (on every rank ``history`` is kept; only the main rank has a file)."""
        self.history = [dict(r) for r in history]
        if not self.enabled:
            return
        if self._file is not None:
            self._file.close()
        with open(self.path, "w", encoding="utf-8") as f:
            for record in self.history:
                f.write(json.dumps(record, allow_nan=False) + "\n")
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
