"""Fixtures of the actor tests: a counter of block-attention calls (dsrl.actor.block_attention)."""
import pytest

import dsrl.actor.block_attention as block_attention


@pytest.fixture
def block_attention_calls(monkeypatch):
    """Every call of the block attention appends its `sdpa` flag to the returned list (the real
    attention still runs). The size floor is off: the tiny model's rows are short, so the ratio
    of score entries alone decides (dsrl.actor.block_attention.MIN_RATIO)."""
    calls = []
    real = block_attention._blocks_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["sdpa"])
        return real(*args, **kwargs)
    monkeypatch.setattr(block_attention, "_blocks_attention", spy)
    monkeypatch.setattr(block_attention, "MIN_SAVED", 0)
    return calls
