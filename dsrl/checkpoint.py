"""Checkpoints of a run and exact resume.

A checkpoint is one folder `<run_dir>/checkpoints/step-NNNNNN/` holding
  deepspeed/           DeepSpeed's checkpoint (module, optimizer, scheduler; one partition per rank)
  critic/              the critic's DeepSpeed checkpoint (algo.advantage_estimator=gae only)
  rank-R.pt            rank R's RNG states (python, numpy, torch) and its trainer state
  trainer_state.json   step, metrics so far and their W&B run's id, the prompts.jsonl rows so far, the
                       resolved config, world size (rank 0)
  hf/                  the policy as a transformers folder (for use outside dsrl)
  COMPLETE.json        written last: every file with its size and CRC-32
It is written under a temporary name; every file is fsynced, then the manifest is written (and
fsynced), then the folder is renamed (and its parent fsynced): a crash or a power cut mid-save
leaves no folder that looks complete. Checkpoints are verified, not trusted: a resume checks the
newest folder's files against its manifest (sizes and checksums) and falls back to the newest
intact one, naming each damaged one and why. Retention keeps the newest `keep` intact checkpoints
and deletes the older ones, so it never deletes the only intact one (a folder whose files do not
have its manifest's sizes is left for inspection).

trainer.checkpoint_storage: `shared` (the default): the folder is on storage every rank sees;
rank 0 completes, renames and prunes it. `node_local`: `<run_dir>/checkpoints` is on each node's
own disk (one path, a different disk per node). Every rank writes its DeepSpeed shards and
rank-R.pt there (DeepSpeed's `checkpoint.use_node_local_storage`: the first rank of each node
also writes the non-partitioned model file); rank 0 adds trainer_state.json and hf/; the first
rank of each node (LOCAL_RANK 0) writes that node's manifest and renames that node's folder, and
older folders are pruned only once every node's is complete. A resume takes the newest step that
is complete on every node, and the shared state comes from rank 0.

Resume is exact: with the same config and seeds the steps after the checkpoint reproduce the
uninterrupted run (sampling seeds depend only on (seed, step, prompt), see dsrl.rollout.seeds).
A config change that breaks that is an error naming the keys; the keys in RESUME_SAFE may change.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import zlib
from dataclasses import asdict
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from dsrl.distributed.collectives import broadcast_from_rank0
from dsrl.distributed.ranks import global_rank, local_rank, world_size
from dsrl.errors import ConfigError
from dsrl.rollout.faults import kill_point

log = logging.getLogger("dsrl")

CHECKPOINTS = "checkpoints"
MANIFEST = "COMPLETE.json"
SHARED_STATE = "trainer_state.json"
_PREFIX = "step-"

# Config keys a resumed run may change without breaking exactness (prefix match on dotted keys).
RESUME_SAFE = ("name", "logger.", "trainer.total_steps", "trainer.save_every", "trainer.keep_checkpoints",
               "trainer.dist_timeout_s", "trainer.resume", "trainer.resume_from", "trainer.eval_before",
               "trainer.eval_after",
               "trainer.save_final", "trainer.check_rank_sync", "trainer.max_skipped_steps",
               "trainer.resume_exact", "rollout.max_restarts", "rollout.timeout_s", "reward.timeout_s", "reward.retries",
               "reward.concurrency", "rollout.sync_probe", "rollout.sync_tolerance", "rollout.sync_bucket_mb",
               "data.num_eval")


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, CHECKPOINTS, f"{_PREFIX}{step:06d}")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


STORAGES = ("shared", "node_local")


def _check_storage(storage: str) -> None:
    if storage not in STORAGES:
        raise ValueError(f"checkpoint storage {storage!r}: expected one of {STORAGES}")


def _writer(storage: str) -> bool:
    """Whether this rank creates, completes, renames and prunes the checkpoint folders it sees:
    rank 0 on shared storage, the first rank of each node on node-local disks."""
    _check_storage(storage)
    return (local_rank() if storage == "node_local" else global_rank()) == 0


# ---------------------------------------------------------------------------------------- layout
def check_shared_checkpoint_folder(run_dir: str, storage: str = "shared") -> None:
    """Collective, before training: every rank must see the checkpoint folder of its writer
    (`_writer`), which completes, renames and prunes it. `shared`: every rank must see rank 0's
    folder; on node-local disks a rank on another node would leave its shards in a temporary
    folder nobody renames, and a resume there would find nothing. `node_local`: every rank must see
    exactly one writer's folder, its own node's (none: its node's ranks do not share a disk; two or
    more: the folder is shared after all, and two writers would rename the same folder). Refused
    here, naming the path and the ranks."""
    _check_storage(storage)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    import socket
    import uuid

    root = os.path.join(run_dir, CHECKPOINTS)
    token = broadcast_from_rank0(uuid.uuid4().hex)
    prefix = f".shared-probe-{token}"
    probe = os.path.join(root, f"{prefix}-{global_rank()}")  # one per writer, named by its rank
    writer = _writer(storage)
    if writer:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as f:
            f.write(token)
    _barrier()
    try:
        seen = sorted(int(n[len(prefix) + 1:]) for n in os.listdir(root) if n.startswith(prefix + "-"))
    except OSError:
        seen = []
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (global_rank(), socket.gethostname(), os.path.abspath(root), seen))
    _barrier()
    if writer:
        os.remove(probe)
    from dsrl.errors import ConfigError

    if storage == "shared":
        blind = [f"rank {r} on {host} ({path})" for r, host, path, ok in views if 0 not in ok]
        if blind:
            raise ConfigError(f"checkpoints: {views[0][2]} is not shared by every rank ({', '.join(blind)} cannot "
                              "see what rank 0 writes there): checkpoints and resume need one folder all nodes "
                              "share; put hydra.run.dir (or trainer.resume_from) on a shared filesystem, or set "
                              "trainer.checkpoint_storage=node_local (each node keeps its own ranks' shards)")
        return
    bad = [f"rank {r} on {host} ({path}) sees {'no' if not w else len(w)} node writers' folders"
           + (f" (ranks {', '.join(map(str, w))})" if len(w) > 1 else "")
           for r, host, path, w in views if len(w) != 1]
    if bad:
        raise ConfigError(f"trainer.checkpoint_storage=node_local: {', '.join(bad)}; each rank must see its own "
                          "node's folder only, written by the node's first rank (LOCAL_RANK 0): on storage "
                          "every node shares use trainer.checkpoint_storage=shared")


# ---------------------------------------------------------------------------------------- RNG
def capture_rng() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------- save
_READ = 8 << 20


def _file_digest(path: str, sync: bool = False) -> str:
    """CRC-32 of a file's bytes (hex); `sync`: fsync it first (its data on disk before the manifest)."""
    crc = 0
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        while True:
            chunk = f.read(_READ)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest(folder: str, sync: bool = False) -> Dict[str, dict]:
    """Every file of `folder` with its size and CRC-32; `sync`: each file and folder fsynced first."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = {"size": os.path.getsize(path), "crc32": _file_digest(path, sync)}
        if sync:
            _fsync_dir(root)
    return files


def _write_manifest(folder: str) -> None:
    """fsync every file, then write the manifest (fsynced) last."""
    manifest = _manifest(folder, sync=True)  # before the manifest file itself exists
    path = os.path.join(folder, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)
    _VERIFIED[folder] = _manifest_key(path)


def save_checkpoint(run_dir: str, step: int, *, actor, tokenizer, rank_state: dict, shared: dict,
                    keep: int, critic=None, storage: str = "shared") -> tuple[str, float]:
    """Write the checkpoint of `step` atomically; returns (folder, seconds). Collective. `critic`
    (algo.advantage_estimator=gae): its DeepSpeed state goes into critic/ inside the same folder.
    `storage`: trainer.checkpoint_storage (module docstring)."""
    t0 = time.perf_counter()
    final = checkpoint_dir(run_dir, step)
    tmp = os.path.join(run_dir, CHECKPOINTS, f".tmp-{_PREFIX}{step:06d}")
    writer = _writer(storage)
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    with kill_point("checkpoint", step):
        actor.save_checkpoint(tmp)
        if critic is not None:
            critic.save_checkpoint(tmp)
        actor.save_hf(os.path.join(tmp, "hf"), tokenizer=tokenizer)  # collective (gathers under ZeRO-3)
        # The RNGs last, after the exports above (library code may draw from the global generators).
        # torch's generator (dropout) resumes exactly; python's and numpy's are also drawn by library
        # code on paths a resumed process does not share with the uninterrupted one (its start-up),
        # and no dsrl number comes from them (tests/e2e/test_e2e_resume.py).
        torch.save({"rng": capture_rng(), "trainer": rank_state}, os.path.join(tmp, f"rank-{global_rank()}.pt"))
        if global_rank() == 0:
            with open(os.path.join(tmp, SHARED_STATE), "w") as f:
                json.dump({"step": step, "world_size": world_size(), **shared}, f)
    _barrier()  # every rank's files are on disk
    if writer:
        _write_manifest(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _VERIFIED[final] = _VERIFIED.pop(tmp)  # checksummed from its files on disk just now
        _fsync_dir(os.path.dirname(final))
    if storage == "node_local":
        _barrier()  # every node's folder is complete before any node drops an older one
    if writer:
        _prune(run_dir, keep)
    _barrier()
    return final, time.perf_counter() - t0


def _prune(run_dir: str, keep: int) -> None:
    """Keep the newest `keep` intact checkpoints (verified) and delete the older ones: a damaged
    folder is not counted, so the only intact one is never deleted; one whose files do not have its
    manifest's sizes is left for inspection."""
    if keep <= 0:
        return
    intact = 0
    for folder in _checkpoint_folders(run_dir):
        if intact < keep:
            intact += _damage(folder) is None
        elif _damage(folder, checksums=False) is None:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------- find / load
# Folders whose files were checked against their manifest by this process: folder -> the
# manifest's (mtime_ns, size), so each is read once (the one a save just wrote is not read again).
_VERIFIED: Dict[str, tuple] = {}


def _manifest_key(path: str) -> tuple:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def _damage(folder: str, checksums: bool = True) -> Optional[str]:
    """Why `folder` is not a usable checkpoint (None when it is): no or an unreadable manifest, a
    file missing, of another size or (`checksums`) with other bytes than the manifest says."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return "no manifest (partial save)"
    if checksums and _VERIFIED.get(folder) == _manifest_key(path):
        return None
    try:
        with open(path) as f:
            expected = json.load(f)
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})"
    for rel, entry in expected.items():
        size = entry["size"] if isinstance(entry, dict) else entry  # older manifests: sizes only
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            return f"missing {rel}"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, manifest says {size}"
    if checksums:
        for rel, entry in expected.items():
            if isinstance(entry, dict) and _file_digest(os.path.join(folder, rel)) != entry["crc32"]:
                return f"{rel} does not match its checksum (CRC-32 {entry['crc32']} in the manifest)"
        _VERIFIED[folder] = _manifest_key(path)
    return None


def _checkpoint_folders(run_dir: str) -> List[str]:
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted((n for n in os.listdir(root) if n.startswith(_PREFIX)),
                                                   reverse=True)]


def _newest_intact(run_dir: str, warn: bool = True) -> Optional[str]:
    """The newest checkpoint of `run_dir` whose files match its manifest; the newer damaged ones are
    named with why (older ones are not read)."""
    for folder in _checkpoint_folders(run_dir):
        why = _damage(folder)
        if why is None:
            return folder
        if warn:
            log.warning("skipping damaged checkpoint %s: %s", folder, why)
    return None


def _complete_checkpoints(run_dir: str, warn: bool = True) -> List[str]:
    """Checkpoint folders of `run_dir` whose files have their manifest's sizes (not read), newest
    first; the others are named and skipped."""
    out = []
    for folder in _checkpoint_folders(run_dir):
        why = _damage(folder, checksums=False)
        if why is None:
            out.append(folder)
        elif warn:
            log.warning("skipping damaged checkpoint %s: %s", folder, why)
    return out


def find_latest(run_dir: str, storage: str = "shared") -> Optional[str]:
    """The newest intact checkpoint of `run_dir` (its files match its manifest's sizes and
    checksums; same answer on every rank; collective in a multi-rank run); each newer damaged one
    is named with why. `shared`: as rank 0 sees it. `node_local`: the newest step complete on every
    node (each rank looks at its own node's disk); a newer one that some node lacks is named and
    skipped."""
    _check_storage(storage)
    if storage == "shared" or not (dist.is_initialized() and dist.get_world_size() > 1):
        found = _newest_intact(run_dir) if global_rank() == 0 else None
        return broadcast_from_rank0(found)
    import socket

    mine = [os.path.basename(f) for f in _complete_checkpoints(run_dir, warn=local_rank() == 0)]
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (global_rank(), socket.gethostname(), mine))
    common = set(views[0][2]).intersection(*(set(v[2]) for v in views))
    if global_rank() == 0:
        for name in sorted(set().union(*(set(v[2]) for v in views)) - common, reverse=True):
            lacking = [f"rank {r} on {host}" for r, host, names in views if name not in names]
            log.warning("skipping checkpoint %s: not complete on every node (%s lack it)",
                        checkpoint_dir(run_dir, int(name[len(_PREFIX):])), ", ".join(lacking))
    for name in sorted(common, reverse=True):  # the newest whose files match their checksums on every node
        folder = checkpoint_dir(run_dir, int(name[len(_PREFIX):]))
        whys = [None] * dist.get_world_size()
        dist.all_gather_object(whys, (global_rank(), socket.gethostname(), _damage(folder)))
        damaged = [f"rank {r} on {host}: {why}" for r, host, why in whys if why is not None]
        if not damaged:
            return folder
        if global_rank() == 0:
            log.warning("skipping damaged checkpoint %s: %s", folder, "; ".join(damaged))
    return None


def read_shared_state(folder: str) -> dict:
    """trainer_state.json of `folder`, as rank 0 reads it (on node-local disks only rank 0's node
    has it). Collective in a multi-rank run."""
    state = None
    if global_rank() == 0:
        try:
            with open(os.path.join(folder, SHARED_STATE)) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            state = e  # raised on every rank below, so none waits in a later collective
    state = broadcast_from_rank0(state)
    if isinstance(state, Exception):
        raise state
    return state


def load_rank_state(folder: str) -> dict:
    path = os.path.join(folder, f"rank-{global_rank()}.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {folder} has no state for rank {global_rank()} "
                                f"(saved with another world size?)")
    return torch.load(path, weights_only=False)


# ---------------------------------------------------------------------------------------- config
def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_record(cfg) -> dict:
    """The resolved config as stored in a checkpoint (JSON-able)."""
    return json.loads(json.dumps(asdict(cfg), default=str))


# Machine-dependent keys (dsrl.hardware) and what a different resolved value changes.
HARDWARE_EFFECT = {
    "model.dtype": "the trainer's numbers", "rollout.dtype": "the sampled tokens and log-probs",
    "model.attn_implementation": "the trainer's rounding", "actor.num_threads": "CPU kernels' rounding",
    "rollout.enforce_eager": "the engine's kernels",
}


def check_resume_compatible(saved: dict, saved_world: int, cfg, folder: str, *, auto_now=(),
                            auto_saved=None) -> None:
    """ConfigError naming every key whose change breaks exact resume. A machine-dependent key
    left on `auto` in both runs (`auto_now`: this run's; `auto_saved`: the checkpoint's, None for
    a checkpoint written before they were recorded) is compared as the user wrote it, not as it
    resolved: a different resolved value is one warning naming the key, or, with
    trainer.resume_exact=true, refused."""
    from dsrl.config.schema import Config

    now, old = _flatten(config_record(cfg)), _flatten(saved)
    moved = {k: (old.get(k), now.get(k)) for k in sorted(set(auto_now) & set(auto_saved or ()))
             if now.get(k) != old.get(k)}
    for k in moved:
        now.pop(k, None)
        old.pop(k, None)
    # A key the checkpoint does not know was added to dsrl after it was written: at its default
    # (which keeps the earlier behaviour) it changes nothing.
    defaults = _flatten(config_record(Config()))
    changed = sorted(k for k in set(now) | set(old)
                     if now.get(k) != old.get(k) and not any(k == s or (s.endswith(".") and k.startswith(s))
                                                              for s in RESUME_SAFE)
                     and not (k not in old and k in defaults and now.get(k) == defaults[k]))
    problems = [f"{k}: {old.get(k)!r} in the checkpoint, {now.get(k)!r} now" for k in changed]
    for k, (was, is_now) in moved.items():
        effect = HARDWARE_EFFECT.get(k, "the numbers")
        if cfg.trainer.resume_exact:
            problems.append(f"{k}=auto: {was!r} in the checkpoint's run, {is_now!r} on this machine "
                            f"(changes {effect}; trainer.resume_exact=true)")
        else:
            log.warning("resuming from %s: %s=auto resolves to %r on this machine, %r in the checkpoint's run; "
                        "%s may differ from an uninterrupted run (trainer.resume_exact=true refuses this)",
                        folder, k, is_now, was, effect)
    if saved_world != world_size():
        problems.append(f"world size: {saved_world} in the checkpoint, {world_size()} now")
    if problems:
        raise ConfigError(f"cannot resume exactly from {folder}: " + "; ".join(problems)
                          + " (only these may change: " + ", ".join(RESUME_SAFE) + ")")
