"""Per-step metrics: ``metrics.jsonl``, TensorBoard scalars, W&B (optional), in-memory history.

Only the main rank (global rank 0) writes anything. On every other rank a
``MetricsLogger`` is a no-op: no directory, no file, no TensorBoard writer,
empty history. Metrics are expected to be already reduced across ranks.

``metrics.jsonl`` holds one JSON object per ``log`` call:
``{"step": 3, "reward/mean": 0.41, "timing/step": 2.7, ...}``. Every value is
a float; NaN and +/-inf are written as ``null`` (strict JSON) with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from dsrl.distributed.ranks import is_main_rank
from dsrl.tracking.jsonl import JsonlLog

__all__ = ["MetricsLogger", "format_summary", "SUMMARY_KEYS"]

log = logging.getLogger("dsrl")

# (key, label, unit) shown by ``summary_line``, in this order, when present: the reward, the
# key training metrics, then the time of each phase (a skipped phase, 0.0 s, is left out).
SUMMARY_KEYS: Sequence[tuple[str, str, str]] = (
    ("reward/mean", "reward", ""),
    ("eval/accuracy", "eval_acc", ""),
    ("rollout/response_length", "resp_len", ""),
    ("train/loss", "loss", ""),
    ("train/pg_clipfrac", "clipfrac", ""),
    ("train/ppo_kl", "ppo_kl", ""),
    ("train/kl_loss", "kl_loss", ""),
    ("train/entropy", "entropy", ""),
    ("train/grad_norm", "grad_norm", ""),
    ("rollout/logprob_diff", "lp_diff", ""),
    ("timing/rollout", "rollout", "s"),
    ("timing/old_logprobs", "old_lp", "s"),
    ("timing/ref_logprobs", "ref_lp", "s"),
    ("timing/teacher_logprobs", "teacher_lp", "s"),
    ("timing/train", "train", "s"),
    ("timing/weight_sync", "sync", "s"),
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


def histograms(scalars: Mapping[str, float]) -> Dict[str, dict]:
    """Metrics named `NAME_hist/J` (J = 0, 1, ...: the weight of integer value J) as one histogram
    per NAME, in the arguments of TensorBoard's add_histogram_raw (buckets [J - 0.5, J + 0.5))."""
    groups: Dict[str, Dict[int, float]] = {}
    for key, val in scalars.items():
        head, sep, tail = key.rpartition("_hist/")
        if sep and tail.isdigit() and math.isfinite(val):
            groups.setdefault(head, {})[int(tail)] = float(val)
    out = {}
    for name, weights in groups.items():
        values = sorted(weights)
        counts = [weights[j] for j in values]
        num = sum(counts)
        if num <= 0:
            continue
        held = [j for j in values if weights[j] > 0]
        out[name] = {"min": float(held[0]), "max": float(held[-1]), "num": num,
                     "sum": sum(j * weights[j] for j in values), "sum_squares": sum(j * j * weights[j] for j in values),
                     "bucket_limits": [j + 0.5 for j in values], "bucket_counts": counts}
    return out


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
    """One compact line, e.g. ``step 12 | reward 0.431 | grad_norm 0.87 | rollout 1.2s | step_time 3.21s``.

    Only keys present in ``metrics`` are shown; missing ones are skipped, and so are phase
    timings of exactly 0.0 s (a pass that was skipped, e.g. the old-policy pass under reuse).
    """
    parts = [f"step {int(step)}"]
    for key, label, unit in (SUMMARY_KEYS if keys is None else keys):
        if key not in metrics:
            continue
        if key.startswith("timing/") and key != "timing/step" and metrics[key] == 0.0:
            continue  # a phase that did not run this step
        parts.append(f"{label} {_fmt_value(metrics[key], unit)}")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(
        self,
        run_dir: "str | os.PathLike[str]",
        *,
        tensorboard: bool = True,
        enabled: Optional[bool] = None,
        wandb: bool = False,
        wandb_project: str = "dsrl",
        wandb_mode: str = "auto",
        config: Optional[Mapping[str, Any]] = None,
        name: Optional[str] = None,
        quiet: bool = True,
    ) -> None:
        """``enabled`` defaults to ``is_main_rank()`` evaluated now. With ``wandb`` the same
        scalars also go to a W&B run (files under ``<run_dir>/wandb``, ``config`` attached).

        The TensorBoard writer and the W&B run start at ``open`` (the first ``log`` calls it), so
        that a ``restore`` before it continues the checkpoint's run in both."""
        self.run_dir = Path(run_dir)
        self.enabled = is_main_rank() if enabled is None else bool(enabled)
        self._rows = JsonlLog(self.metrics_path, enabled=self.enabled)  # metrics.jsonl and the history
        self._tensorboard = tensorboard
        self._writer = None
        self.wandb = None
        self._opened = False
        self._closed = False
        if not self.enabled:
            return
        if wandb:
            from dsrl.tracking.wandb_sink import WandbSink

            self.wandb = WandbSink(self.run_dir, project=wandb_project, mode=wandb_mode, config=config,
                                   name=name, quiet=quiet)

    @classmethod
    def from_config(cls, run_dir: "str | os.PathLike[str]", cfg: Any) -> "MetricsLogger":
        """Built from a typed dsrl ``Config`` (its ``logger`` section; the whole config goes to W&B)."""
        lg = cfg.logger
        return cls(run_dir, tensorboard=lg.tensorboard, wandb=lg.wandb, wandb_project=lg.wandb_project,
                   wandb_mode=lg.wandb_mode, config=dataclasses.asdict(cfg) if lg.wandb else None,
                   name=getattr(cfg, "name", None), quiet=not lg.verbose)

    @property
    def history(self) -> List[Dict[str, Any]]:
        """The records so far (this run's, after a restore's), one dict per logged step."""
        return self._rows.history

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILENAME

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / TENSORBOARD_DIRNAME

    @property
    def wandb_run_id(self) -> Optional[str]:
        """The id of the W&B run (what a checkpoint keeps for a resume to continue); None
        without W&B or before ``open``."""
        return None if self.wandb is None or self.wandb.run is None else self.wandb.run.id

    def open(self) -> None:
        """Start the TensorBoard writer and the W&B run of a new run (a no-op once started, by
        this, ``log`` or ``restore``)."""
        self._open(purge_step=None, wandb_run_id=None)

    def _open(self, *, purge_step: Optional[int], wandb_run_id: Optional[str]) -> None:
        """``purge_step``: TensorBoard hides this log folder's earlier events from that step on
        (a crashed run's steps after its checkpoint, redone now). ``wandb_run_id``: the W&B run
        to continue."""
        if not self.enabled or self._opened:
            return
        self._opened = True
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge_step)
        if self.wandb is not None:
            self.wandb.open(resume_id=wandb_run_id)
            log.info("W&B: %s run %s%s in %s (%s)", self.wandb.mode, self.wandb.run.id,
                     " (continued)" if wandb_run_id is not None else "", self.wandb.run_dir, self.wandb.reason)

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
        self.open()
        self._rows.append(record)
        if self._writer is not None:
            for key, val in scalars.items():
                self._writer.add_scalar(key, val, global_step=step)
            for name, buckets in histograms(scalars).items():
                self._writer.add_histogram_raw(name, global_step=step, **buckets)
            self._writer.flush()
        if self.wandb is not None:
            self.wandb.log(step, scalars)
        return record

    def restore(self, history: List[Dict[str, Any]], *, step: int, wandb_run_id: Optional[str]) -> None:
        """Continue a run from the checkpoint of ``step``: the history becomes the records saved
        with it, and ``metrics.jsonl`` is rewritten to hold exactly those (a crashed run may have
        logged steps after its last checkpoint; they are redone). TensorBoard drops the crashed
        run's events after ``step`` (``purge_step``); the W&B run ``wandb_run_id`` (None: a new
        run) is continued, and the restored records are not sent to it again (W&B ignores a step
        below the last it holds, so the crashed run's steps after ``step`` keep their values there:
        an exact resume logs the same ones, timings aside). Before the first ``log``."""
        if self._opened:
            raise RuntimeError("MetricsLogger.restore after the logger started (open or log)")
        self._rows.rewrite(history)
        if not self.enabled:
            return
        self._open(purge_step=step + 1, wandb_run_id=wandb_run_id)

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
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
        self._rows.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
