"""LoRA training clients (multi-LoRA slots of one PEFT pool) through the real SDK, the custom-loss
paths, and the ordering rules of the wire driven by raw HTTP: out-of-order seq_ids run in order,
a retried request gets its original request id and runs once, a rejected request still consumes
its seq_id."""
from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from serve_helpers import (
    KEY,
    MODEL_NAME,
    hold_compute,
    logprobs,
    random_batch,
    start_server,
)

pytestmark = pytest.mark.slow  # ~20 s


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    srv = start_server(tiny_model_path, tmp_path_factory.mktemp("serve_lora_store"), max_lora_slots=16,
                       allow_full_parameter=False, custom_losses={"sq": "serve_plugins.weighted_square"},
                       lora_alpha=16.0)
    yield srv
    srv.stop()


def _adam(lr=1e-2):
    from tinker import types

    return types.AdamParams(learning_rate=lr)


def _lora(sc, seed, rank=4, **kw):
    return sc.create_lora_training_client(MODEL_NAME, rank=rank, seed=seed, **kw).result()


def test_lora_info_and_full_parameter_refused(sc):
    import tinker

    tc = _lora(sc, seed=0, rank=8, train_mlp=False)
    info = tc.get_info()
    assert info.is_lora is True and info.lora_rank == 8
    refused = (tinker.RequestFailedError, tinker.BadRequestError)  # checked at submission: HTTP 400
    with pytest.raises(refused, match="full-parameter clients are disabled"):
        sc.create_lora_training_client(MODEL_NAME, rank=0).result()
    with pytest.raises(refused, match="not served here"):
        sc.create_lora_training_client("Qwen/Qwen3-8B", rank=4).result()


def test_concurrent_clients_are_isolated(sc, server):
    """A and B train at the same time: their requests share one forward and one optimizer step
    (held back until all four are queued); each ends where it would have alone (C and D), and an
    idle client E never moves."""
    a, b, c, d, e = (_lora(sc, seed=s) for s in (1, 2, 1, 2, 3))
    da, db = random_batch(3, "cross_entropy", seed=31), random_batch(2, "cross_entropy", seed=32)
    probe = random_batch(2, "cross_entropy", seed=33)
    e_before = logprobs(e.forward(probe, "cross_entropy").result())
    release, batches = hold_compute(server.service)
    futures = [a.forward_backward(da, "cross_entropy"), b.forward_backward(db, "cross_entropy"),
               a.optim_step(_adam()), b.optim_step(_adam(3e-2))]
    deadline = time.monotonic() + 30
    while server.service.executor.queued() < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    release.set()
    for f in futures:
        f.result()
    lanes = {a.model_id: "A", b.model_id: "B"}
    # One forward, one step. Within a batch the clients come in arrival order, and the SDK sends A's
    # and B's requests from threads of their own (seen: B's optim_step before A's).
    assert [sorted((k, lanes[m]) for k, m in batch) for batch in batches[:2]] == [
        [("fwdbwd", "A"), ("fwdbwd", "B")], [("optim", "A"), ("optim", "B")]]
    futures = []
    for _ in range(2):
        futures += [a.forward_backward(da, "cross_entropy"), b.forward_backward(db, "cross_entropy"),
                    a.optim_step(_adam()), b.optim_step(_adam(3e-2))]
    for f in futures:
        f.result()
    for _ in range(3):
        c.forward_backward(da, "cross_entropy").result()
        c.optim_step(_adam()).result()
    for _ in range(3):
        d.forward_backward(db, "cross_entropy").result()
        d.optim_step(_adam(3e-2)).result()
    la, lb, lc, ld = (logprobs(x.forward(probe, "cross_entropy").result()) for x in (a, b, c, d))
    for x, y in zip(la + lb, lc + ld):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-5)
    assert max(np.abs(x - y).max() for x, y in zip(la, lb)) > 1e-3  # they did train differently
    # E's probe runs alone both times (same batch): bit-exact unless E's adapter moved
    assert all(np.array_equal(x, y) for x, y in zip(e_before, logprobs(e.forward(probe, "cross_entropy").result())))


def test_lora_save_load_round_trip(sc):
    tc = _lora(sc, seed=5, rank=2)
    data, probe = random_batch(3, "ppo", seed=41), random_batch(2, "cross_entropy", seed=42)
    tc.forward_backward(data, "ppo").result()
    tc.optim_step(_adam()).result()
    path = tc.save_state("lora1").result().path
    tc.forward_backward(data, "ppo").result()
    tc.optim_step(_adam()).result()
    expected = logprobs(tc.forward(probe, "cross_entropy").result())
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().is_lora and resumed.get_info().lora_rank == 2
    resumed.forward_backward(data, "ppo").result()
    resumed.optim_step(_adam()).result()
    got = logprobs(resumed.forward(probe, "cross_entropy").result())
    for x, y in zip(expected, got):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_server_side_custom_loss_equals_client_side_custom_loss(sc):
    """loss_fn="custom" (one server pass) and the SDK's forward_backward_custom (forward, local
    autograd, cross-entropy with weights = -dC/dlp) give the same loss and the same update."""
    import torch

    x, y = _lora(sc, seed=7), _lora(sc, seed=7)
    data = random_batch(3, "cross_entropy", seed=51)

    def client_loss(batch, lps):
        total = sum((d.loss_fn_inputs["weights"].to_torch() * lp ** 2).sum() for d, lp in zip(batch, lps))
        return total, {}

    rx = x.forward_backward_custom(data, client_loss).result()
    x.optim_step(_adam()).result()
    ry = y.forward_backward(data, "custom", {"loss_id": "sq"}).result()
    y.optim_step(_adam()).result()
    assert rx.metrics["loss:sum"] == pytest.approx(ry.metrics["loss:sum"], rel=1e-5)
    lp = [torch.tensor(v) for v in logprobs(ry)]
    hand = float(sum((d.loss_fn_inputs["weights"].to_torch().double() * v ** 2).sum() for d, v in zip(data, lp)))
    assert ry.metrics["loss:sum"] == pytest.approx(hand, rel=1e-5)
    probe = random_batch(2, "cross_entropy", seed=52)
    for a, b in zip(logprobs(x.forward(probe, "cross_entropy").result()),
                    logprobs(y.forward(probe, "cross_entropy").result())):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def test_custom_loss_errors(sc):
    import tinker

    tc = _lora(sc, seed=8)
    data = random_batch(1, "cross_entropy", seed=53)
    with pytest.raises(tinker.RequestFailedError, match=r"loss_id.*'nope' is not one of \['sq'\]"):
        tc.forward(data, "custom", {"loss_id": "nope"}).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn_config key 'beta' for custom loss 'sq'"):
        tc.forward(data, "custom", {"loss_id": "sq", "beta": 1.0}).result()


# ------------------------------------------------------------------------------ raw wire
class Raw:
    """A bare HTTP client of the wire (no SDK): to send requests out of order and twice."""

    def __init__(self, url):
        self.http = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEY}, timeout=30)

    def post(self, path, body):
        r = self.http.post(path, json=body)
        r.raise_for_status()
        return r.json()

    def proto(self, msg):
        r = self.http.post("forward_backward", content=msg.SerializeToString(),
                           headers={"Content-Type": "application/x-protobuf"})
        r.raise_for_status()
        return r.json()

    def result(self, rid, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.http.post("retrieve_future", json={"request_id": rid},
                               headers={"Accept": "application/x-protobuf"})
            if r.headers["content-type"].startswith("application/x-protobuf"):
                return r.content
            body = r.json()
            if body.get("type") != "try_again":
                return body
        raise TimeoutError(rid)


def _fwdbwd_msg(model_id, seq_id, data, loss_fn="cross_entropy"):
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    return forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn), model_id=model_id,
        seq_id=seq_id))


def test_out_of_order_duplicates_and_rejected_seq_ids(server):
    from tinker.proto.response_conv import deserialize_forward_backward_output

    raw = Raw(server.url)
    sid = raw.post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})["session_id"]
    created = raw.post("create_model", {"session_id": sid, "model_seq_id": 0, "base_model": MODEL_NAME,
                                        "lora_config": {"rank": 2, "seed": 0}})
    again = raw.post("create_model", {"session_id": sid, "model_seq_id": 0, "base_model": MODEL_NAME,
                                      "lora_config": {"rank": 2, "seed": 0}})
    assert again["request_id"] == created["request_id"]  # a retried create does not build a second client
    mid = created["model_id"]
    assert raw.result(created["request_id"]) == {"type": "create_model", "model_id": mid}
    data = random_batch(2, "cross_entropy", seed=61)
    adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    # seq 3 (a forward) and seq 2 (optim_step) arrive before seq 1 (forward_backward).
    f3 = raw.proto(_fwdbwd_msg(mid, 3, data))
    f2 = raw.post("optim_step", {"model_id": mid, "seq_id": 2, "adam_params": adam})
    f1 = raw.proto(_fwdbwd_msg(mid, 1, data))
    dup = raw.proto(_fwdbwd_msg(mid, 1, data))
    assert dup["request_id"] == f1["request_id"]
    out1 = deserialize_forward_backward_output(raw.result(f1["request_id"]))
    step = raw.result(f2["request_id"])
    out3 = deserialize_forward_backward_output(raw.result(f3["request_id"]))
    assert step["type"] == "optim_step" and step["metrics"]["grad_norm:mean"] > 0
    # seq 3 ran after the step: its loss is lower than seq 1's on the same data.
    assert out3.metrics["loss:sum"] < out1.metrics["loss:sum"] - 1e-3
    # A rejected request (bad AdamW settings) fails but consumes seq 4; seq 5 still runs.
    bad = raw.post("optim_step", {"model_id": mid, "seq_id": 4, "adam_params": dict(adam, beta1=1.5)})
    fail = raw.result(bad["request_id"])
    assert fail["category"] == "user" and "adam_params.beta1 must be in [0, 1)" in fail["error"]
    ok = raw.proto(_fwdbwd_msg(mid, 5, data))
    assert deserialize_forward_backward_output(raw.result(ok["request_id"])).metrics["loss:sum"] != 0
    # Unknown futures are gone (410), unknown models are a user error.
    assert raw.http.post("retrieve_future", json={"request_id": "req-nope"}).status_code == 410
    r = raw.http.post("optim_step", json={"model_id": "s-none:train:0", "seq_id": 1, "adam_params": adam})
    assert r.status_code == 400 and "unknown model_id" in r.json()["error"]
    # Finishing the session frees its clients: heartbeats get 410, requests a clear error.
    beat = raw.post("session_heartbeat", {"session_id": sid, "type": "session_heartbeat"})
    assert beat == {"type": "session_heartbeat"}
    raw.post(f"sessions/{sid}/finish", {"reason": {"type": "success"}, "detail": None})
    assert raw.http.post("session_heartbeat", json={"session_id": sid}).status_code == 410
    r = raw.http.post("optim_step", json={"model_id": mid, "seq_id": 6, "adam_params": adam})
    assert r.status_code == 400 and "was released" in r.json()["error"]
    assert server.service.executor.idle(10) and mid not in server.service.models
