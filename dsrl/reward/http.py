"""Rewards from a server (`reward.url`): each completion is POSTed as JSON and the server answers
with its reward. A user's reward model or sandbox runs as a service; dsrl only needs its URL.

Request body: {"completion": str, "prompt": str (the last user message), "messages": [...],
"answer": str, "meta": {...}}. Response: a JSON number, or an object with a numeric "reward".

A failed attempt (connection refused, HTTP 5xx or 429, a timeout, a body that is not a reward)
is retried up to `retries` times with a short exponential back-off, all inside the sample's
time budget; HTTP 4xx other than 429 is the request's fault and is not retried. What still fails
raises, and dsrl.rollout.rewards.RewardGuard scores the sample 0 and counts it."""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from typing import Any, Optional

_RETRY_STATUS = {429, 500, 502, 503, 504}
_BACKOFF_S = 0.2  # first back-off; doubles after each failed attempt


class RewardServerError(RuntimeError):
    """The reward server gave no usable reward for a sample."""


class RemoteReward:
    """fn(completion_text, prompt) -> float backed by an HTTP endpoint."""

    def __init__(self, url: str, *, timeout_s: float, retries: int = 2, headers: Optional[dict] = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.url={url!r} must start with http:// or https://")
        self.url, self.timeout_s, self.retries = url, float(timeout_s), int(retries)
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r})"

    def __call__(self, text: str, prompt: Any) -> float:
        body = json.dumps(_payload(text, prompt)).encode()
        deadline = time.monotonic() + self.timeout_s
        backoff, causes = _BACKOFF_S, []
        for attempt in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return self._post(body, left)
            except _Retryable as e:
                causes.append(f"attempt {attempt + 1}: {e}")
            if attempt < self.retries:
                time.sleep(min(backoff, max(deadline - time.monotonic(), 0.0)))
                backoff *= 2
        raise RewardServerError(f"{self.url}: no reward after {len(causes)} attempt(s) within "
                                f"{self.timeout_s:g} s ({'; '.join(causes) or 'time budget spent'})")

    def _post(self, body: bytes, timeout: float) -> float:
        req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if e.code in _RETRY_STATUS:
                raise _Retryable(f"HTTP {e.code}") from None
            raise RewardServerError(f"{self.url}: HTTP {e.code} {e.reason} (not retried)") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        return _reward_from(raw, self.url)


class _Retryable(Exception):
    """One attempt failed in a way another attempt may not (internal)."""


def _payload(text: str, prompt: Any) -> dict:
    if hasattr(prompt, "messages"):
        return {"completion": text, "prompt": prompt.text, "messages": prompt.messages,
                "answer": prompt.answer, "meta": _jsonable(prompt.meta)}
    return {"completion": text, "prompt": str(prompt), "messages": [], "answer": None, "meta": {}}


def _jsonable(meta: dict) -> dict:
    """Prompt meta as JSON (values JSON cannot carry become their str)."""
    out = {}
    for k, v in (meta or {}).items():
        try:
            json.dumps(v)
            out[str(k)] = v
        except (TypeError, ValueError):
            out[str(k)] = str(v)
    return out


def _reward_from(raw: bytes, url: str) -> float:
    try:
        data = json.loads(raw)
    except ValueError:
        raise _Retryable(f"body is not JSON: {raw[:80]!r}") from None
    value = data.get("reward") if isinstance(data, dict) else data
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardServerError(f"{url}: the answer {raw[:120]!r} holds no finite number "
                                "(expected a number or {\"reward\": number})")
    return float(value)
