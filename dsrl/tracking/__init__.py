"""Run tracking: the console (dsrl lines + library warnings; the rest to run.log), rank-0
progress bars, metrics (jsonl + TensorBoard + W&B), phase timers, plots."""

from dsrl.tracking.console import setup_console
from dsrl.tracking.metrics import MetricsLogger, format_summary
from dsrl.tracking.progress import microbatch_bar, microbatch_desc, progress
from dsrl.tracking.timer import PhaseTimer

__all__ = ["MetricsLogger", "format_summary", "microbatch_bar", "microbatch_desc", "progress",
           "PhaseTimer", "plot_run", "setup_console"]


def __getattr__(name):  # matplotlib is imported only when plotting is used
    if name == "plot_run":
        from dsrl.tracking.plots import plot_run

        return plot_run
    raise AttributeError(f"module 'dsrl.tracking' has no attribute {name!r}")
