"""Rank-resolution tests drive ranks through the launcher's environment variables. Other test
modules initialise torch.distributed in this process (world of 1), which would take precedence;
hide it here. The real multi-rank checks run in spawned processes."""
import pytest

from dsrl.distributed import ranks


@pytest.fixture(autouse=True)
def _no_in_process_group(monkeypatch):
    monkeypatch.setattr(ranks, "_dist_initialized", lambda: False)
