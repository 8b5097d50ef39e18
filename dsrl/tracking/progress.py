"""Progress bars that are drawn on global rank 0 only.

With N ranks each running the same loop, N interleaved bars are noise; like
slime's microbatch bars, only the main rank draws, every other rank gets a
disabled bar (all methods still work, nothing is printed). Bars are purely
cosmetic: they never change what the loop computes.

Descriptions follow slime's "<role> <pass>" form: ``"actor train"``,
``"actor forward"``, ``"ref forward"``, ``"teacher forward"``, ``"generate"``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import IO, Iterable, Iterator, Optional

from tqdm import tqdm

from dsrl.distributed.ranks import is_main_rank

__all__ = ["progress", "microbatch_bar", "microbatch_desc"]


def progress(
    iterable: Optional[Iterable] = None,
    *,
    total: Optional[int] = None,
    desc: str,
    unit: str = "it",
    leave: bool = False,
    enabled: bool = True,
    file: Optional[IO[str]] = None,
) -> tqdm:
    """A tqdm bar over ``iterable`` (or a manual one when ``iterable`` is None).

    The bar is disabled (prints nothing) unless this process is global rank 0
    and ``enabled`` is true. ``file`` defaults to ``sys.stderr`` at call time.
    """
    if total is None and iterable is not None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        leave=leave,
        dynamic_ncols=True,
        file=file,
        disable=not (enabled and is_main_rank()),
    )


def microbatch_desc(role: str, kind: str) -> str:
    """slime-style description: ``microbatch_desc("ref_", "forward") == "ref forward"``."""
    role = (role or "actor").rstrip("_")
    return f"{role} {kind}"


@contextmanager
def microbatch_bar(
    total: int,
    desc: str,
    *,
    enabled: bool = True,
    unit: str = "microbatch",
    file: Optional[IO[str]] = None,
) -> Iterator[tqdm]:
    """A rank-0 bar counting microbatches; call ``bar.update(1)`` per microbatch.

    The bar is closed (and, being ``leave=False``, erased) on exit, also when
    the body raises.
    """
    if total < 0:
        raise ValueError(f"microbatch_bar total must be >= 0, got {total}")
    bar = progress(total=total, desc=desc, unit=unit, leave=False, enabled=enabled, file=file)
    try:
        yield bar
    finally:
        bar.close()
