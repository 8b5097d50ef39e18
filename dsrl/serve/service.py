"""The Tinker service behind the HTTP routes: sessions, training clients, futures, checkpoints,
sampling sessions. HTTP handlers call the public methods here; each returns the immediate JSON
answer at once (a future's ``request_id`` for everything that computes) and never waits on the
model. Compute runs on one thread (`Executor`), sampling on another.

Ids (the SDK computes or parses some of them itself): session ``s-<hex>``; training client
``<session>:train:<n>`` (n = the client's model_seq_id); sampling session
``<session>:sample:<n>``; checkpoints ``tinker://<model id>/{weights|sampler_weights}/<name>``.

Training clients: ``create_model`` with a LoRA config of rank >= 1 gets a slot of the shared
LoRA pool (dsrl.serve.lora); rank 0 (or no lora_config) gets a full-parameter client with its
own DeepSpeed engine (``serve.allow_full_parameter``)."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsrl.serve import wire
from dsrl.serve.errors import UserError
from dsrl.serve.executor import Executor, Op
from dsrl.serve.futures import FutureStore, JsonReply, ProtoReply
from dsrl.serve.objectives import ObjectiveTable
from dsrl.serve.provenance import SampledSequences
from dsrl.serve.requests import (
    check_fields,
    check_optimizer_config,
    field_of,
    parse_adam,
    parse_lora,
    prompt_tokens,
)
from dsrl.serve.sequencer import Sequencer
from dsrl.errors import DatumError
from dsrl.serve.store import CheckpointStore, check_name, check_ttl, iso_time, owner_of

log = logging.getLogger("dsrl.serve")


@dataclass
class ServiceOptions:
    """Everything the service needs, resolved (see dsrl.serve.config for the config keys)."""

    model_path: str  # base model HF folder
    model_name: str  # the name clients pass as base_model
    checkpoint_dir: str
    dtype: str = "float32"
    attn_implementation: str = "eager"
    zero_stage: int = 0
    micro_batch_size: int = 8
    persistence_threshold: int = 10000
    lora_alpha: float = 32.0
    max_lora_rank: int = 128
    max_lora_slots: int = 8
    allow_full_parameter: bool = True
    max_chunk_datums: int = 1024
    max_merged_datums: int = 256
    max_datum_tokens: int = 32768
    max_num_samples: int = 128
    max_request_bytes: int = 1 << 30
    max_json_bytes: int = 16 << 20
    max_full_clients: int = 4
    max_pending_requests: int = 256
    max_future_bytes: int = 1 << 30
    max_recorded_sequences: int = 100_000
    long_poll_seconds: float = 20.0
    session_timeout_s: float = 300.0  # 0: sessions never expire
    custom_losses: Dict[str, str] = field(default_factory=dict)
    keep_sampler_snapshots: int = 2
    checkpoint_sweep_s: float = 60.0  # seconds between deletions of expired checkpoints (ttl_seconds)
    sampling: bool = False
    sampler: Dict[str, Any] = field(default_factory=dict)  # VllmSampler keyword arguments


@dataclass
class _Session:
    session_id: str
    owner: str  # store.owner_of(the API key that created it): owns what its clients save
    last_seen: float = field(default_factory=time.monotonic)  # its last heartbeat (or creation)
    finished: bool = False
    models: List[str] = field(default_factory=list)


@dataclass
class _SamplingSession:
    sampling_session_id: str
    folder: Optional[str]  # None: the base model
    model_path: Optional[str]  # tinker:// path it was created from (named checkpoints)


class Service:
    def __init__(self, opts: ServiceOptions, *, sampler=None):
        from transformers import AutoConfig

        self.opts = opts
        self.hf_config = AutoConfig.from_pretrained(opts.model_path)
        self.objectives = ObjectiveTable(opts.custom_losses)
        self.store = CheckpointStore(opts.checkpoint_dir)
        self.futures = FutureStore(max_bytes=opts.max_future_bytes)
        self.executor = Executor(self._run_batch, max_batch_size=opts.max_merged_datums)
        self.sequencer = Sequencer(self.executor.put, max_pending=opts.max_pending_requests)
        self.sampler = sampler
        self.sampled = SampledSequences(opts.max_recorded_sequences)  # what provenance spans may name
        self.sample_executor = Executor(self._run_samples, max_batch_size=64, name="sample") if sampler else None
        self.sessions: Dict[str, _Session] = {}
        self.models: Dict[str, Any] = {}  # model id -> FullModel | LoraSlot (compute thread writes)
        self.model_meta: Dict[str, dict] = {}  # model id -> get_info data (set at create_model)
        self.sampling_sessions: Dict[str, _SamplingSession] = {}
        self._created: Dict[Tuple[str, int], str] = {}  # (session, model_seq_id) -> create request id
        self._samples: Dict[Tuple[str, int], Tuple[str, list]] = {}  # (sampler, seq_id) -> (rid, ids)
        self._ephemeral: Dict[str, List[Path]] = {}  # model id -> ephemeral sampler folders (oldest first)
        self._pool = None  # LoraPool, built with the first LoRA client
        self._lock = threading.Lock()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(opts.model_path)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0))
        self._closed = threading.Event()
        if opts.session_timeout_s > 0:
            threading.Thread(target=self._expire_sessions, name="dsrl-serve-sessions", daemon=True).start()
        threading.Thread(target=self._sweep_checkpoints, name="dsrl-serve-ttl", daemon=True).start()

    # ================================================================== session-level (sync)
    def client_config(self) -> dict:
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                "parallel_fwdbwd_chunks": True, "fwdbwd_max_chunk_len": int(self.opts.max_chunk_datums),
                "custom_loss_server_side": False, "sample_use_retrieve_futures": False,
                "sample_join_sampling_session": False}

    def create_session(self, body: dict, api_key: str = "") -> dict:
        check_fields("create_session", body)
        sid = f"s-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self.sessions[sid] = _Session(sid, owner_of(api_key))
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, session_id: str) -> bool:
        """Record a heartbeat; False if the session is unknown or finished (the SDK stops on 410)."""
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None or s.finished:
            return False
        s.last_seen = time.monotonic()
        return True

    def _expire_sessions(self) -> None:
        """Finish every session silent for serve.session_timeout_s (the SDK beats every 10 s): a
        client process that died frees its LoRA slots and engines instead of holding them forever."""
        timeout = float(self.opts.session_timeout_s)
        while not self._closed.wait(min(5.0, timeout / 4)):
            now = time.monotonic()
            with self._lock:
                silent = [sid for sid, s in self.sessions.items() if not s.finished and now - s.last_seen > timeout]
            for sid in silent:
                log.warning("serve: session %s sent no heartbeat for %.0f s (serve.session_timeout_s): finished, "
                            "its training clients released", sid, timeout)
                self.finish_session(sid)

    def _sweep_checkpoints(self) -> None:
        """Delete the checkpoints whose ttl_seconds ran out, every serve.checkpoint_sweep_s (one
        that is touched before a sweep is refused and deleted then, see dsrl.serve.store)."""
        while not self._closed.wait(float(self.opts.checkpoint_sweep_s)):
            try:
                for path in self.store.collect_expired():
                    log.info("serve: checkpoint %s expired (ttl_seconds) and was deleted", path)
            except OSError:  # a folder removed under the sweep: the next one sees the rest
                log.warning("serve: the sweep of expired checkpoints failed; retried in %.0f s",
                            self.opts.checkpoint_sweep_s, exc_info=True)

    def finish_session(self, session_id: str) -> None:
        """Mark the session finished and free its training clients (after their queued work)."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None or s.finished:
                return
            s.finished = True
            models = list(s.models)
        self.sampled.forget_session(session_id)
        for mid in models:
            for seq_id, op in self.sequencer.close(mid):  # arrived early; the gap before it never came
                self.futures.fail(op.request_id, UserError(
                    f"{mid}: session {session_id} finished while request seq_id {seq_id} waited for an earlier "
                    "seq_id that never arrived; it did not run"))
            self.executor.put([Op("release", mid, "", payload=None)])

    def capabilities(self) -> dict:
        context = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0)
        return {"supported_models": [{"model_name": self.opts.model_name, "trainable": True,
                                      "sampleable": self.sampler is not None, "max_context_length": context}]}

    def _session(self, session_id: Any, what: str) -> _Session:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None:
            raise UserError(f"{what}: unknown session_id {session_id!r}")
        if s.finished:
            raise UserError(f"{what}: session {session_id!r} has finished")
        return s

    # ================================================================== training clients
    def _check_base(self, base_model: Optional[str], what: str) -> None:
        if base_model is not None and base_model not in (self.opts.model_name, self.opts.model_path):
            raise UserError(f"{what}: base_model {base_model!r} is not served here; this server trains "
                            f"{self.opts.model_name!r}")

    def _register_model(self, session: _Session, model_seq_id: Any, what: str) -> Tuple[str, Optional[str]]:
        """The model id of (session, model_seq_id) and, for a retried create, its first request id."""
        if isinstance(model_seq_id, bool) or not isinstance(model_seq_id, int) or model_seq_id < 0:
            raise UserError(f"{what}: model_seq_id must be an integer >= 0")
        model_id = f"{session.session_id}:train:{model_seq_id}"
        key = (session.session_id, model_seq_id)
        return model_id, self._created.get(key)

    def create_model(self, body: dict) -> dict:
        what = "create_model"
        check_fields(what, body)
        session = self._session(body.get("session_id"), what)
        model_id, previous = self._register_model(session, body.get("model_seq_id"), what)
        if previous is not None:
            return {"request_id": previous, "model_id": model_id}
        self._check_base(field_of(body, "base_model", str, what), what)
        check_optimizer_config(body.get("optimizer_config"), what)
        spec = parse_lora(body.get("lora_config"), what, self.opts.max_lora_rank, self.opts.lora_alpha)
        self._check_capacity(spec, what)
        return self._start_model(session, model_id, spec, body.get("user_metadata"), load=None)

    def _check_capacity(self, spec, what: str) -> None:
        if spec is None and not self.opts.allow_full_parameter:
            raise UserError(f"{what}: full-parameter clients are disabled (serve.allow_full_parameter=false); "
                            f"ask for a LoRA rank >= 1")
        live = [m for m in self.model_meta.values() if not m.get("released")]
        if spec is not None:
            n_lora = sum(1 for m in live if m["is_lora"])
            if n_lora >= self.opts.max_lora_slots:
                raise UserError(f"{what}: all {self.opts.max_lora_slots} LoRA slots are in use (serve.max_lora_slots)")
        elif sum(1 for m in live if not m["is_lora"]) >= self.opts.max_full_clients:
            raise UserError(f"{what}: {self.opts.max_full_clients} full-parameter clients exist already, each with "
                            f"its own DeepSpeed engine (serve.max_full_clients); release one or ask for a LoRA rank >= 1")

    def _start_model(self, session: _Session, model_id: str, spec, user_metadata, load) -> dict:
        rid = self.futures.create()
        with self._lock:
            self._created[(session.session_id, int(model_id.rsplit(":", 1)[1]))] = rid
            session.models.append(model_id)
            self.model_meta[model_id] = {"is_lora": spec is not None, "lora_rank": spec.rank if spec else 0,
                                         "user_metadata": user_metadata or {}, "owner": session.owner,
                                         "created_at": time.time()}
        self.sequencer.open(model_id, first_seq=1)
        self.executor.put([Op("create", model_id, rid, payload=(spec, load))])
        return {"request_id": rid, "model_id": model_id}

    def get_info(self, body: dict) -> dict:
        check_fields("get_info", body)
        model_id = field_of(body, "model_id", str, "get_info")
        meta = self.model_meta.get(model_id)
        if meta is None:
            raise UserError(f"get_info: unknown model_id {model_id!r}")
        arch = (getattr(self.hf_config, "architectures", None) or [self.hf_config.model_type])[0]
        return {"type": "get_info", "model_id": model_id, "is_lora": meta["is_lora"],
                "lora_rank": meta["lora_rank"] or None, "model_name": self.opts.model_name,
                "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": arch, "model_name": self.opts.model_name, "tokenizer_id": self.opts.model_path}}

    # ------------------------------------------------------------------ sequenced requests
    def _sequenced(self, model_id: Any, seq_id: Any, what: str, make_op) -> dict:
        """Submit one ordered request; always answers with a future (a bad one fails)."""
        if not isinstance(model_id, str) or model_id not in self.model_meta:
            raise UserError(f"{what}: unknown model_id {model_id!r}")
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise UserError(f"{what}: seq_id must be an integer")
        if not self.sequencer.is_open(model_id):
            raise UserError(f"{what}: training client {model_id!r} was released")
        try:
            rid, _ = self.sequencer.submit(model_id, seq_id, self.futures.create, make_op)
        except ValueError as e:
            rid = self.futures.create()
            self.futures.fail(rid, UserError(f"{what}: {e}"))
        except KeyError:
            raise UserError(f"{what}: training client {model_id!r} was released") from None
        return {"request_id": rid, "model_id": model_id}

    @staticmethod
    def _checked(what: str, make):
        """make_op that turns a UserError raised while building the op into a failed op (the
        request still consumes its seq_id, so the client's later requests are not stuck)."""
        def make_op(rid):
            try:
                return make(rid)
            except UserError as e:
                return Op("fail", "", rid, payload=e)
        return make_op

    def decode_forward_backward(self, body: bytes, content_encoding: str = "") -> wire.ForwardBackwardCall:
        """The request of a forward/forward_backward body (zstd or plain). Pure CPU work on the
        bytes, no state touched: the HTTP layer runs it on a worker thread. UserError: an
        unreadable body (no seq_id to consume); a request over the limits comes back with
        ``error`` set and fails alone when submitted."""
        if content_encoding.lower() == "zstd":
            import zstandard

            limit = self.opts.max_request_bytes
            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
            except zstandard.ZstdError as e:
                raise UserError(f"forward_backward: the zstd body does not decompress within "
                                f"serve.max_request_bytes={limit} ({e})") from None
        return wire.decode_forward_backward(body, max_datums=self.opts.max_chunk_datums,
                                            max_tokens=self.opts.max_datum_tokens)

    def forward_backward(self, call: wire.ForwardBackwardCall) -> dict:
        """Submit a request decoded by `decode_forward_backward`."""
        what = "forward" if call.forward_only else "forward_backward"

        def make(rid):
            if call.error is not None:
                raise call.error
            if any(d.spans for d in call.data):
                self.sampled.check(call.data, call.model_id.split(":train:")[0])
            obj = self.objectives.resolve(call.loss_fn, call.loss_fn_config)
            model_key = None
            meta_group = ("lora",) if self.model_meta[call.model_id]["is_lora"] else ("full", call.model_id)
            if obj.merge_key is not None:
                model_key = ("fwdbwd", meta_group, obj.merge_key, call.forward_only)
            return Op("fwdbwd", call.model_id, rid, payload=(obj, call.forward_only, call.data, call.loss_fn),
                      merge_key=model_key, size=max(1, len(call.data)))
        return self._sequenced(call.model_id, call.seq_id, what, self._checked(what, make))

    def optim_step(self, body: dict) -> dict:
        model_id = body.get("model_id")

        def make(rid):
            check_fields("optim_step", body)
            params = parse_adam(body)
            key = ("optim", "lora") if self.model_meta[model_id]["is_lora"] else None
            return Op("optim", model_id, rid, payload=params, merge_key=key, merges_within_lane=False)
        return self._sequenced(model_id, body.get("seq_id"), "optim_step", self._checked("optim_step", make))

    def save_weights(self, body: dict) -> dict:
        model_id = body.get("model_id")

        def make(rid):
            check_fields("save_weights", body)
            name = check_name(field_of(body, "path", str, "save_weights"), "save_weights: path")
            ttl = check_ttl(body.get("ttl_seconds"), "save_weights")
            return Op("save_state", model_id, rid, payload=(name, bool(body.get("overwrite", False)),
                                                            body.get("user_metadata"), ttl))
        return self._sequenced(model_id, body.get("seq_id"), "save_weights", self._checked("save_weights", make))

    def save_weights_for_sampler(self, body: dict) -> dict:
        model_id = body.get("model_id")
        what = "save_weights_for_sampler"

        def make(rid):
            check_fields(what, body)
            name = body.get("path")
            ttl = check_ttl(body.get("ttl_seconds"), what)
            if name is not None:
                check_name(name, f"{what}: path")
                return Op("save_sampler", model_id, rid, payload=("named", name, ttl, body.get("user_metadata")))
            n = field_of(body, "sampling_session_seq_id", int, what)
            return Op("save_sampler", model_id, rid, payload=("ephemeral", n, ttl, None))
        return self._sequenced(model_id, body.get("seq_id"), what, self._checked(what, make))

    def load_weights(self, body: dict, api_key: str = "") -> dict:
        what = "load_weights"
        owner = owner_of(api_key)
        optimizer = field_of(body, "optimizer", bool, what, required=False, default=False)
        if body.get("session_id") is not None:  # create-via-load: the new client's first request
            check_fields(what, body)
            session = self._session(body.get("session_id"), what)
            model_id, previous = self._register_model(session, body.get("model_seq_id"), what)
            if previous is not None:
                return {"request_id": previous, "model_id": model_id}
            self._check_base(body.get("base_model"), what)
            check_optimizer_config(body.get("optimizer_config"), what)
            ckpt = self.store.resolve(field_of(body, "path", str, what), "weights", owner=owner)
            spec = parse_lora(ckpt.meta.get("lora_config"), what, self.opts.max_lora_rank,
                              self.opts.lora_alpha) if ckpt.meta.get("is_lora") else None
            self._check_capacity(spec, what)
            return self._start_model(session, model_id, spec, body.get("user_metadata"), load=(ckpt, optimizer))
        model_id = body.get("model_id")

        def make(rid):
            check_fields(what, body)
            ckpt = self.store.resolve(field_of(body, "path", str, what), "weights", owner=owner)
            return Op("load_state", model_id, rid, payload=(ckpt, optimizer))
        return self._sequenced(model_id, body.get("seq_id"), what, self._checked(what, make))

    # ================================================================== sampling (sync part)
    def create_sampling_session(self, body: dict, api_key: str = "") -> dict:
        what = "create_sampling_session"
        check_fields(what, body)
        session = self._session(body.get("session_id"), what)
        n = field_of(body, "sampling_session_seq_id", int, what)
        sid = f"{session.session_id}:sample:{n}"
        path = body.get("model_path")
        if path is not None:
            ckpt = self.store.resolve(path, "sampler_weights", owner=owner_of(api_key))
            folder = str(ckpt.folder)
        else:
            self._check_base(field_of(body, "base_model", str, what), what)
            folder = None
        with self._lock:
            self.sampling_sessions.setdefault(sid, _SamplingSession(sid, folder, path))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def set_published(self, training_run_id: str, checkpoint_id: str, published: bool, api_key: str = "") -> None:
        """publish / unpublish ``tinker://<training_run_id>/<checkpoint_id>`` (owner only)."""
        self.store.set_published(f"tinker://{training_run_id}/{checkpoint_id}", owner_of(api_key), published)

    # ================================================================== checkpoints and runs (REST)
    def list_checkpoints(self, run_id: str, api_key: str = "") -> dict:
        """GET training_runs/{run}/checkpoints: the run's checkpoints this key may load, with expiry."""
        return {"checkpoints": self.store.entries(run_id, owner=owner_of(api_key))}

    def list_user_checkpoints(self, api_key: str = "", limit: int = 100, offset: int = 0) -> dict:
        """GET checkpoints: every checkpoint this key owns, newest first, one page."""
        if limit < 1 or offset < 0:
            raise UserError(f"checkpoints: limit={limit} must be >= 1 and offset={offset} >= 0")
        mine = self.store.entries(owner=owner_of(api_key), only_owner=True)[::-1]
        return {"checkpoints": mine[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(mine)}}

    def delete_checkpoint(self, run_id: str, checkpoint_id: str, api_key: str = "") -> None:
        self.store.delete(f"tinker://{run_id}/{checkpoint_id}", owner=owner_of(api_key))

    def set_checkpoint_ttl(self, run_id: str, checkpoint_id: str, body: dict, api_key: str = "") -> None:
        """PUT training_runs/{run}/checkpoints/{id}/ttl {"ttl_seconds": n | null} (owner only)."""
        ttl = check_ttl(body.get("ttl_seconds"), "checkpoint ttl")
        self.store.set_ttl(f"tinker://{run_id}/{checkpoint_id}", owner_of(api_key), ttl)

    def get_training_run(self, run_id: str, api_key: str = "") -> dict:
        """GET training_runs/{run}: the SDK's TrainingRun of a training client of this key (what
        this process knows of it, else what its checkpoints record); KeyError when neither."""
        owner = owner_of(api_key)
        ckpts = self.store.entries(run_id, owner=owner)
        meta = self.model_meta.get(run_id)
        if meta is not None and meta["owner"] != owner:
            raise KeyError(run_id)
        if meta is None:
            if not ckpts:
                raise KeyError(run_id)
            meta = self.store.resolve(ckpts[-1]["tinker_path"], owner=owner).meta
            lora_rank = (meta.get("lora_config") or {}).get("rank") or 0
            info = {"is_lora": bool(meta.get("is_lora")), "lora_rank": lora_rank, "owner": meta.get("owner") or "",
                    "user_metadata": {}, "created_at": meta.get("created_at", time.time())}
        else:
            info = meta
        last = {kind: [c for c in ckpts if c["checkpoint_type"] == kind] for kind in ("training", "sampler")}
        return {"training_run_id": run_id, "base_model": self.opts.model_name, "model_owner": info["owner"],
                "is_lora": bool(info["is_lora"]), "corrupted": False, "lora_rank": info["lora_rank"] or None,
                "last_request_time": iso_time(info["created_at"]),
                "last_checkpoint": last["training"][-1] if last["training"] else None,
                "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None,
                "user_metadata": {str(k): str(v) for k, v in (info.get("user_metadata") or {}).items()} or None}

    def get_sampler(self, sampler_id: str) -> dict:
        s = self.sampling_sessions.get(sampler_id)
        if s is None:
            raise KeyError(sampler_id)
        out = {"sampler_id": sampler_id, "base_model": self.opts.model_name}
        if s.model_path:
            out["model_path"] = s.model_path
        return out

    def asample(self, body: dict) -> dict:
        from dsrl.serve.sampler import SampleJob, parse_sampling_params

        what = "asample"
        sid = field_of(body, "sampling_session_id", str, what)
        seq_id = field_of(body, "seq_id", int, what)
        with self._lock:
            prior = self._samples.get((sid, seq_id))
        if prior is not None:
            return {"request_id": prior[0], "sample_sequence_ids": prior[1]}
        n = field_of(body, "num_samples", int, what, required=False, default=1)
        if not 1 <= n <= self.opts.max_num_samples:
            raise UserError(f"{what}: num_samples={n} must be in [1, {self.opts.max_num_samples}] "
                            f"(serve.max_num_samples)")
        rid = self.futures.create()
        ids = [f"{sid}:{seq_id}:{i}" for i in range(n)]
        with self._lock:
            self._samples[(sid, seq_id)] = (rid, ids)
        try:
            check_fields(what, body)
            if self.sampler is None:
                raise UserError(f"{what}: sampling is disabled on this server (serve.sampling=false)")
            session = self.sampling_sessions.get(sid)
            if session is None:
                raise UserError(f"{what}: unknown sampling_session_id {sid!r}")
            if session.model_path is not None:
                self.store.resolve(session.model_path)  # refused by name once it has expired or been deleted
            if body.get("target_prompt_logprobs") is not None:
                raise UserError(f"{what}: target_prompt_logprobs is not supported by this server")
            prompt = prompt_tokens(body.get("prompt"), int(self.hf_config.vocab_size), self.opts.max_datum_tokens)
            last_n = field_of(body, "prompt_logprobs_last_n", int, what, required=False)
            if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
                raise UserError(f"{what}: prompt_logprobs_last_n={last_n} must be in [1, len(prompt) - 1]")
            job = SampleJob(prompt=prompt, num_samples=n, prompt_logprobs=bool(body.get("prompt_logprobs") or False),
                            prompt_logprobs_last_n=last_n, **parse_sampling_params(body.get("sampling_params") or {}))
            self.sample_executor.put([Op("sample", rid, rid, payload=job, merge_key=("sample", session.folder),
                                         size=n, extra={"session_id": sid.split(":sample:")[0],
                                                        "sequence_ids": ids, "prompt": prompt})])
        except UserError as e:
            self.futures.fail(rid, e)
        return {"request_id": rid, "sample_sequence_ids": ids}

    # ================================================================== compute thread
    def _run_batch(self, batch: List[Op]) -> None:
        kind = batch[0].kind
        try:
            getattr(self, f"_do_{kind}")(batch)
        except Exception as e:  # each op's future fails; the server keeps serving
            if not isinstance(e, UserError):
                log.exception("serve: %s failed", kind)
            for op in batch:
                if op.request_id and not self.futures.done(op.request_id):
                    self.futures.fail(op.request_id, e)

    def _model(self, model_id: str):
        model = self.models.get(model_id)
        if model is None:
            raise UserError(f"training client {model_id!r} does not exist (failed to build or released)")
        return model

    def _do_fail(self, batch: List[Op]) -> None:
        for op in batch:
            self.futures.fail(op.request_id, op.payload)

    def _do_create(self, batch: List[Op]) -> None:
        (op,) = batch
        spec, load = op.payload
        try:
            model = self._build_model(op.lane, spec)
            if load is not None:
                try:
                    self._load_into(model, load[0], load[1])
                except BaseException:
                    model.release()  # a failed load frees its slot (or engine) before the error is answered
                    raise
        except BaseException:
            meta = self.model_meta.get(op.lane)
            if meta is not None:  # no longer counted against serve.max_lora_slots / max_full_clients
                meta["released"] = True
            raise
        self.models[op.lane] = model
        if load is not None:
            ckpt = load[0]
            self.futures.resolve(op.request_id, JsonReply({"type": "load_weights", "path": ckpt.tinker_path,
                                                           "model_id": op.lane}))
        else:
            self.futures.resolve(op.request_id, JsonReply({"type": "create_model", "model_id": op.lane}))

    def _build_model(self, model_id: str, spec):
        o = self.opts
        if spec is None:
            from dsrl.serve.full_model import build_full_model

            return build_full_model(model_id, o.model_path, zero_stage=o.zero_stage, dtype=o.dtype,
                                    attn_implementation=o.attn_implementation, micro_batch_size=o.micro_batch_size,
                                    pad_id=self.pad_id, persistence_threshold=o.persistence_threshold)
        import torch

        from dsrl.serve.lora import LoraPool, LoraSlot

        if self._pool is None:
            self._pool = LoraPool(o.model_path, dtype=getattr(torch, o.dtype),
                                  attn_implementation=o.attn_implementation, micro_batch_size=o.micro_batch_size,
                                  pad_id=self.pad_id)
        tag = "slot_" + model_id.replace(":", "_").replace("-", "_")
        self._pool.add_slot(tag, spec)
        return LoraSlot(model_id, self._pool, tag, spec)

    def _do_release(self, batch: List[Op]) -> None:
        for op in batch:
            model = self.models.pop(op.lane, None)
            if model is not None:
                model.release()
            meta = self.model_meta.get(op.lane)
            if meta is not None:
                meta["released"] = True
            for folder in self._ephemeral.pop(op.lane, []):
                _remove_tree(folder)

    def _do_fwdbwd(self, batch: List[Op]) -> None:
        """One forward (and backward) for every request of the batch; each request gets its own
        datums' outputs and loss:sum. A request whose datums fail validation fails alone. One
        that fails part-way (a custom loss that raises, out of memory), after some microbatches
        went backward, leaves no gradient behind: every client of the batch gets back the
        gradient it had before; a merged batch then runs again request by request, so that only
        the failing request fails."""
        models = [self._model(op.lane) for op in batch]
        session = models[0].session
        obj, forward_only, _, loss_fn = batch[0].payload
        what = "forward" if forward_only else "forward_backward"
        prepared, owners, tags, ok = [], [], [], []
        for i, (op, model) in enumerate(zip(batch, models)):
            try:
                items = session.validate(op.payload[2], loss_fn, required=op.payload[0].required)
            except ValueError as e:
                self.futures.fail(op.request_id, UserError(f"{what}: {e}"))
                continue
            ok.append(i)
            prepared.extend(items)
            owners.extend([i] * len(items))
            tags.extend([model.tag] * len(items))
        if not ok:
            return
        involved = list({id(models[i]): models[i] for i in ok}.values())
        saved = [] if forward_only else [m.gradient_snapshot() for m in involved]
        try:
            out = session.run_prepared(prepared, obj.spec, obj.config, forward_only=forward_only,
                                       tags=tags if models[0].tag is not None else None)
        except Exception as e:
            for model, snapshot in zip(involved, saved):
                model.restore_gradients(snapshot)
            if len(ok) == 1:
                if isinstance(e, DatumError):  # the datums' contents, not the server: the client's to fix
                    raise UserError(f"{what}: {e}") from None
                raise
            for i in ok:  # each alone: _run_batch answers each request's future, failed or not
                self._run_batch([batch[i]])
            return
        for i in ok:
            outs = [o for o, who in zip(out.loss_fn_outputs, owners) if who == i]
            if len(ok) == 1:
                loss_sum = float(out.metrics["loss:sum"])
            else:  # a merged batch: this request's share, from its datums' per-token losses
                loss_sum = float(sum(o["elementwise_loss"].double().sum() for o in outs))
            reply = wire.encode_forward_backward_output(outs, {"loss:sum": loss_sum})
            self.futures.resolve(batch[i].request_id, ProtoReply(reply))

    def _do_optim(self, batch: List[Op]) -> None:
        models = [self._model(op.lane) for op in batch]
        if len(batch) == 1:
            metrics = {batch[0].request_id: models[0].optim_step(batch[0].payload)}
        else:  # several LoRA slots: one merged optimizer step, each slot clipped on its own
            if len({op.lane for op in batch}) != len(batch):
                raise RuntimeError("serve: one optimizer step got two optim_steps of one client")
            pool = models[0].pool
            per_tag = pool.step({m.tag: op.payload for m, op in zip(models, batch)})
            metrics = {op.request_id: per_tag[m.tag] for m, op in zip(models, batch)}
        for op in batch:
            self.futures.resolve(op.request_id, JsonReply({"type": "optim_step", "metrics": metrics[op.request_id]}))

    def _meta_for(self, model_id: str, model) -> dict:
        return {"model_id": model_id, "base_model": self.opts.model_name, "is_lora": bool(model.is_lora),
                "lora_config": model.lora_config, "has_optimizer": True,
                "owner": self.model_meta[model_id]["owner"], "published": False}

    def _do_save_state(self, batch: List[Op]) -> None:
        (op,) = batch
        model = self._model(op.lane)
        name, overwrite, user_metadata, ttl = op.payload
        meta = dict(self._meta_for(op.lane, model), user_metadata=user_metadata or {})
        ckpt = self.store.write(op.lane, "weights", name, meta, lambda d: model.save_state(d), overwrite=overwrite,
                                ttl_seconds=ttl)
        self.futures.resolve(op.request_id, JsonReply({"type": "save_weights", "path": ckpt.tinker_path}))

    def _load_into(self, model, ckpt, optimizer: bool) -> None:
        if bool(ckpt.meta.get("is_lora")) != bool(model.is_lora):
            held = "LoRA" if ckpt.meta.get("is_lora") else "full"
            raise UserError(f"load_weights: {ckpt.tinker_path} holds a {held} state; this client is "
                            f"{'LoRA' if model.is_lora else 'full-parameter'}")
        if model.is_lora and ckpt.meta.get("lora_config", {}).get("rank") != model.lora_rank:
            raise UserError(f"load_weights: {ckpt.tinker_path} has LoRA rank {ckpt.meta['lora_config'].get('rank')}, "
                            f"this client {model.lora_rank}")
        model.load_state(ckpt.folder, optimizer=optimizer)

    def _do_load_state(self, batch: List[Op]) -> None:
        (op,) = batch
        ckpt, optimizer = op.payload
        self._load_into(self._model(op.lane), ckpt, optimizer)
        self.futures.resolve(op.request_id, JsonReply({"type": "load_weights", "path": ckpt.tinker_path,
                                                       "model_id": op.lane}))

    def _do_save_sampler(self, batch: List[Op]) -> None:
        (op,) = batch
        model = self._model(op.lane)
        mode, arg, ttl, user_metadata = op.payload
        meta = self._meta_for(op.lane, model)
        if mode == "named":
            ckpt = self.store.write(op.lane, "sampler_weights", arg, dict(meta, user_metadata=user_metadata or {}),
                                    model.export_sampler, ttl_seconds=ttl)
            reply = {"type": "save_weights_for_sampler", "path": ckpt.tinker_path}
            self.futures.resolve(op.request_id, JsonReply(reply))
            return
        session_id = op.lane.split(":train:")[0]
        sid = f"{session_id}:sample:{arg}"
        ckpt = self.store.write(op.lane, "sampler_weights", f"ephemeral-{arg}", dict(meta, ephemeral=True),
                                model.export_sampler, overwrite=True, ttl_seconds=ttl)
        with self._lock:
            self.sampling_sessions[sid] = _SamplingSession(sid, str(ckpt.folder), None)
            kept = self._ephemeral.setdefault(op.lane, [])
            kept.append(ckpt.folder)
            old = kept[:-self.opts.keep_sampler_snapshots] if len(kept) > self.opts.keep_sampler_snapshots else []
            del kept[:len(old)]
        for folder in old:
            _remove_tree(folder)
        self.futures.resolve(op.request_id, JsonReply({"type": "save_weights_for_sampler", "sampling_session_id": sid}))

    # ================================================================== sampling thread
    def _run_samples(self, batch: List[Op]) -> None:
        try:
            self.sampler.use_weights(batch[0].merge_key[1])  # all ops of a batch share one weights folder
            results = self.sampler.generate([op.payload for op in batch])
        except Exception as e:
            if not isinstance(e, UserError):
                log.exception("serve: sampling failed")
            for op in batch:
                self.futures.fail(op.request_id, e)
            return
        for op, (seqs, prompt_lps) in zip(batch, results):
            self.sampled.record(op.extra["session_id"], op.extra["sequence_ids"], op.extra["prompt"],
                                [seq.tokens for seq in seqs])
            self.futures.resolve(op.request_id, ProtoReply(wire.encode_sample_response(seqs, prompt_lps)))

    # ================================================================== lifecycle
    def close(self) -> None:
        self._closed.set()
        self.executor.stop()
        if self.sample_executor is not None:
            self.sample_executor.stop()
        if self.sampler is not None:
            self.sampler.close()


def _remove_tree(folder) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
