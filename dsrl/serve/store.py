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
checkpoint written before owners were recorded has none and stays open to every key.

Expiry: a checkpoint saved with ``ttl_seconds`` records ``expires_at`` (unix seconds) in its
``tinker.json``. From then on it is refused by name (UserError: expired at ...) and deleted
when first touched, and `collect_expired` (the service's sweep, serve.checkpoint_sweep_s)
deletes the ones nobody touched. Its owner may change or remove the expiry (`set_ttl`) and
delete it (`delete`); listings (`entries`) show each checkpoint's expiry."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, List, Optional

from dsrl.serve.errors import UserError

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
META = "tinker.json"
# ttl_seconds accepted by save_weights / save_weights_for_sampler / the ttl route: 1 s to 10 years
# (the SDK documents 1 hour to 10 years for its ttl route; short ones are kept for tests and
# scratch runs).
MAX_TTL_SECONDS = 10 * 365 * 86400
# The SDK's checkpoint_type of each kind (types.Checkpoint).
SDK_TYPE = {"weights": "training", "sampler_weights": "sampler"}


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


def check_ttl(value, what: str) -> Optional[int]:
    """A request's ttl_seconds: None (never expires) or whole seconds in [1, MAX_TTL_SECONDS]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TTL_SECONDS:
        raise UserError(f"{what}: ttl_seconds={value!r} must be null (never expires) or whole seconds in "
                        f"[1, {MAX_TTL_SECONDS}] (10 years)")
    return value


def iso_time(unix: Optional[float]) -> Optional[str]:
    """Unix seconds as the ISO 8601 UTC time the SDK's datetime fields read (None stays None)."""
    return None if unix is None else datetime.fromtimestamp(float(unix), timezone.utc).isoformat()


def _expired(meta: dict, now: float) -> bool:
    expires = meta.get("expires_at")
    return expires is not None and now >= float(expires)


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
              overwrite: bool = False, ttl_seconds: Optional[int] = None) -> Checkpoint:
        """Create checkpoint ``name``: ``fill(tmp_folder)`` writes the tensors; the folder appears
        under its final name only once complete. An existing name is an error unless ``overwrite``
        (an expired one is replaced). ``ttl_seconds``: it expires that long after now."""
        check_name(name)
        now = time.time()
        meta = dict(meta, created_at=now)
        if ttl_seconds is not None:
            meta["expires_at"] = now + int(ttl_seconds)
        final = self._run_dir(run_id) / kind / name
        if final.exists() and not overwrite and not self._collect(final, now):
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
        if _expired(ckpt.meta, time.time()):
            shutil.rmtree(folder, ignore_errors=True)
            raise UserError(f"checkpoint {path!r} expired at {iso_time(ckpt.meta['expires_at'])} (the ttl_seconds it "
                            f"was saved with) and was deleted")
        written_by = ckpt.meta.get("owner")
        if owner is not None and written_by is not None and written_by != owner and not ckpt.meta.get("published"):
            raise UserError(f"checkpoint {path!r} belongs to another API key and is not published (its owner "
                            f"can publish it with RestClient.publish_checkpoint_from_tinker_path)")
        return ckpt

    def _owned(self, path: str, owner: str, action: str) -> Checkpoint:
        """The checkpoint at ``path`` if ``owner`` may ``action`` it (only its owner may)."""
        ckpt = self.resolve(path)
        if ckpt.meta.get("owner") not in (None, owner):
            raise UserError(f"checkpoint {path!r} belongs to another API key: only its owner may {action} it")
        return ckpt

    @staticmethod
    def _rewrite_meta(ckpt: Checkpoint, meta: dict) -> Checkpoint:
        tmp = ckpt.folder / f".{META}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(tmp, ckpt.folder / META)
        return Checkpoint(ckpt.tinker_path, ckpt.kind, ckpt.folder, meta)

    def set_published(self, path: str, owner: str, published: bool) -> Checkpoint:
        """Publish or unpublish ``path``; only its owner may. UserError if it is already so
        (``.conflict`` set: the SDK documents 409 for publishing a public checkpoint)."""
        ckpt = self._owned(path, owner, "publish" if published else "unpublish")
        if bool(ckpt.meta.get("published")) == published:
            raise UserError(f"checkpoint {path!r} is {'already' if published else 'not'} published")
        return self._rewrite_meta(ckpt, dict(ckpt.meta, published=published))

    def set_ttl(self, path: str, owner: str, ttl_seconds: Optional[int]) -> Checkpoint:
        """``path`` expires ``ttl_seconds`` from now (None: never); only its owner may."""
        ckpt = self._owned(path, owner, "set the expiry of")
        meta = dict(ckpt.meta, expires_at=None if ttl_seconds is None else time.time() + int(ttl_seconds))
        return self._rewrite_meta(ckpt, meta)

    def delete(self, path: str, owner: Optional[str] = None) -> None:
        """Delete ``path`` (``owner`` given: only its owner may)."""
        ckpt = self.resolve(path) if owner is None else self._owned(path, owner, "delete")
        shutil.rmtree(ckpt.folder, ignore_errors=True)

    # ------------------------------------------------------------------ expiry and listings
    def _folders(self, run_id: Optional[str] = None) -> Iterator[tuple]:
        """(run id, kind, name, folder) of every complete checkpoint (of ``run_id`` if given)."""
        runs = [self._run_dir(run_id)] if run_id is not None else sorted(self.root.iterdir())
        for run in runs:
            for kind in KINDS:
                base = run / kind
                if not base.is_dir():
                    continue
                for folder in sorted(base.iterdir()):
                    if not folder.name.startswith(".") and (folder / META).is_file():
                        yield run.name, kind, folder.name, folder

    @staticmethod
    def _collect(folder: Path, now: float) -> bool:
        """Delete ``folder`` if its checkpoint has expired; whether it did."""
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError):
            return False  # being written or removed meanwhile
        if not _expired(meta, now):
            return False
        shutil.rmtree(folder, ignore_errors=True)
        return True

    def collect_expired(self, now: Optional[float] = None) -> List[str]:
        """Delete every expired checkpoint; their tinker:// paths."""
        now = time.time() if now is None else now
        return [self.tinker_path(run, kind, name) for run, kind, name, folder in list(self._folders())
                if self._collect(folder, now)]

    def entries(self, run_id: Optional[str] = None, owner: Optional[str] = None, *,
                only_owner: bool = False) -> List[dict]:
        """The checkpoints (of ``run_id``; ``owner`` given: those it may load, its own and the
        published ones, or with ``only_owner`` its own alone) as the SDK's ``types.Checkpoint``
        objects, oldest first; expired ones are collected, not listed. Ephemeral sampler
        snapshots are not listed."""
        now = time.time()
        out = []
        for run, kind, name, folder in self._folders(run_id):
            if self._collect(folder, now):
                continue
            try:
                meta = json.loads((folder / META).read_text())
            except (OSError, ValueError):
                continue
            mine = meta.get("owner") == owner if only_owner else (
                meta.get("owner") in (None, owner) or bool(meta.get("published")))
            if meta.get("ephemeral") or (owner is not None and not mine):
                continue
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            created = float(meta.get("created_at", (folder / META).stat().st_mtime))
            out.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": SDK_TYPE[kind], "time": created,
                        "tinker_path": self.tinker_path(run, kind, name), "size_bytes": size,
                        "public": bool(meta.get("published")), "user_metadata": meta.get("user_metadata") or None,
                        "expires_at": iso_time(meta.get("expires_at"))})
        out.sort(key=lambda c: c["time"])
        return [dict(c, time=iso_time(c["time"])) for c in out]
