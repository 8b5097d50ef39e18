"""Server-sent events of the endpoint's streamed replies. The engine answers a call whole (calls
run in batches at the round's barrier), so a stream is written from the finished completion: its
pieces are the sampled tokens' text, in order, and a streamed call records exactly what the same
call unstreamed does."""
from __future__ import annotations

import json
from typing import Iterable, List, Optional, Sequence

from fastapi.responses import StreamingResponse


def sse_response(events: Iterable[dict], *, done: bool = True, named: bool = False) -> StreamingResponse:
    """`data: {json}` lines (with `event: {type}` before each when `named`, as the Responses API
    writes them), then `data: [DONE]` when `done`."""
    def lines():
        for ev in events:
            head = f"event: {ev['type']}\n" if named else ""
            yield f"{head}data: {json.dumps(ev)}\n\n"
        if done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def token_pieces(tokenizer, ids: Sequence[int], text: str, head: str = "") -> List[str]:
    """`text` (the returned text: `head` + the decoded ids, possibly cut at a stop string) split
    at the sampled tokens' boundaries: piece k is what token k adds to the decoded text (a token
    that ends inside a multi-byte character adds nothing until the next completes it). Empty
    pieces are dropped; the pieces join to `text`."""
    pieces, prev = [], ""
    if head:
        pieces.append(head)
    for k in range(len(ids)):
        cur = tokenizer.decode(list(ids[:k + 1]), skip_special_tokens=True)
        if cur.endswith("\ufffd"):
            continue  # an incomplete character: wait for the token that completes it
        pieces.append(cur[len(prev):])
        prev = cur
    out, at = [], 0
    for p in pieces:
        if at >= len(text):
            break
        p = p[:len(text) - at]
        out.append(p)
        at += len(p)
    if "".join(out) != text:  # not a prefix split (cannot happen with a consistent decoder): one piece
        return [text] if text else []
    return [p for p in out if p]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sampled_logprobs(tokenizer, ids: Sequence[int], logprobs: Sequence[float]) -> Optional[dict]:
    """Chat Completions' `logprobs.content` of the sampled tokens (no alternatives)."""
    toks = [tokenizer.decode([t]) for t in ids]
    return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                        for s, lp in zip(toks, logprobs)]}
