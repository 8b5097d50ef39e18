"""Checkpoints are verified, not trusted: every file is fsynced before the manifest (sizes and
CRC-32s) is written last and the folder renamed; a resume checks the newest folder and falls back
to the newest intact one, naming the damaged one (a truncated shard, a flipped byte); retention
never deletes the only intact checkpoint. The writer is dsrl.checkpoint.save_checkpoint itself,
with an actor that writes shard-like files (no DeepSpeed needed to test the files' handling)."""
from __future__ import annotations

import json
import logging
import os

import pytest

from dsrl import checkpoint as ckpt
from dsrl.checkpoint import MANIFEST, checkpoint_dir, find_latest, save_checkpoint


class ShardWriter:
    """The actor's side of a save: a DeepSpeed-like shard and an HF folder, bytes fixed by the step."""

    def __init__(self):
        self.step = 0

    def save_checkpoint(self, folder):
        os.makedirs(os.path.join(folder, "deepspeed"), exist_ok=True)
        with open(os.path.join(folder, "deepspeed", "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(bytes((self.step * 31 + i) % 251 for i in range(50_000)))

    def save_hf(self, folder, tokenizer=None):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(bytes((self.step * 7 + i) % 253 for i in range(20_000)))


def _save(run_dir, step, keep=0):
    actor = ShardWriter()
    actor.step = step
    folder, _ = save_checkpoint(str(run_dir), step, actor=actor, tokenizer=None, rank_state={"step": step},
                                shared={"metrics": []}, keep=keep)
    return folder


def _forget() -> None:
    """What this process verified is forgotten: the files are read as a resumed process reads them."""
    ckpt._VERIFIED.clear()


@pytest.fixture(autouse=True)
def _fresh_process():
    """Each check reads the files as a resumed process does (nothing verified by this one)."""
    _forget()
    yield
    _forget()


def _shard(folder):
    return os.path.join(folder, "deepspeed", "mp_rank_00_model_states.pt")


def test_the_manifest_holds_sizes_and_checksums_and_is_written_after_every_fsync(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    folder = _save(tmp_path, 1)
    manifest = json.loads(open(os.path.join(folder, MANIFEST)).read())
    assert set(manifest) == {"deepspeed/mp_rank_00_model_states.pt", "hf/model.safetensors", "rank-0.pt",
                             "trainer_state.json"}
    assert manifest["hf/model.safetensors"]["size"] == 20_000
    import zlib
    assert manifest["hf/model.safetensors"]["crc32"] == \
        f"{zlib.crc32(open(os.path.join(folder, 'hf', 'model.safetensors'), 'rb').read()):08x}"
    rename = next(i for i, (kind, _) in enumerate(events) if kind == "rename")
    manifest_sync = next(i for i, (kind, p) in enumerate(events) if kind == "fsync" and p.endswith(MANIFEST))
    for rel in manifest:  # every file fsynced before the manifest, the manifest before the rename
        i = next(i for i, (kind, p) in enumerate(events) if kind == "fsync" and p.endswith(rel))
        assert i < manifest_sync < rename, (rel, events)
    assert ("fsync", os.path.dirname(folder)) in events[rename:]  # the rename itself is on disk


def test_resume_falls_back_past_a_truncated_shard_and_a_flipped_byte_naming_them(tmp_path, caplog):
    one, two, three = (_save(tmp_path, s) for s in (1, 2, 3))
    with open(_shard(three), "r+b") as f:  # a shard cut short
        f.truncate(1000)
    with open(_shard(two), "r+b") as f:  # one byte flipped, same size
        f.seek(12_345)
        b = f.read(1)
        f.seek(12_345)
        f.write(bytes([b[0] ^ 0x40]))
    _forget()  # a resumed process: nothing verified yet
    with caplog.at_level(logging.WARNING, logger="dsrl"):
        assert find_latest(str(tmp_path)) == one
    assert (f"skipping damaged checkpoint {three}: deepspeed/mp_rank_00_model_states.pt has 1000 bytes, "
            f"manifest says 50000") in caplog.text
    assert (f"skipping damaged checkpoint {two}: deepspeed/mp_rank_00_model_states.pt does not match its "
            f"checksum") in caplog.text


def test_retention_never_deletes_the_only_intact_checkpoint(tmp_path):
    """Steps 4 and 5 damaged (same sizes, other bytes), the resume falls back to 3, the run writes
    4 again with keep_checkpoints=1: the new 4 is kept, the damaged 5 is left, and only 3 goes (a
    retention by sizes alone kept the damaged 5 and deleted the intact 4 and 3)."""
    for s in (3, 4, 5):
        _save(tmp_path, s)
    for s in (4, 5):
        with open(_shard(checkpoint_dir(str(tmp_path), s)), "r+b") as f:
            f.write(b"\x00" * 10)
    _forget()
    assert find_latest(str(tmp_path)) == checkpoint_dir(str(tmp_path), 3)
    _forget()
    _save(tmp_path, 4, keep=1)
    left = sorted(os.listdir(tmp_path / "checkpoints"))
    assert left == ["step-000004", "step-000005"]
    _forget()
    assert find_latest(str(tmp_path)) == checkpoint_dir(str(tmp_path), 4)


def test_retention_keeps_the_newest_intact_ones(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s, keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-000003", "step-000004"]


def test_a_manifest_of_sizes_only_still_resumes(tmp_path):
    """A checkpoint written before checksums (its manifest maps each file to its size) is checked by sizes."""
    folder = _save(tmp_path, 1)
    path = os.path.join(folder, MANIFEST)
    manifest = json.loads(open(path).read())
    with open(path, "w") as f:
        json.dump({rel: entry["size"] for rel, entry in manifest.items()}, f)
    assert find_latest(str(tmp_path)) == folder
