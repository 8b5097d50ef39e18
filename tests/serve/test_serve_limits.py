"""Hostile and oversized requests, and whose checkpoint is whose.

Each limit is a ``serve.*`` key, checked before anything of the request's size is allocated,
refused with an error naming the field and the key; the server serves on. The HTTP layer
decodes off the event loop, so one client's 100 MB request does not hold another client's
heartbeat. Checkpoints belong to the API key whose session wrote them."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch
from serve_helpers import KEY, MODEL_NAME, datum, service_client, start_server

from dsrl.serve.errors import UserError
from dsrl.serve.futures import FutureStore, JsonReply, ProtoReply
from dsrl.serve.requests import prompt_tokens
from dsrl.serve.sequencer import Sequencer
from dsrl.serve.store import CheckpointStore, owner_of

OTHER_KEY = "tml-serve-tests-other"


# ------------------------------------------------------------------------------ units
def test_sequencer_refuses_a_request_past_the_pending_window():
    """Requests waiting for an earlier seq_id hold their payloads: at most max_pending of them per
    client. The refused one is not recorded (it may be sent again); the next seq_id always runs."""
    ran = []
    seq = Sequencer(ran.extend, max_pending=2)
    seq.open("m")
    ids = iter(f"r{i}" for i in range(100))
    seq.submit("m", 3, lambda: next(ids), lambda rid: rid)
    seq.submit("m", 4, lambda: next(ids), lambda rid: rid)
    with pytest.raises(ValueError, match=r"seq_id 5 would wait behind seq_id 1 \(not received yet\) with 2 "
                                         r"requests of 'm' waiting already, the most "
                                         r"serve.max_pending_requests=2 allows"):
        seq.submit("m", 5, lambda: next(ids), lambda rid: rid)
    assert seq.waiting("m") == [3, 4]
    seq.submit("m", 1, lambda: next(ids), lambda rid: rid)  # the next one is never refused
    seq.submit("m", 2, lambda: next(ids), lambda rid: rid)
    assert ran == ["r2", "r3", "r0", "r1"] and seq.waiting("m") == []
    rid, new = seq.submit("m", 5, lambda: next(ids), lambda rid: rid)  # sent again: it runs now
    assert new and ran[-1] == rid


def test_finished_futures_are_dropped_oldest_first_past_the_byte_budget():
    store = FutureStore(max_bytes=2500)
    a, b, c, pending = store.create(), store.create(), store.create(), store.create()
    store.resolve(a, ProtoReply(b"x" * 1000))
    store.resolve(b, ProtoReply(b"x" * 1000))
    assert store.held_bytes == 2000 and not store.expired(a)
    store.resolve(c, ProtoReply(b"x" * 1000))  # 3000 > 2500: the oldest finished one goes
    assert store.expired(a) and store.held_bytes == 2000
    with pytest.raises(KeyError):
        store.done(a)
    assert store.result(b).body == b"x" * 1000 and not store.done(pending)  # unfinished ones stay
    store.resolve(pending, ProtoReply(b"y" * 5000))  # alone over the budget: the newest is kept
    assert store.result(pending).body == b"y" * 5000 and store.expired(b) and store.expired(c)
    assert not store.expired("req-999")


def test_a_json_reply_counts_its_serialized_size():
    store = FutureStore(max_bytes=40)
    a, b = store.create(), store.create()
    store.resolve(a, JsonReply({"type": "optim_step", "metrics": {"grad_norm:mean": 1.0}}))  # 58 bytes
    store.resolve(b, JsonReply({"k": 1}))
    assert store.expired(a) and store.result(b).body == {"k": 1}


def test_prompt_over_the_token_limit_is_refused_before_its_ids_are_read():
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1] * 10}, {"type": "encoded_text", "tokens": ["x"] * 7}]}
    with pytest.raises(UserError, match="asample: prompt has 17 tokens, more than serve.max_datum_tokens=16"):
        prompt_tokens(prompt, vocab=100, max_tokens=16)
    assert prompt_tokens({"chunks": [{"tokens": [1, 2]}]}, vocab=100, max_tokens=2) == [1, 2]


def test_checkpoints_belong_to_their_key_until_published(tmp_path):
    store = CheckpointStore(tmp_path)
    mine, theirs = owner_of(KEY), owner_of(OTHER_KEY)
    assert mine != theirs and KEY not in mine
    ck = store.write("s-1:train:0", "weights", "w", {"owner": mine, "published": False}, lambda d: None)
    assert store.resolve(ck.tinker_path, owner=mine).folder == ck.folder
    with pytest.raises(UserError, match=r"checkpoint 'tinker://s-1:train:0/weights/w' belongs to another API key "
                                        r"and is not published"):
        store.resolve(ck.tinker_path, owner=theirs)
    with pytest.raises(UserError, match="only its owner may publish it"):
        store.set_published(ck.tinker_path, theirs, True)
    store.set_published(ck.tinker_path, mine, True)
    assert store.resolve(ck.tinker_path, owner=theirs).meta["published"] is True
    with pytest.raises(UserError, match="is already published"):
        store.set_published(ck.tinker_path, mine, True)
    store.set_published(ck.tinker_path, mine, False)
    with pytest.raises(UserError, match="belongs to another API key"):
        store.resolve(ck.tinker_path, owner=theirs)
    legacy = store.write("s-1:train:0", "weights", "old", {"is_lora": True}, lambda d: None)  # no owner recorded
    assert store.resolve(legacy.tinker_path, owner=theirs).meta["is_lora"] is True


# ------------------------------------------------------------------------------ one server
@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    srv = start_server(tiny_model_path, tmp_path_factory.mktemp("serve_limits"), max_full_clients=1,
                       max_request_bytes=200 * 2 ** 20, max_json_bytes=2 ** 20, checkpoint_sweep_s=0.5)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def two_key_server(tiny_model_path, tmp_path_factory):
    from dsrl.serve.server import ServerThread, build_service
    from dsrl.serve.service import ServiceOptions

    opts = ServiceOptions(model_path=str(tiny_model_path), model_name=MODEL_NAME, dtype="float32",
                          checkpoint_dir=str(tmp_path_factory.mktemp("serve_owners")), micro_batch_size=4,
                          long_poll_seconds=5.0, allow_full_parameter=False)
    srv = ServerThread(build_service(opts), [KEY, OTHER_KEY]).start()
    yield srv
    srv.stop()


def _big_request(mb: int) -> bytes:
    """A forward_backward of about ``mb`` MB for a model id that does not exist: decoded in full,
    then refused at once (nothing computes)."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    n = 32768
    toks = np.random.default_rng(0).integers(3, 1000, n).tolist()
    d = types.Datum(model_input=types.ModelInput.from_ints(toks), loss_fn_inputs={"target_tokens": toks,
                                                                                  "weights": [1.0] * n})
    per_datum = n * 16
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[d] * max(1, mb * 2 ** 20 // per_datum),
                                                          loss_fn="cross_entropy"),
        model_id="s-nobody:train:0", seq_id=1)
    return forward_backward_request_to_proto(req).SerializeToString()


def _heartbeat_latencies(url: str, send) -> list:
    """Seconds per heartbeat of a fresh session, polled every 20 ms while ``send(http)`` runs."""
    hdr = {"X-API-Key": KEY}
    with httpx.Client(base_url=url, timeout=60) as http:
        sid = http.post("/api/v1/create_session", json={}, headers=hdr).json()["session_id"]
        latencies, stop = [], threading.Event()

        def beat():
            with httpx.Client(base_url=url, timeout=60) as h:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    assert h.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=hdr).status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.02)

        t = threading.Thread(target=beat)
        t.start()
        try:
            time.sleep(0.3)
            send(http)
            time.sleep(0.2)
        finally:
            stop.set()
            t.join()
    assert len(latencies) > 10
    return latencies


def test_decoding_runs_off_the_event_loop(server, monkeypatch):
    """A decoder that takes 2 s (a Python loop: it lets the GIL go like the real one's Python
    steps do): heartbeats of another session stay under 1 s. On the event loop, one of them
    waits the whole 2 s (1.975 s measured), so half the decoder's time tells the two apart; off the
    loop they took under 0.3 s, and the margin up to 1 s is for a machine whose cores are shared."""
    service = server.service
    real = type(service).decode_forward_backward

    def slow(self, body, encoding=""):
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            pass
        return real(self, body, encoding)
    monkeypatch.setattr(type(service), "decode_forward_backward", slow)
    body = _big_request(1)

    def send(http):
        r = http.post("/api/v1/forward_backward", content=body, headers={"X-API-Key": KEY})
        assert r.status_code == 400 and "unknown model_id" in r.json()["error"]
    latencies = _heartbeat_latencies(server.url, send)
    assert max(latencies) < 1.0, f"slowest heartbeat {max(latencies):.3f} s"


HEARTBEAT_BOUND_S = 2.5


def test_a_100mb_request_does_not_stall_another_clients_heartbeat(server):
    """The real decoder on three 100 MB forward_backward requests, one after another: every
    heartbeat of another session is answered within HEARTBEAT_BOUND_S (2.5 s). What remains is
    the GIL, held by the protobuf parser and large copies for their whole length: measured on 2
    shared cores, the slowest heartbeat took 0.14-0.93 s (decoding on the loop: 0.26-1.07 s; the
    test above is the one that tells the two apart). The bound was 1.5 s until a clean-clone run failed one of
    these two heartbeat bounds (which one went unrecorded); both were widened then."""
    body = _big_request(100)
    assert len(body) > 100 * 10 ** 6

    def send(http):
        for _ in range(3):
            r = http.post("/api/v1/forward_backward", content=body,
                          headers={"X-API-Key": KEY, "content-type": "application/x-protobuf"})
            assert r.status_code == 400 and "unknown model_id 's-nobody:train:0'" in r.json()["error"]
    latencies = _heartbeat_latencies(server.url, send)
    assert max(latencies) < HEARTBEAT_BOUND_S, f"slowest heartbeat {max(latencies):.3f} s"


def test_an_oversized_body_is_413_naming_the_key_and_the_server_serves_on(server, sc):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/api/v1/forward_backward", content=b"\0" * (200 * 2 ** 20 + 1),
                      headers={"X-API-Key": KEY, "content-type": "application/x-protobuf"})
        assert r.status_code == 413
        assert r.json()["error"] == (f"/api/v1/forward_backward: request body of {200 * 2 ** 20 + 1} bytes is over "
                                     f"serve.max_request_bytes={200 * 2 ** 20}")

        def chunks():  # no content-length: refused while it streams in
            for _ in range(201):
                yield b"\0" * 2 ** 20
        r = http.post("/api/v1/forward_backward", content=chunks(), headers={"X-API-Key": KEY})
        assert r.status_code == 400
        assert r.json()["error"] == f"/api/v1/forward_backward: request body is over serve.max_request_bytes={200 * 2 ** 20}"
        r = http.post("/api/v1/optim_step", content=b"[" * (2 ** 20 + 1), headers={"X-API-Key": KEY})
        assert r.status_code == 400  # JSON has its own cap: the JSON parser holds the GIL
        assert r.json()["error"] == f"/api/v1/optim_step: request body is over serve.max_json_bytes={2 ** 20}"
    client = sc.create_lora_training_client(MODEL_NAME, rank=2).result()
    out = client.forward([datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[1, 1, 1])], "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 1


def test_full_parameter_clients_are_capped(server, sc):
    first = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
    with pytest.raises(Exception, match=r"1 full-parameter clients exist already, each with its own DeepSpeed "
                                        r"engine \(serve.max_full_clients\)"):
        sc.create_lora_training_client(MODEL_NAME, rank=0).result()
    assert first.get_info().is_lora is False


def test_another_keys_checkpoint_loads_only_once_published(two_key_server):
    import tinker

    mine, theirs = service_client(two_key_server.url, KEY), service_client(two_key_server.url, OTHER_KEY)
    try:
        a = mine.create_lora_training_client(MODEL_NAME, rank=2).result()
        path = a.save_state("ckpt").result().path
        with pytest.raises(Exception, match="belongs to another API key and is not published"):
            theirs.create_training_client_from_state(path).result()
        with pytest.raises(Exception, match="only its owner may publish it"):
            theirs.create_rest_client().publish_checkpoint_from_tinker_path(path).result()
        mine.create_rest_client().publish_checkpoint_from_tinker_path(path).result()
        b = theirs.create_training_client_from_state(path).result()
        assert b.get_info().lora_rank == 2
        with pytest.raises(tinker.BadRequestError, match="is already published"):  # 400: the SDK retries a 409
            mine.create_rest_client().publish_checkpoint_from_tinker_path(path).result()
        mine.create_rest_client().unpublish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(Exception, match="belongs to another API key"):
            theirs.create_training_client_from_state(path).result()
    finally:
        mine.close("success").result()
        theirs.close("success").result()


# ------------------------------------------------------------------------------ what is not served
def test_a_field_the_server_does_not_honour_is_refused_by_name():
    from dsrl.serve.requests import check_fields

    check_fields("save_weights", {"model_id": "m", "path": "p", "seq_id": 1, "ttl_seconds": 3600, "type": "save_weights"})
    check_fields("save_weights_for_sampler", {"model_id": "m", "path": "p", "ttl_seconds": 3600,
                                              "user_metadata": {"a": "b"}})
    with pytest.raises(UserError, match=r"load_weights: field 'weights_access_token' is set \('tok'\), but "
                                        r"checkpoints of other accounts are reached by publishing them"):
        check_fields("load_weights", {"path": "tinker://a/weights/b", "weights_access_token": "tok"})
    with pytest.raises(UserError, match="asample: field 'record_stability_info' is set .* stable_reinforce"):
        check_fields("asample", {"prompt": {}, "record_stability_info": True})
    with pytest.raises(UserError, match=r"asample: field 'topk_prompt_logprobs' is set \('3'\), but it is not "
                                        r"supported by this server"):
        check_fields("asample", {"prompt": {}, "topk_prompt_logprobs": 3, "prompt_alt_tokens_k": 0})
    with pytest.raises(UserError, match="create_model: field 'shiny_new_knob' is set .* not supported by this server"):
        check_fields("create_model", {"session_id": "s", "shiny_new_knob": 1})
    with pytest.raises(UserError, match=r"kind='live' is not supported by this server \(only 'snapshot'\)"):
        check_fields("save_weights_for_sampler", {"model_id": "m", "kind": "live"})


def test_a_proto_field_of_a_newer_sdk_fails_the_request_naming_its_number():
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from dsrl.serve import wire

    d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn="cross_entropy"),
                                       model_id="s-x:train:0", seq_id=1)
    body = forward_backward_request_to_proto(req).SerializeToString()
    assert wire.decode_forward_backward(body, max_datums=8, max_tokens=64).error is None
    newer = body + bytes([(15 << 3) | 0, 1])  # field 15 (unknown to SDK 0.38), varint 1
    call = wire.decode_forward_backward(newer, max_datums=8, max_tokens=64)
    assert "the request sets field number 15, which this server does not know" in str(call.error)


def test_provenance_spans_are_decoded_and_their_tiling_checked():
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from dsrl.serve import wire

    P, S = types.PromptProvenanceSpan, types.SampledProvenanceSpan
    d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
    d = d.with_provenance(model_input=[P(sequence_id="a", length=2), S(sequence_id="a", length=1)],
                          loss_fn_inputs=[P(sequence_id="a", offset=1, length=1), S(sequence_id="a", length=2)])

    def decode(datum):
        req = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
            model_id="s-x:train:0", seq_id=1)
        return wire.decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString(),
                                            max_datums=8, max_tokens=64)
    call = decode(d)
    assert call.error is None
    assert call.data[0].spans == {
        "model_input_spans": [wire.Span(False, "a", 0, 2), wire.Span(True, "a", 0, 1)],
        "loss_fn_input_spans": [wire.Span(False, "a", 1, 1), wire.Span(True, "a", 0, 2)]}
    import dataclasses

    short = dataclasses.replace(d, model_input_spans=[P(sequence_id="a", length=2)])  # past the SDK's own check
    assert "datum 0: model_input_spans cover 2 positions, model_input has 3" in str(decode(short).error)
    half = dataclasses.replace(d, loss_fn_input_spans=[])
    assert "datum 0: provenance comes as a pair, loss_fn_input_spans is missing" in str(decode(half).error)


def test_sampled_sequences_keep_the_last_ones_and_forget_a_finished_session():
    from dsrl.serve.provenance import SampledSequences

    seqs = SampledSequences(keep=3)
    seqs.record("s1", ["a", "b"], [1, 2], [[3], [4]])
    seqs.record("s2", ["c", "d"], [1, 2], [[5], [6]])
    assert len(seqs) == 3  # "a" dropped
    from dsrl.serve.wire import Span, WireDatum

    d = WireDatum(model_input=torch.tensor([1, 2]), loss_fn_inputs={"target_tokens": torch.tensor([2, 4])},
                  spans={"model_input_spans": [Span(False, "b", 0, 2)],
                         "loss_fn_input_spans": [Span(False, "b", 1, 1), Span(True, "b", 0, 1)]})
    seqs.check([d], "s1")
    with pytest.raises(UserError, match="sampled in another session"):
        seqs.check([d], "s2")
    seqs.forget_session("s1")
    with pytest.raises(UserError, match="names sequence_id 'b', which this server did not sample or no longer keeps"):
        seqs.check([d], "s1")


def test_an_endpoint_the_server_does_not_serve_is_404_naming_it(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/api/v1/create_custom_loss", json={}, headers={"X-API-Key": KEY})
        assert r.status_code == 404
        assert r.json()["error"].startswith("POST /api/v1/create_custom_loss: this endpoint is not served")
        assert http.get("/api/v1/healthz", headers={"X-API-Key": KEY}).json() == {"status": "ok"}


def test_checkpoints_with_a_ttl_expire_and_are_listed_with_their_expiry(server, sc):
    """save_state(ttl_seconds=...) (tinker-cookbook's periodic checkpoints: 7 days) failed with "field
    'ttl_seconds' is set ..., but checkpoints here never expire". Now: listed with the expiry
    (RestClient.list_checkpoints, list_user_checkpoints, get_training_run), deleted by the sweep
    once expired (serve.checkpoint_sweep_s, 0.5 s here), expiry changed or removed by its owner
    (set_checkpoint_ttl_from_tinker_path), deleted on request (delete_checkpoint_from_tinker_path,
    the cookbook's rolling checkpoints)."""
    import tinker

    client = sc.create_lora_training_client(MODEL_NAME, rank=2, user_metadata={"renderer": "r1"}).result()
    rest = sc.create_rest_client()
    t0 = time.time()
    week = client.save_state("week", ttl_seconds=604800).result().path
    short = client.save_weights_for_sampler("short", ttl_seconds=1).result().path
    kept = client.save_state("kept").result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert set(listed) == {week, short, kept}
    assert abs(listed[week].expires_at.timestamp() - (t0 + 604800)) < 60 and listed[kept].expires_at is None
    assert listed[short].checkpoint_type == "sampler" and listed[week].checkpoint_type == "training"
    folder = server.service.store.root / client.model_id / "sampler_weights" / "short"
    deadline = time.monotonic() + 20
    while folder.exists() and time.monotonic() < deadline:  # nobody touches it: the sweep deletes it
        time.sleep(0.1)
    assert not folder.exists()
    with pytest.raises(tinker.BadRequestError, match="does not exist on this server"):
        sc.create_sampling_client(model_path=short).sample(
            tinker.types.ModelInput.from_ints([5, 6]), 1, tinker.types.SamplingParams(max_tokens=1)).result()
    rest.set_checkpoint_ttl_from_tinker_path(week, None).result()
    rest.delete_checkpoint_from_tinker_path(kept).result()
    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    assert [(c.tinker_path, c.expires_at) for c in listed] == [(week, None)]
    assert week in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    run = rest.get_training_run_by_tinker_path(week).result()
    assert (run.is_lora, run.lora_rank, run.last_checkpoint.tinker_path) == (True, 2, week)
    assert run.user_metadata == {"renderer": "r1"} and run.last_sampler_checkpoint is None
    with pytest.raises(Exception, match="does not exist on this server"):
        sc.create_training_client_from_state(kept).result()
    assert client.save_state("after", ttl_seconds=3600).result().path.endswith("/weights/after")  # it goes on


def test_a_failed_create_from_state_frees_its_lora_slot(tiny_model_path, tmp_path):
    """create_training_client_from_state whose load fails (here: a damaged adapter file) released
    the slot it had built but kept the client counted against serve.max_lora_slots as long as the
    session lived: the next create failed with "all 1 LoRA slots are in use (serve.max_lora_slots)"."""
    srv = start_server(tiny_model_path, tmp_path, max_lora_slots=1)
    try:
        first = service_client(srv.url)
        path = first.create_lora_training_client(MODEL_NAME, rank=2).result().save_state("s").result().path
        first.close("success").result()  # finishes its session: its client is released
        deadline = time.monotonic() + 30
        while srv.service.models and time.monotonic() < deadline:
            time.sleep(0.1)
        for f in srv.service.store.resolve(path).folder.glob("*.safetensors"):
            f.write_bytes(b"not a safetensors file")
        second = service_client(srv.url)
        with pytest.raises(Exception, match="SafetensorError|header"):
            second.create_training_client_from_state(path).result()
        assert second.create_lora_training_client(MODEL_NAME, rank=2).result().get_info().lora_rank == 2
        second.close("success").result()
    finally:
        srv.stop()


def test_a_silent_session_expires_and_frees_its_clients(tiny_model_path, tmp_path):
    """A client process that died sends no more heartbeats: after serve.session_timeout_s its
    session is finished and its LoRA slot released (here 2 s; the SDK beats every 10 s, so an SDK
    session stands in for a dead one). Its heartbeat then gets 410 and its requests fail."""
    import tinker

    srv = start_server(tiny_model_path, tmp_path, session_timeout_s=2.0, max_lora_slots=1)
    try:
        dead = service_client(srv.url)
        client = dead.create_lora_training_client(MODEL_NAME, rank=2).result()
        mid = client.model_id
        deadline = time.monotonic() + 30
        while not srv.service.model_meta[mid].get("released") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert srv.service.model_meta[mid].get("released") and mid not in srv.service.models
        sid = mid.split(":train:")[0]
        r = httpx.post(f"{srv.url}/api/v1/session_heartbeat", json={"session_id": sid}, headers={"X-API-Key": KEY})
        assert r.status_code == 410
        with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError), match="finished|released"):
            client.forward([datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[1, 1, 1])], "cross_entropy").result()
        alive = service_client(srv.url)  # the one slot is free again
        assert alive.create_lora_training_client(MODEL_NAME, rank=2).result().get_info().lora_rank == 2
    finally:
        srv.stop()
