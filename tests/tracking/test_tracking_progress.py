import io

import pytest

from dsrl.tracking.progress import microbatch_bar, microbatch_desc, progress


@pytest.fixture
def rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def set_rank(r):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")

    return set_rank


def test_bar_enabled_on_rank0_disabled_elsewhere(rank):
    rank(0)
    buf = io.StringIO()
    bar = progress(range(3), desc="actor train", unit="microbatch", file=buf)
    assert bar.disable is False
    assert list(bar) == [0, 1, 2]
    assert "actor train" in buf.getvalue()

    rank(1)
    buf = io.StringIO()
    bar = progress(range(3), desc="actor train", unit="microbatch", file=buf)
    assert bar.disable is True
    assert list(bar) == [0, 1, 2]  # still iterates, prints nothing
    assert buf.getvalue() == ""


def test_enabled_false_disables_on_rank0(rank):
    rank(0)
    buf = io.StringIO()
    bar = progress(total=2, desc="generate", unit="sample", enabled=False, file=buf)
    bar.update(2)
    bar.close()
    assert bar.disable is True
    assert buf.getvalue() == ""


def test_microbatch_bar_counts_and_closes(rank):
    rank(0)
    buf = io.StringIO()
    with microbatch_bar(4, "ref forward", file=buf) as bar:
        for _ in range(4):
            bar.update(1)
        assert bar.n == 4
        assert bar.total == 4
    out = buf.getvalue()
    assert "ref forward" in out and "microbatch" in out
    assert "/4 " in out  # total shown; updates are rate-limited by tqdm

    rank(3)
    buf = io.StringIO()
    with microbatch_bar(4, "actor forward", file=buf) as bar:
        bar.update(4)
    assert buf.getvalue() == ""


def test_microbatch_bar_closes_on_error(rank):
    rank(0)
    buf = io.StringIO()
    with pytest.raises(RuntimeError):
        with microbatch_bar(2, "actor train", file=buf) as bar:
            raise RuntimeError("step failed")
    assert bar.disable is True  # tqdm marks a closed bar disabled


def test_microbatch_desc_like_slime():
    assert microbatch_desc("ref_", "forward") == "ref forward"
    assert microbatch_desc("", "train") == "actor train"
    assert microbatch_desc("teacher", "forward") == "teacher forward"
