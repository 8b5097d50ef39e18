"""Provenance spans (SDK 0.38 ``Datum.with_provenance``) checked against what was sampled.

A datum may claim where its tokens came from: ``model_input_spans`` tile its input tokens,
``loss_fn_input_spans`` tile ``target_tokens``, each span naming a ``sequence_id`` (the SDK's
``SampledSequence.sequence_id``, session-scoped) and a run of that sequence's prompt or sampled
tokens. The server keeps every sequence it sampled (prompt and sampled tokens) and checks each
claim before the request runs: the sequence is known, it was sampled in the training client's
own session, the run lies inside it, and the datum's tokens there are that run's tokens. A
claim that fails fails its request, naming the datum, the span and what differs.

Retention: Tinker documents none, so this server states its own: the last
``serve.max_recorded_sequences`` sampled sequences of the whole server (oldest dropped first),
and none of a session after it finished. A span naming a dropped sequence fails as unknown."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from dsrl.serve.errors import UserError
from dsrl.serve.wire import WireDatum


@dataclass(frozen=True)
class _Sampled:
    session_id: str
    prompt: np.ndarray  # int64 token ids
    tokens: np.ndarray  # int64 token ids, as returned to the client


class SampledSequences:
    def __init__(self, keep: int):
        self._keep = int(keep)
        self._seqs: "OrderedDict[str, _Sampled]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seqs)

    def record(self, session_id: str, sequence_ids: Sequence[str], prompt: Sequence[int],
               sampled: Sequence[Sequence[int]]) -> None:
        """The sequences of one sample request (one prompt, one token list per sequence id)."""
        p = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            for sid, toks in zip(sequence_ids, sampled):
                self._seqs[sid] = _Sampled(session_id, p, np.asarray(toks, dtype=np.int64))
                self._seqs.move_to_end(sid)
            while len(self._seqs) > self._keep:
                self._seqs.popitem(last=False)

    def forget_session(self, session_id: str) -> None:
        with self._lock:
            for sid in [k for k, v in self._seqs.items() if v.session_id == session_id]:
                del self._seqs[sid]

    def check(self, data: List[WireDatum], session_id: str) -> None:
        """UserError naming the first datum and span whose claim does not hold (see module)."""
        for i, d in enumerate(data):
            fields = {"model_input_spans": d.model_input,
                      "loss_fn_input_spans": d.loss_fn_inputs.get("target_tokens")}
            for name, spans in d.spans.items():
                values = fields[name].numpy()
                pos = 0
                for j, span in enumerate(spans):
                    self._check_span(values[pos:pos + span.length], span, session_id, f"datum {i}: {name}[{j}]", pos)
                    pos += span.length

    def _check_span(self, got: np.ndarray, span, session_id: str, where: str, pos: int) -> None:
        with self._lock:
            rec = self._seqs.get(span.sequence_id)
        if rec is None:
            raise UserError(f"{where} names sequence_id {span.sequence_id!r}, which this server did not sample or no "
                            f"longer keeps (serve.max_recorded_sequences)")
        if rec.session_id != session_id:
            raise UserError(f"{where} names sequence_id {span.sequence_id!r}, sampled in another session")
        arm, source = ("sampled", rec.tokens) if span.sampled else ("prompt", rec.prompt)
        if span.offset + span.length > source.size:
            raise UserError(f"{where}: {arm} tokens [{span.offset}, {span.offset + span.length}) of "
                            f"{span.sequence_id!r} run past its {source.size} {arm} tokens")
        want = source[span.offset:span.offset + span.length]
        if not np.array_equal(got, want):
            k = int(np.flatnonzero(got != want)[0])
            raise UserError(f"{where}: position {pos + k} holds token {int(got[k])}, but {arm} token "
                            f"{span.offset + k} of {span.sequence_id!r} is {int(want[k])}")
