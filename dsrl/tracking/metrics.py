"""Per-step metrics: ``metrics.jsonl``, TensorBoard scalars, in-memory history.

Only the main rank (global rank 0) writes anything. On every other rank a
``MetricsLogger`` is a no-op: no directory, no file, no TensorBoard writer,
empty history. Metrics are expected to be already reduced across ranks.

``metrics.jsonl`` holds one JSON object per ``log`` call:
``{"step": 3, "reward/mean": 0.41, "timing/step": 2.7, ...}``. Every value is
a float; NaN and +/-inf are written as ``null`` (strict JSON) with a warning.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from dsrl.distributed.ranks import is_main_rank

__all__ = ["MetricsLogger", "format_summary", "SUMMARY_KEYS"]

# (key, label, unit) shown by ``summary_line``, in this order, when present.
SUMMARY_KEYS: Sequence[tuple[str, str, str]] = (
    ("reward/mean", "reward", ""),
    ("eval/accuracy", "eval_acc", ""),
    ("response_length/mean", "resp_len", ""),
    ("train/loss", "loss", ""),
    ("train/grad_norm", "grad_norm", ""),
    ("train/kl", "kl", ""),
    ("train/entropy", "entropy", ""),
    ("train/clip_frac", "clip_frac", ""),
    ("rollout/logprob_diff", "lp_diff", ""),
    ("timing/step", "step_time", "s"),
)

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    # 0-d / single-element tensors and numpy arrays; anything else is an error.
    item = getattr(value, "item", None)
    if callable(item):
        try:
            out = item()
        except (ValueError, RuntimeError) as exc:
            raise TypeError(f"metric {key!r}: expected a scalar, got {type(value).__name__} "
                            f"with more than one element") from exc
        if isinstance(out, numbers.Real):
            return float(out)
    raise TypeError(f"metric {key!r}: expected a real number, got {type(value).__name__}")


def _fmt_value(value: Optional[float], unit: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "nan"
    mag = abs(value)
    if mag != 0.0 and (mag < 1e-3 or mag >= 1e5):
        text = f"{value:.2e}"
    else:
        text = f"{value:.4g}"
    return text + unit


def format_summary(
    step: int,
    metrics: Mapping[str, Optional[float]],
    keys: Optional[Iterable[tuple[str, str, str]]] = None,
) -> str:
    """One compact line, e.g. ``step 12 | reward 0.431 | grad_norm 0.87 | step_time 3.21s``.

    Only keys present in ``metrics`` are shown; missing ones are skipped.
    """
    parts = [f"step {int(step)}"]
    for key, label, unit in (SUMMARY_KEYS if keys is None else keys):
        if key in metrics:
            parts.append(f"{label} {_fmt_value(metrics[key], unit)}")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(
        self,
        run_dir: "str | os.PathLike[str]",
        *,
        tensorboard: bool = True,
        enabled: Optional[bool] = None,
    ) -> None:
        """``enabled`` defaults to ``is_main_rank()`` evaluated now."""
        self.run_dir = Path(run_dir)
        self.enabled = is_main_rank() if enabled is None else bool(enabled)
        self.history: List[Dict[str, Any]] = []
        self._file = None
        self._writer = None
        self._closed = False
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir))

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILENAME

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / TENSORBOARD_DIRNAME

    def log(self, step: int, metrics: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """Record ``metrics`` for ``step``; returns the written record (None when disabled).

        Values must be real numbers (Python/numpy scalars or one-element tensors).
        Non-finite values become ``None`` in the record and ``null`` in the file.
        """
        if not self.enabled:
            return None
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        step = int(step)
        record: Dict[str, Any] = {"step": step}
        nonfinite: List[str] = []
        scalars: Dict[str, float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be strings, got {key!r}")
            if key == "step":
                raise ValueError("'step' is reserved; pass it as the step argument")
            val = _to_float(key, value)
            scalars[key] = val
            if math.isfinite(val):
                record[key] = val
            else:
                record[key] = None
                nonfinite.append(key)
        if nonfinite:
            warnings.warn(f"step {step}: non-finite metrics logged as null: {', '.join(nonfinite)}",
                          RuntimeWarning, stacklevel=2)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, val in scalars.items():
                self._writer.add_scalar(key, val, global_step=step)
            self._writer.flush()
        self.history.append(record)
        return record

    def summary_line(self, step: int, metrics: Mapping[str, Optional[float]]) -> str:
        """See ``format_summary``; works on every rank (it writes nothing)."""
        return format_summary(step, metrics)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
