"""Reading the JSON bodies of the wire: every check raises a `UserError` that names the request
and the field, before anything is queued."""
from __future__ import annotations

import math
from typing import Any, List, Optional

from dsrl.actor.work_units import AdamParams
from dsrl.serve.errors import UserError


# The fields of each JSON request of the SDK 0.38 wire that this server reads and honours. Any
# other field sent with a value other than its empty default (None, False, 0, "", [], {}) is
# refused, naming it: a request is never run as if that field had not been set. ("type" names
# the request itself.) docs/guides/tinker.md lists what is refused and why.
HONOURED = {
    "create_session": {"tags", "user_metadata", "sdk_version", "project_id", "display_name"},
    "session_heartbeat": {"session_id"},
    "create_model": {"session_id", "model_seq_id", "base_model", "user_metadata", "lora_config", "optimizer_config"},
    "get_info": {"model_id"},
    "optim_step": {"model_id", "seq_id", "adam_params", "optim_params", "optimizer_params"},
    "save_weights": {"model_id", "path", "seq_id", "overwrite", "user_metadata", "ttl_seconds"},
    "save_weights_for_sampler": {"model_id", "path", "sampling_session_seq_id", "seq_id", "kind", "ttl_seconds",
                                 "user_metadata"},
    "load_weights": {"model_id", "seq_id", "session_id", "model_seq_id", "base_model", "user_metadata", "path",
                     "optimizer", "optimizer_config"},
    "create_sampling_session": {"session_id", "sampling_session_seq_id", "base_model", "model_path"},
    "asample": {"num_samples", "prompt", "sampling_params", "sampling_session_id", "seq_id", "prompt_logprobs",
                "prompt_logprobs_last_n",
                "target_prompt_logprobs"},  # refused by asample even when empty: any target is unsupported
    "retrieve_future": {"request_id", "allow_metadata_only"},  # metadata-only is a permission, not a demand
}
# Why some of them are refused (the rest: "not supported by this server").
_REFUSED_BECAUSE = {
    "weights_access_token": "checkpoints of other accounts are reached by publishing them",
    "record_stability_info": ("the stability information StableReinforce reads is not published, and this server "
                              "does not offer stable_reinforce (docs/guides/tinker.md)"),
    "base_model": "sample through a sampling session (create_sampling_session names the model)",
    "model_path": "sample through a sampling session (create_sampling_session names the checkpoint)",
}


def check_fields(what: str, body: dict) -> None:
    """UserError naming the first field of ``body`` that request ``what`` does not honour and
    that carries a value (see HONOURED)."""
    honoured = HONOURED[what]
    for key, value in body.items():
        if key == "type" or key in honoured or value in (None, False, 0, "", [], {}):
            continue
        why = _REFUSED_BECAUSE.get(key, "it is not supported by this server")
        raise UserError(f"{what}: field {key!r} is set ({str(value)[:60]!r}), but {why}")
    kind = body.get("kind")
    if what == "save_weights_for_sampler" and kind not in (None, "snapshot"):
        raise UserError(f"save_weights_for_sampler: kind={kind!r} is not supported by this server (only 'snapshot')")


def field_of(body: dict, key: str, types, what: str, *, required: bool = True, default=None):
    """body[key] checked against ``types`` (a bool is not an int here)."""
    if key not in body or body[key] is None:
        if required:
            raise UserError(f"{what}: missing field {key!r}")
        return default
    value = body[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise UserError(f"{what}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def parse_adam(body: dict) -> AdamParams:
    """The optim_step request's AdamW settings (AdamW is the only optimizer served)."""
    if body.get("optimizer_params") is not None:
        kind = body["optimizer_params"].get("type") if isinstance(body["optimizer_params"], dict) else None
        raise UserError(f"optim_step: optimizer {kind!r} is not supported by this server (AdamW only)")
    raw = body.get("adam_params", body.get("optim_params"))
    if not isinstance(raw, dict):
        raise UserError("optim_step: missing field 'adam_params'")
    fields = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"}
    unknown = sorted(set(raw) - fields - {"type"})
    if unknown:
        raise UserError(f"optim_step: adam_params has unknown field(s) {unknown}")
    p = AdamParams()
    for k in fields:
        if k in raw:
            v = raw[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise UserError(f"optim_step: adam_params.{k} must be a finite number, got {v!r}")
            setattr(p, k, float(v))
    checks = [(p.learning_rate >= 0, "learning_rate must be >= 0"), (0 <= p.beta1 < 1, "beta1 must be in [0, 1)"),
              (0 <= p.beta2 < 1, "beta2 must be in [0, 1)"), (p.eps > 0, "eps must be > 0"),
              (p.weight_decay >= 0, "weight_decay must be >= 0"),
              (p.grad_clip_norm >= 0, "grad_clip_norm must be >= 0")]
    for ok, msg in checks:
        if not ok:
            raise UserError(f"optim_step: adam_params.{msg}")
    return p


def parse_lora(lora: Optional[dict], what: str, max_rank: int, alpha: float):
    """A create_model lora_config -> LoraSpec, or None for a full-parameter client (no config or
    rank 0)."""
    from dsrl.serve.lora import LoraSpec

    if lora is None:
        return None
    if not isinstance(lora, dict):
        raise UserError(f"{what}: lora_config must be an object")
    rank = lora.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UserError(f"{what}: lora_config.rank must be an integer >= 0 (0 = full-parameter training)")
    if rank == 0:
        return None
    if rank > max_rank:
        raise UserError(f"{what}: lora_config.rank={rank} exceeds serve.max_lora_rank={max_rank}")
    flags = {k: lora.get(k, True) for k in ("train_attn", "train_mlp", "train_unembed")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise UserError(f"{what}: lora_config.{k} must be true or false")
    if not any(flags.values()):
        raise UserError(f"{what}: lora_config trains nothing (train_attn, train_mlp and train_unembed all false)")
    seed = lora.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise UserError(f"{what}: lora_config.seed must be an integer")
    return LoraSpec(rank=rank, alpha=float(alpha), seed=seed, **flags)


def check_optimizer_config(cfg: Any, what: str) -> None:
    if cfg is not None and (not isinstance(cfg, dict) or cfg.get("type", "adamw") != "adamw"):
        raise UserError(f"{what}: optimizer_config {cfg!r} is not supported (AdamW only)")


def prompt_tokens(prompt: Any, vocab: int, max_tokens: int) -> List[int]:
    """The token ids of an asample prompt ({"chunks": [{"type": "encoded_text", "tokens": [...]}]}),
    at most ``max_tokens`` of them (serve.max_datum_tokens, counted before any id is read)."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("asample: prompt must be {'chunks': [...]}")
    declared = sum(len(c["tokens"]) for c in prompt["chunks"] if isinstance(c, dict) and isinstance(c.get("tokens"), list))
    if declared > max_tokens:
        raise UserError(f"asample: prompt has {declared} tokens, more than serve.max_datum_tokens={max_tokens}")
    tokens: List[int] = []
    for j, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"asample: prompt chunk {j} is not encoded_text")
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise UserError(f"asample: prompt chunk {j}: tokens must be a list of integers")
        bad = [t for t in toks if t < 0 or t >= vocab]
        if bad:
            raise UserError(f"asample: prompt chunk {j}: token id {bad[0]} out of range [0, {vocab})")
        tokens.extend(toks)
    if not tokens:
        raise UserError("asample: prompt is empty")
    return tokens
