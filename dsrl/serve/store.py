"""tinker:// checkpoint paths mapped to folders of a local store.

``tinker://<run>/weights/<name>``          training state (weights + optimizer), for resume
``tinker://<run>/sampler_weights/<name>``  full merged weights as an HF folder, for sampling

``<run>`` is the training client's model id. Each checkpoint is a folder
``<root>/<run>/<weights|sampler_weights>/<name>/`` holding ``tinker.json`` (what it is: base
model, LoRA or full, rank, whether optimizer state is inside, its owner) next to the tensors.
Folders are written under a temporary name and renamed, so a reader never sees half a checkpoint.

Ownership: a checkpoint belongs to the API key whose session wrote it (``owner``: a digest of
the key, never the key). Only that key may load it, sample from it, publish or unpublish it;
once published (the SDK's ``publish_checkpoint_from_tinker_path``) any key may load it. A
checkpoint written before owners were recorded has none and stays open to every key."""
from __future__ import annotations

import hashlib
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


def owner_of(api_key: str) -> str:
    """The owner recorded for an API key: a digest (checkpoints never hold the key itself)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


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

    def resolve(self, path: str, kind: Optional[str] = None, *, owner: Optional[str] = None) -> Checkpoint:
        """The checkpoint a tinker:// path names; UserError naming the path if it is malformed,
        of the wrong kind, absent, or (``owner`` given) another key's and not published."""
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
        ckpt = Checkpoint(path, got_kind, folder, json.loads(meta_file.read_text()))
        written_by = ckpt.meta.get("owner")
        if owner is not None and written_by is not None and written_by != owner and not ckpt.meta.get("published"):
            raise UserError(f"checkpoint {path!r} belongs to another API key and is not published (its owner "
                            f"can publish it with RestClient.publish_checkpoint_from_tinker_path)")
        return ckpt

    def set_published(self, path: str, owner: str, published: bool) -> Checkpoint:
        """Publish or unpublish ``path``; only its owner may. UserError if it is already so
        (``.conflict`` set: the SDK documents 409 for publishing a public checkpoint)."""
        ckpt = self.resolve(path)
        if ckpt.meta.get("owner") not in (None, owner):
            raise UserError(f"checkpoint {path!r} belongs to another API key: only its owner may "
                            f"{'publish' if published else 'unpublish'} it")
        if bool(ckpt.meta.get("published")) == published:
            raise UserError(f"checkpoint {path!r} is {'already' if published else 'not'} published")
        meta = dict(ckpt.meta, published=published)
        tmp = ckpt.folder / f".{META}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(tmp, ckpt.folder / META)
        return Checkpoint(ckpt.tinker_path, ckpt.kind, ckpt.folder, meta)

    def delete(self, path: str) -> None:
        ckpt = self.resolve(path)
        shutil.rmtree(ckpt.folder, ignore_errors=True)
