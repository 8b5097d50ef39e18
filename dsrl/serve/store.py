"""tinker:// checkpoint paths mapped to folders of a local store.

``tinker://<run>/weights/<name>``          training state (weights + optimizer), for resume
``tinker://<run>/sampler_weights/<name>``  full merged weights as an HF folder, for sampling

``<run>`` is the training client's model id. Each checkpoint is a folder
``<root>/<run>/<weights|sampler_weights>/<name>/`` holding ``tinker.json`` (what it is: base
model, LoRA or full, rank, whether optimizer state is inside) next to the tensors. Folders are
written under a temporary name and renamed, so a reader never sees half a checkpoint."""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from dsrl.serve.errors import UserError

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
META = "tinker.json"


@dataclass(frozen=True)
class Checkpoint:
    tinker_path: str
    kind: str  # weights | sampler_weights
    folder: Path
    meta: dict


def check_name(name: str, what: str = "checkpoint name") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(f"{what} {name!r}: use 1-128 letters, digits, '.', '_' or '-' (no '/'), "
                        f"starting with a letter or digit")
    return name


class CheckpointStore:
    def __init__(self, root: "str | os.PathLike[str]"):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _run_dir(self, run_id: str) -> Path:
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise UserError(f"bad training run id {run_id!r} in a tinker:// path")
        return self.root / run_id

    def tinker_path(self, run_id: str, kind: str, name: str) -> str:
        return f"{SCHEME}{run_id}/{kind}/{name}"

    def write(self, run_id: str, kind: str, name: str, meta: dict, fill: Callable[[Path], None], *,
              overwrite: bool = False) -> Checkpoint:
        """Create checkpoint ``name``: ``fill(tmp_folder)`` writes the tensors; the folder appears
        under its final name only once complete. An existing name is an error unless ``overwrite``."""
        check_name(name)
        final = self._run_dir(run_id) / kind / name
        if final.exists() and not overwrite:
            raise UserError(f"checkpoint {self.tinker_path(run_id, kind, name)} already exists "
                            f"(pass overwrite=True or choose another name)")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            fill(tmp)
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Checkpoint(self.tinker_path(run_id, kind, name), kind, final, meta)

    def resolve(self, path: str, kind: Optional[str] = None) -> Checkpoint:
        """The checkpoint a tinker:// path names; UserError naming the path if it is malformed,
        of the wrong kind, or absent."""
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise UserError(f"path {path!r} is not a tinker:// checkpoint path")
        parts = path[len(SCHEME):].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise UserError(f"path {path!r}: expected tinker://<run>/<weights|sampler_weights>/<name>")
        run_id, got_kind, name = parts
        check_name(name)
        if kind is not None and got_kind != kind:
            raise UserError(f"path {path!r} is a {got_kind} checkpoint; this call needs {kind}")
        folder = self._run_dir(run_id) / got_kind / name
        meta_file = folder / META
        if not meta_file.is_file():
            raise UserError(f"checkpoint {path!r} does not exist on this server")
        return Checkpoint(path, got_kind, folder, json.loads(meta_file.read_text()))

    def delete(self, path: str) -> None:
        ckpt = self.resolve(path)
        shutil.rmtree(ckpt.folder, ignore_errors=True)
