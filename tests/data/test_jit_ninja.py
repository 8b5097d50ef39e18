"""Every JIT build of DeepSpeed's ops runs the interpreter's own ninja (dsrl.setup_assets.
use_interpreter_ninja): with a machine's ninja first on PATH, torch ran that one in some processes
and the venv's in others, and each switch compiled the shm comm op again (three times in one
suite run)."""
from __future__ import annotations

import os
import shutil
import stat
import sys

from dsrl.setup_assets import ninja_version, stamp_ninja, use_interpreter_ninja, use_op_cache

BINDIR = os.path.dirname(sys.executable)


def _fake_ninja(folder):
    folder.mkdir()
    exe = folder / "ninja"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(folder)


def test_the_interpreters_ninja_comes_first_and_the_rest_of_path_keeps_its_order(tmp_path, monkeypatch):
    assert os.access(os.path.join(BINDIR, "ninja"), os.X_OK), "the venv has no ninja (vLLM/torch install it)"
    other, tools = _fake_ninja(tmp_path / "machine"), _fake_ninja(tmp_path / "tools")
    monkeypatch.setenv("PATH", os.pathsep.join([other, BINDIR, tools, "/usr/bin"]))
    assert shutil.which("ninja") == os.path.join(other, "ninja")  # what torch ran before
    use_interpreter_ninja()
    assert shutil.which("ninja") == os.path.join(BINDIR, "ninja")
    assert os.environ["PATH"].split(os.pathsep) == [BINDIR, other, tools, "/usr/bin"]
    use_interpreter_ninja()  # twice: no second copy
    assert os.environ["PATH"].split(os.pathsep) == [BINDIR, other, tools, "/usr/bin"]


def test_path_is_left_alone_when_the_interpreter_has_no_ninja(tmp_path, monkeypatch):
    other = _fake_ninja(tmp_path / "machine")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join([other, "/usr/bin"]))
    use_interpreter_ninja()
    assert os.environ["PATH"] == os.pathsep.join([other, "/usr/bin"])


def test_op_cache_keeps_a_chosen_folder_unless_forced(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert use_op_cache(tmp_path / "cache") == tmp_path / "mine"
    assert use_op_cache(tmp_path / "cache", force=True) == tmp_path / "cache" / "torch_extensions"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "cache" / "torch_extensions")
    assert shutil.which("ninja") == os.path.join(BINDIR, "ninja")


def test_warm_up_stamp_records_its_ninja_so_another_ninjas_build_is_redone(tmp_path):
    stamp = tmp_path / "stamp"
    assert stamp_ninja(stamp) is None  # no warm-up yet
    stamp.write_text("warmed in 54.2s\n")  # a set-up from before the record: not trusted
    assert stamp_ninja(stamp) is None
    stamp.write_text("ninja 1.11.1\nwarmed in 54.2s\n")
    assert stamp_ninja(stamp) == "1.11.1"


def test_the_stamp_is_checked_against_the_ninja_torch_will_run(tmp_path, monkeypatch):
    fake = tmp_path / "machine"
    fake.mkdir()
    (fake / "ninja").write_text("#!/bin/sh\necho 0.0-machine\n")
    (fake / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(fake), "/usr/bin"]))
    assert ninja_version() == "0.0-machine"
    use_interpreter_ninja()
    here = ninja_version()
    assert here[:1].isdigit() and here != "0.0-machine", here
