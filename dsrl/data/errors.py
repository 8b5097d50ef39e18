"""Bad input data: one error type naming file and row, and the bookkeeping of `data.on_bad_row`.

A bad row either stops the run (`error`, the default) with a message naming the file, the row and
what is wrong, or is dropped and counted (`skip`): the count is logged once and kept on the
source (`skipped_rows`, reported as the metric data/skipped_rows).

DataError subclasses ConfigError so the CLI reports it the same way (one line, exit code 2, before
any model loads) instead of a traceback."""
from __future__ import annotations

import logging
from collections import Counter
from typing import List, Tuple

from dsrl.errors import ConfigError

log = logging.getLogger("dsrl")

ON_BAD_ROW = ("error", "skip")
# How many skipped rows a log line quotes in full (the rest are only counted by reason).
_QUOTED = 3


class DataError(ConfigError):
    """Bad input data; the message names the file and row (or the config key) at fault."""


class RowProblem(ValueError):
    """What is wrong with one row (no location; the reader adds file and row)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind  # short reason used for counting: "malformed JSON", "missing field" ...
        self.detail = detail


class BadRows:
    """Collects the bad rows of one source under one `on_bad_row` policy."""

    def __init__(self, on_bad_row: str = "error"):
        if on_bad_row not in ON_BAD_ROW:
            raise DataError(f"data.on_bad_row={on_bad_row!r} is not one of {list(ON_BAD_ROW)}")
        self.on_bad_row = on_bad_row
        self.rows: List[Tuple[str, str, str]] = []  # (where, kind, detail) of every skipped row

    def add(self, where: str, problem: RowProblem) -> None:
        """Raise (policy error) or record (policy skip) the bad row at `where` ("file:line 7")."""
        if self.on_bad_row == "error":
            raise DataError(f"{where}: {problem.detail} (set data.on_bad_row=skip to drop such rows and count them)")
        self.rows.append((where, problem.kind, problem.detail))

    def __len__(self) -> int:
        return len(self.rows)

    def by_kind(self) -> dict:
        return dict(Counter(kind for _, kind, _ in self.rows))

    def report(self, first: int, what: str) -> None:
        """Log, once (rank 0 of a multi-rank run), the rows skipped from index `first` on (e.g.
        by one loading pass)."""
        from dsrl.distributed.ranks import is_main_rank

        new = self.rows[first:]
        if not new or not is_main_rank():
            return
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(k for _, k, _ in new).items()))
        quoted = "; ".join(f"{w}: {d}" for w, _, d in new[:_QUOTED])
        more = f"; ... {len(new) - _QUOTED} more" if len(new) > _QUOTED else ""
        log.warning("data: skipped %d %s (%s; data.on_bad_row=skip): %s%s", len(new), what, kinds, quoted, more)
