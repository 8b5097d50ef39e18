"""dsrl.heap.imports_uncollected: the collector is off inside the block, the objects alive at its end
are frozen out of its scans, and it is on again afterwards, also when the block raises."""
import gc

import pytest

from dsrl.heap import imports_uncollected


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_block_runs_uncollected_then_freezes_and_collects_again():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with imports_uncollected():
        assert not gc.isenabled()
        kept = [_Cycle() for _ in range(1000)]  # noqa: F841 - alive at the block's end
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + 1000  # the block's objects (and all before them) are frozen


def test_the_collector_is_on_again_when_the_block_raises():
    with pytest.raises(RuntimeError, match="import failed"):
        with imports_uncollected():
            raise RuntimeError("import failed")
    assert gc.isenabled()
