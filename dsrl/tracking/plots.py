"""A run at a glance: reward (+ eval accuracy) and per-phase step timings.

Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch),
so it is safe on headless machines and inside processes that use other
backends. Every key is optional: a panel whose data is missing says so.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

__all__ = ["plot_run", "TIMING_PHASES"]

# fixed colour per phase so plots of different runs read the same way
_PHASE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray")

TIMING_PHASES: Sequence[str] = (
    "timing/rollout",
    "timing/old_logprobs",
    "timing/ref_logprobs",
    "timing/critic_values",  # algo.advantage_estimator=gae
    "timing/critic_train",
    "timing/train",
    "timing/weight_sync",
)


def _value(row: Mapping[str, Any], key: str) -> Optional[float]:
    v = row.get(key)
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _series(rows: Sequence[Mapping[str, Any]], steps: Sequence[float], key: str):
    """(xs, ys) over rows where ``key`` has a finite value."""
    xs, ys = [], []
    for x, row in zip(steps, rows):
        v = _value(row, key)
        if v is not None:
            xs.append(x)
            ys.append(v)
    return xs, ys


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_run(history: Sequence[Mapping[str, Any]], out_png: "str | os.PathLike[str]",
             *, title: Optional[str] = None) -> Path:
    """Write a two-panel PNG for ``history`` (a list of per-step metric dicts).

    Top: ``reward/mean`` per step, ``eval/accuracy`` points where present.
    Bottom: stacked per-phase timings (``timing/rollout`` ... ``timing/weight_sync``,
    a missing phase counting as 0 s) and the ``timing/step`` line.
    Rows without a ``step`` key are placed at their index. Returns the path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows: List[Mapping[str, Any]] = [r for r in history if isinstance(r, Mapping)]
    steps = [(_value(r, "step") if _value(r, "step") is not None else float(i))
             for i, r in enumerate(rows)]
    order = sorted(range(len(rows)), key=lambda i: steps[i])
    rows = [rows[i] for i in order]
    steps = [steps[i] for i in order]

    fig = Figure(figsize=(10, 7), dpi=100)
    FigureCanvasAgg(fig)
    ax_r, ax_t = fig.subplots(2, 1, sharex=True)

    # --- reward / eval accuracy -------------------------------------------
    xs, ys = _series(rows, steps, "reward/mean")
    ex, ey = _series(rows, steps, "eval/accuracy")
    if xs:
        ax_r.plot(xs, ys, color="tab:blue", marker="." if len(xs) < 50 else None,
                  label="reward/mean")
    if ex:
        ax_r.scatter(ex, ey, color="tab:orange", marker="o", zorder=3, label="eval/accuracy")
    if xs or ex:
        ax_r.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        _no_data(ax_r, "no reward/mean or eval/accuracy")
    ax_r.set_ylabel("reward / accuracy")
    ax_r.grid(True, alpha=0.3)

    # --- timings -----------------------------------------------------------
    phases = [k for k in TIMING_PHASES if any(_value(r, k) is not None for r in rows)]
    tx = [x for x, r in zip(steps, rows) if any(_value(r, k) is not None for k in phases)]
    trows = [r for r in rows if any(_value(r, k) is not None for k in phases)]
    if phases and tx:
        stacks = [[_value(r, k) or 0.0 for r in trows] for k in phases]
        labels = [k.split("/", 1)[1] for k in phases]
        colors = [_PHASE_COLORS[TIMING_PHASES.index(k)] for k in phases]
        if len(tx) == 1:  # stackplot needs two points to draw an area
            bottom = 0.0
            for label, col, color in zip(labels, stacks, colors):
                ax_t.bar(tx, col, bottom=bottom, width=0.6, label=label, color=color)
                bottom += col[0]
        else:
            ax_t.stackplot(tx, *stacks, labels=labels, colors=colors, alpha=0.8)
    sx, sy = _series(rows, steps, "timing/step")
    if sx:
        ax_t.plot(sx, sy, color="black", linewidth=1.5, marker="." if len(sx) < 50 else None,
                  label="step (total)")
    if phases or sx:
        ax_t.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        ax_t.set_ylim(bottom=0.0)
    else:
        _no_data(ax_t, "no timing/* metrics")
    ax_t.set_ylabel("seconds")
    ax_t.set_xlabel("step")
    ax_t.grid(True, alpha=0.3)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
