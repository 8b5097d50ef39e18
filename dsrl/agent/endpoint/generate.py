"""Token-in generation: POST /inference/v1/generate with {model, token_ids, sampling_params}, for
clients that render the chat template themselves (verifiers' training client, prime-rl).

The reply carries the sampled `token_ids` and their log-probs (`logprobs.content[i] = {"token":
"token_id:N", "logprob": x}`) in `choices[0]`. A call whose ids are the previous call's ids + its
sampled ids + more continues that sequence (the more as the agent's tokens, out of the loss); the
trained ids are exactly the ids the client sent and received.

sampling_params: max_tokens (per call, up to rollout.max_new_tokens), temperature / top_p (the
run's, or left out), n = 1, logprobs (any count: only the sampled token's log-prob is returned),
skip_special_tokens (the returned text only), stop_token_ids (only the model's end-of-turn ids, on
which the engine stops anyway), seed (ignored: the endpoint seeds each call). Anything else that
would change sampling (top_k, min_p, penalties, stop strings, ...) is refused, naming it."""
from __future__ import annotations

from typing import List, Optional

from dsrl.agent.endpoint.book import EndpointError

_NEUTRAL = {"top_k": (-1, 0), "min_p": (0, 0.0), "repetition_penalty": (1, 1.0), "presence_penalty": (0, 0.0),
            "frequency_penalty": (0, 0.0), "min_tokens": (0,), "stop": (None, [], ""), "ignore_eos": (False,),
            "include_stop_str_in_output": (False,), "spaces_between_special_tokens": (True,)}
_IGNORED = ("seed", "logprobs", "prompt_logprobs", "skip_special_tokens", "detokenize", "return_token_ids",
            "stop_token_ids", "n", "temperature", "top_p", "max_tokens", "max_completion_tokens")


def stop_ids(tokenizer) -> set:
    """The ids the engine stops on by itself: the tokenizer's end-of-sequence ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return ids


def check_generate(book, body: dict, vocab: int, eos: set) -> tuple:
    """(token ids, max_tokens, skip_special_tokens) of a generate request; refusals name the field."""
    ids = body.get("token_ids")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)):
        raise EndpointError(400, "invalid_token_ids", f"token_ids must be a non-empty list of token ids in "
                            f"[0, {vocab})", param="token_ids")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise EndpointError(400, "invalid_sampling_params", "sampling_params must be an object", param="sampling_params")
    for key, value in params.items():
        if key in _IGNORED:
            continue
        if key not in _NEUTRAL:
            raise EndpointError(400, "unsupported_field", f"sampling_params.{key} is not supported by the training "
                                "endpoint", param=f"sampling_params.{key}")
        if value not in _NEUTRAL[key] and value is not None:
            raise EndpointError(400, "unsupported_field", f"sampling_params.{key}={value!r}: it changes the sampling "
                                "distribution the trainer's log-probs assume", param=f"sampling_params.{key}")
    extra = [t for t in (params.get("stop_token_ids") or []) if t not in eos]
    if extra:
        raise EndpointError(400, "unsupported_field", f"sampling_params.stop_token_ids={extra}: only the model's "
                            f"end-of-sequence ids {sorted(eos)} stop a call", param="sampling_params.stop_token_ids")
    plain = {k: params[k] for k in ("n", "temperature", "top_p", "max_tokens", "max_completion_tokens") if k in params}
    max_tokens = book._check_sampling(plain)
    return list(ids), max_tokens, params.get("skip_special_tokens", True) is not False


def generate_reply(tokenizer, model: str, out: dict, skip_special: bool, episode_id: Optional[str]) -> dict:
    ids: List[int] = out["token_ids"]
    return {"id": f"gen-{episode_id}-{out['prompt_tokens']}", "object": "generate", "model": model,
            "choices": [{"index": 0, "token_ids": list(ids), "finish_reason": out["finish_reason"],
                         "text": tokenizer.decode(ids, skip_special_tokens=skip_special),
                         "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                                  for t, lp in zip(ids, out["logprobs"])]}}],
            "usage": {"prompt_tokens": out["prompt_tokens"], "completion_tokens": out["completion_tokens"],
                      "total_tokens": out["prompt_tokens"] + out["completion_tokens"]}}

