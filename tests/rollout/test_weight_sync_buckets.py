"""Weight buckets (dsrl.rollout.buckets) and their shared-memory staging
(dsrl.rollout.shm_transport): boundaries and round trips, bit for bit; staging then
loading (every bucket staged before the first load) and its failures."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from dsrl.rollout.buckets import ALIGN, Bucket, pack_buckets, unpack
from dsrl.rollout.shm_transport import SHM_DIR, BucketLoadError, ShmStaging, leftover_segments, stage_then_load


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.f32", torch.randn(10, 7, generator=g)),                        # 280 B
        ("b.bf16", torch.randn(33, generator=g).to(torch.bfloat16)),        # 66 B: odd size, realigned after
        ("c.big", torch.randn(64, 16, generator=g)),                        # 4096 B > bucket
        ("d.f16", torch.randn(3, 5, generator=g).to(torch.float16)),
        ("e.i64", torch.arange(9, dtype=torch.int64).view(3, 3)),
        ("f.scalar", torch.tensor(2.5)),                                    # 0-dim
        ("g.empty", torch.empty(0, 4)),
        ("h.bool", torch.tensor([True, False, True])),
        ("i.noncontig", torch.randn(6, 4, generator=g).t()),                # transposed view
    ]


def _assert_round_trip(buckets, tensors):
    out = [(n, t) for b in buckets for n, t in unpack(b)]
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (n, got), (_, want) in zip(out, tensors):
        assert got.dtype == want.dtype and got.shape == want.shape, n
        assert torch.equal(got, want), n


def test_bucket_boundaries_and_bit_exact_round_trip():
    tensors = _tensors()
    buckets = list(pack_buckets(iter(tensors), 1024))
    _assert_round_trip(buckets, tensors)
    names = [[m.name for m in b.metas] for b in buckets]
    # a.f32 (320 aligned) + b.bf16 (128) fit; c.big alone (larger than a bucket); the rest share the last one.
    assert names == [["a.f32", "b.bf16"], ["c.big"], ["d.f16", "e.i64", "f.scalar", "g.empty", "h.bool",
                                                       "i.noncontig"]]
    assert buckets[1].nbytes == 4096 > 1024
    for b in buckets:
        assert all(m.offset % ALIGN == 0 for m in b.metas)
        assert b.nbytes <= 1024 or len(b.metas) == 1
    assert buckets[-1].nbytes < 1024  # the last, partial bucket


def test_unpack_is_zero_copy_and_bucket_pickles():
    (b,) = list(pack_buckets([("w", torch.ones(4))], 1 << 20))
    (name, view), = unpack(b)
    b.data[:4].copy_(torch.tensor([0, 0, 128, 64], dtype=torch.uint8))  # 4.0 in float32, little endian
    assert view[0].item() == 4.0
    again = pickle.loads(pickle.dumps(b))
    assert isinstance(again, Bucket) and torch.equal(unpack(again)[0][1], view)


def test_one_bucket_when_everything_fits_and_every_tensor_alone_when_tiny():
    tensors = _tensors()
    assert len(list(pack_buckets(tensors, 1 << 20))) == 1
    assert len(list(pack_buckets(tensors, 1))) == len(tensors)
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(pack_buckets(tensors, 0))


def test_tied_embeddings_pack_once_by_name():
    """A tied head is the same tensor under two names: the export leaves lm_head out, and a
    bucket holds exactly what it is given (one copy per name it gets)."""
    emb = torch.randn(50, 8)
    buckets = list(pack_buckets([("model.embed_tokens.weight", emb), ("lm_head.weight", emb)], 1 << 20))
    out = dict(unpack(buckets[0]))
    assert torch.equal(out["model.embed_tokens.weight"], out["lm_head.weight"])
    assert out["lm_head.weight"].data_ptr() != out["model.embed_tokens.weight"].data_ptr()


def test_shm_staging_packs_in_place_reuses_segments_and_leaves_nothing():
    tensors = _tensors()
    staging = ShmStaging()
    try:
        buckets = list(pack_buckets(tensors, 1024, alloc=staging.alloc))
        paths = staging.paths
        assert len(paths) == 3 and all(p.startswith("/dev/shm/dsrl-sync-") for p in paths)
        refs = staging.stage(buckets)
        _assert_round_trip(buckets, tensors)
        # The engine maps the file: its bytes are the bucket's.
        for ref, b in zip(refs, buckets):
            mapped = torch.from_file(ref.path, shared=False, size=ref.nbytes, dtype=torch.uint8)
            assert torch.equal(mapped, b.data[:b.nbytes])
        # Next sync with the same layout: same files, no new ones.
        staging.stage(pack_buckets(tensors, 1024, alloc=staging.alloc))
        assert staging.paths == paths
        # Buckets from elsewhere are copied in; fewer buckets -> the extra files are removed.
        staging.stage(pack_buckets(tensors, 1 << 20))
        assert len(staging.paths) == 1 and len(staging.refs) == 1
        got = torch.from_file(staging.refs[0].path, shared=False, size=staging.refs[0].nbytes, dtype=torch.uint8)
        _assert_round_trip([Bucket(got, list(pack_buckets(tensors, 1 << 20))[0].metas)], tensors)
    finally:
        staging.close()
    assert [n for n in leftover_segments() if n.startswith(staging.tag + "-")] == []


def test_segments_of_a_killed_process_are_reaped_by_the_next_staging():
    """A process killed before close() leaves its files; the next ShmStaging removes them (the
    owner's pid no longer runs) and leaves a live process's files alone."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)
    stale = os.path.join(SHM_DIR, f"dsrl-sync-{dead}-0-0")
    live = os.path.join(SHM_DIR, f"dsrl-sync-{os.getpid()}-999-0")
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x" * 10)
    try:
        staging = ShmStaging()
        staging.close()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def _mapped(ref):
    return torch.from_file(ref.path, shared=False, size=ref.nbytes, dtype=torch.uint8).clone()


def test_stage_then_load_stages_every_bucket_then_loads_them_in_order():
    """Every bucket is packed and staged before the first load (the export runs to the end), then
    the loader gets them in order, the first flagged, then one finish; what it reads is each
    bucket's bytes."""
    tensors = _tensors()
    staging = ShmStaging()
    calls, packed = [], []

    def load(ref, first):
        calls.append((ref.path, first, len(packed), _mapped(ref)))

    def export():
        for i, b in enumerate(pack_buckets(tensors, 1024, alloc=staging.alloc)):
            packed.append(i)
            yield b

    try:
        refs = stage_then_load(staging, export(), load, lambda: calls.append("finish"))
        assert refs == staging.refs and len(refs) == 3
        assert [c[:3] for c in calls[:-1]] == [(refs[0].path, True, 3), (refs[1].path, False, 3),
                                               (refs[2].path, False, 3)]
        assert calls[-1] == "finish"
        want = list(pack_buckets(tensors, 1024))
        _assert_round_trip([Bucket(c[3], b.metas) for c, b in zip(calls, want)], tensors)
    finally:
        staging.close()


def test_stage_then_load_failures_name_the_bucket_and_the_export_runs_to_the_end():
    tensors = _tensors()
    staging = ShmStaging()
    drawn, finished = [], []

    def export():
        for name, t in tensors:
            drawn.append(name)
            yield name, t

    def load(ref, first):
        if ref.rows[0][0] == "c.big":
            raise ValueError("no parameter c.big")

    try:
        with pytest.raises(BucketLoadError, match=r"test engine: loading weight bucket 1 of 3 \(/dev/shm/dsrl-sync-"
                                                  r".*1 tensors, c\.big \.\. c\.big\) failed: ValueError: no parameter") as e:
            stage_then_load(staging, pack_buckets(export(), 1024, alloc=staging.alloc), load,
                            lambda: finished.append(1), name="test engine")
        assert (e.value.index, e.value.count) == (1, 3)
        # Every tensor was exported and staged (collective under ZeRO-3), the session closed.
        assert drawn == [n for n, _ in tensors] and len(staging.refs) == 3 and finished == [1]

        # A failing export: raised as is, no file left, the engine never called (it keeps its weights).
        def broken():
            yield from tensors[:3]
            raise RuntimeError("gather failed")

        finished.clear()
        loads = []
        with pytest.raises(RuntimeError, match="gather failed"):
            stage_then_load(staging, pack_buckets(broken(), 1024, alloc=staging.alloc), lambda r, f: loads.append(r),
                            lambda: finished.append(1))
        assert staging.paths == [] and staging.refs == [] and finished == [] and loads == []
        assert [n for n in leftover_segments() if n.startswith(staging.tag + "-")] == []
    finally:
        staging.close()
