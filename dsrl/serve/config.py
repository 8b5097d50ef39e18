"""``serve.*`` checks (run with the project's `validate`, before anything heavy loads; every error
names its key) and the translation of the typed config into `ServiceOptions`.

What the service takes from the rest of the config: ``model.path`` (the base model; also its
tokenizer, served offline), ``model.dtype`` / ``model.attn_implementation`` (trainer),
``actor.zero_stage`` / ``actor.micro_batch_size`` / ``actor.stage3_param_persistence_threshold``
(full-parameter clients' DeepSpeed engines), ``rollout.*`` (the sampler's vLLM engine)."""
from __future__ import annotations

import os
from typing import List

from dsrl.serve.service import ServiceOptions

# The key in docs/guides/tinker.md and the example config: anyone may know it.
PUBLISHED_KEY = "tml-dsrl-local"


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: may resolve to anything


def serve_errors(cfg) -> List[str]:
    """Problems with ``cfg.serve`` (a typed Config), each naming its key."""
    s = cfg.serve
    errors = []
    if not isinstance(s.host, str) or not s.host:
        errors.append("serve.host must be an interface address such as 127.0.0.1")
    if not 0 <= int(s.port) <= 65535:
        errors.append(f"serve.port={s.port} must be in [0, 65535]")
    keys = list(s.api_keys or [])
    if not keys:
        errors.append("serve.api_keys is empty: every request must carry a key, give at least one (tml-...)")
    if PUBLISHED_KEY in keys and not _loopback(str(s.host)):
        errors.append(f"serve.api_keys holds the published default key {PUBLISHED_KEY!r} while serve.host={s.host!r} "
                      "is reachable from other machines: set your own key (tml-...) or bind 127.0.0.1")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k.startswith("tml-") or len(k) < 8:
            errors.append(f"serve.api_keys[{i}] must be a string starting with 'tml-' (the SDK refuses others), "
                          f"at least 8 characters")
    for key in ("max_lora_rank", "max_lora_slots", "max_chunk_datums", "max_merged_datums", "keep_sampler_snapshots",
                "max_datum_tokens", "max_num_samples", "max_request_bytes", "max_json_bytes", "max_full_clients",
                "max_pending_requests", "max_future_bytes", "max_recorded_sequences"):
        if int(getattr(s, key)) < 1:
            errors.append(f"serve.{key}={getattr(s, key)} must be >= 1")
    if s.lora_alpha <= 0:
        errors.append(f"serve.lora_alpha={s.lora_alpha} must be > 0")
    if not 1 <= s.long_poll_seconds <= 40:
        errors.append(f"serve.long_poll_seconds={s.long_poll_seconds} must be in [1, 40] "
                      f"(the SDK gives up on a poll after 45 s)")
    if not s.checkpoint_sweep_s > 0:
        errors.append(f"serve.checkpoint_sweep_s={s.checkpoint_sweep_s} must be > 0 (seconds between deletions of "
                      "expired checkpoints)")
    if s.session_timeout_s != 0 and s.session_timeout_s < 30:
        errors.append(f"serve.session_timeout_s={s.session_timeout_s} must be 0 (never) or >= 30 (the SDK sends a "
                      "heartbeat every 10 s)")
    if s.model_name is not None and (":" in s.model_name or not s.model_name.strip()):
        errors.append(f"serve.model_name={s.model_name!r} must be non-empty without ':' (the SDK cuts names at ':')")
    if s.allow_full_parameter and int(cfg.actor.zero_stage) != 0:
        errors.append(f"actor.zero_stage={cfg.actor.zero_stage}: the service's full-parameter clients run ZeRO-0 (one "
                      "process: stages 1-3 partition nothing here, and a request that fails part-way can have its "
                      "gradient put back only at stage 0); set actor.zero_stage=0 or serve.allow_full_parameter=false")
    losses = dict(s.custom_losses or {})
    malformed = [name for name, path in losses.items()
                 if not isinstance(path, str) or "." not in path.replace(":", ".")]
    for name in malformed:
        errors.append(f"serve.custom_losses.{name}={losses[name]!r} must be a dotted path 'pkg.module.fn'")
    if losses and not malformed:
        from dsrl.serve.objectives import ObjectiveTable

        try:  # load the custom losses now: an unloadable one fails here, naming its key
            ObjectiveTable(losses)
        except ValueError as e:
            errors.append(str(e))
    return errors


def options_from_config(cfg, model_path: str, run_dir: "str | os.PathLike[str]") -> ServiceOptions:
    """ServiceOptions of a validated, hardware-resolved typed config; ``model_path`` resolved."""
    s, m, a, r = cfg.serve, cfg.model, cfg.actor, cfg.rollout
    return ServiceOptions(
        model_path=str(model_path), model_name=s.model_name or str(m.path),
        checkpoint_dir=s.checkpoint_dir or os.path.join(str(run_dir), "checkpoints"),
        dtype=m.dtype, attn_implementation=m.attn_implementation, zero_stage=a.zero_stage,
        micro_batch_size=a.micro_batch_size, persistence_threshold=a.stage3_param_persistence_threshold,
        lora_alpha=float(s.lora_alpha), max_lora_rank=int(s.max_lora_rank), max_lora_slots=int(s.max_lora_slots),
        allow_full_parameter=bool(s.allow_full_parameter), max_chunk_datums=int(s.max_chunk_datums),
        max_merged_datums=int(s.max_merged_datums), long_poll_seconds=float(s.long_poll_seconds),
        session_timeout_s=float(s.session_timeout_s),
        max_datum_tokens=int(s.max_datum_tokens), max_num_samples=int(s.max_num_samples),
        max_request_bytes=int(s.max_request_bytes), max_json_bytes=int(s.max_json_bytes),
        max_full_clients=int(s.max_full_clients),
        max_pending_requests=int(s.max_pending_requests), max_future_bytes=int(s.max_future_bytes),
        max_recorded_sequences=int(s.max_recorded_sequences),
        custom_losses=dict(s.custom_losses or {}), keep_sampler_snapshots=int(s.keep_sampler_snapshots),
        checkpoint_sweep_s=float(s.checkpoint_sweep_s),
        sampling=bool(s.sampling),
        sampler=dict(dtype=r.dtype, seed=r.seed, max_model_len=r.max_model_len, kv_cache_gib=r.kv_cache_gib,
                     gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=bool(r.enforce_eager)))
