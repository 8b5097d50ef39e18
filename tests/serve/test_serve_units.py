"""Fast checks of the service's parts without a server: the protobuf wire against the SDK's own
encoder/decoder (an independent implementation), clear errors for malformed payloads, per-client
seq_id order and retry de-duplication, the compute thread's merge rule, long-poll futures, the
tinker:// store, and the multi-LoRA pool's merged optimizer step with per-slot clipping."""
from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from dsrl.serve import wire
from dsrl.serve.errors import UserError


def _sdk_request(data, loss_fn="ppo", config=None, seq_id=3, forward_only=False):
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s-x:train:0", seq_id=seq_id)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg


# ------------------------------------------------------------------------------ wire
def _decode(body: bytes, max_datums: int = 1024, max_tokens: int = 32768):
    return wire.decode_forward_backward(body, max_datums=max_datums, max_tokens=max_tokens)


def test_decode_sdk_request_dense_sparse_and_config():
    from tinker import types

    d1 = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                     loss_fn_inputs={"target_tokens": [1, 2, 3], "weights": [0.5, 1.0, -2.0]})
    sparse = torch.zeros(3, 8)
    sparse[0, 3], sparse[1, 0] = 3.0, 4.0
    d2 = types.Datum(model_input=types.ModelInput.from_ints([9, 8, 7]),
                     loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.arange(24).reshape(3, 8)),
                                     "weights": types.TensorData.from_torch_sparse(sparse)})
    assert d2.loss_fn_inputs["weights"].sparse_crow_indices is not None  # really sent as CSR
    body = _sdk_request([d1, d2], "ppo", {"clip_low_threshold": 0.7, "loss_id": "abc"}, forward_only=True)
    call = _decode(body.SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s-x:train:0", 3, "ppo", True)
    assert call.loss_fn_config == {"clip_low_threshold": 0.7, "loss_id": "abc"}  # v2: numbers and text
    assert call.error is None
    assert call.data[0].model_input.tolist() == [5, 6, 7]
    assert call.data[0].loss_fn_inputs["weights"].tolist() == [0.5, 1.0, -2.0]
    assert call.data[0].loss_fn_inputs["target_tokens"].dtype == torch.int64
    assert torch.equal(call.data[1].loss_fn_inputs["weights"], sparse)
    assert torch.equal(call.data[1].loss_fn_inputs["target_tokens"], torch.arange(24).reshape(3, 8))


def test_encoded_outputs_decode_with_the_sdk():
    from tinker.proto.response_conv import (
        deserialize_forward_backward_output,
        deserialize_sample_response,
    )

    outs = [{"logprobs": torch.tensor([-1.0, -2.5]), "elementwise_loss": torch.tensor([0.5, 0.25])},
            {"logprobs": torch.tensor([-3.0]), "elementwise_loss": torch.tensor([1.0])}]
    got = deserialize_forward_backward_output(wire.encode_forward_backward_output(outs, {"loss:sum": 1.75}))
    assert got.metrics == {"loss:sum": 1.75}
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [[-1.0, -2.5], [-3.0]]
    assert [o["elementwise_loss"].tolist() for o in got.loss_fn_outputs] == [[0.5, 0.25], [1.0]]
    empty = deserialize_forward_backward_output(wire.encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert empty.loss_fn_outputs == []
    seqs = [wire.SampledSequence([4, 2], [-0.5, -0.25], True), wire.SampledSequence([7], [-1.5], False)]
    sr = deserialize_sample_response(wire.encode_sample_response(seqs, [None, -1.0, -2.0]))
    assert [s.tokens for s in sr.sequences] == [[4, 2], [7]]
    assert [s.stop_reason for s in sr.sequences] == ["stop", "length"]
    assert sr.sequences[0].logprobs == [-0.5, -0.25]
    assert sr.prompt_logprobs == [None, -1.0, -2.0]


@pytest.mark.parametrize("mutate,needle", [
    (lambda m: setattr(m.data[1].loss_fn_inputs["weights"], "dense", b"\x00" * 7),
     "datum 1: loss_fn_inputs['weights']: 7 bytes is not a whole number of float32 values"),
    (lambda m: m.data[0].loss_fn_inputs["weights"].shape.extend([5]),
     "datum 0: loss_fn_inputs['weights']: shape [5] needs 5 values, the data has 3"),
    (lambda m: setattr(m.data[0].loss_fn_inputs["weights"], "dtype", 0),
     "datum 0: loss_fn_inputs['weights']: unsupported dtype unspecified"),
    (lambda m: setattr(m.data[1].model_input[0].encoded_text, "tokens", b"\x01\x00\x00"),
     "datum 1: model_input chunk 0: 3 bytes is not a whole number of int32 tokens"),
])
def test_malformed_datum_is_a_user_error_naming_datum_and_field(mutate, needle):
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [1, 2, 3], "weights": [1.0, 1.0, 1.0]}) for _ in range(2)]
    msg = _sdk_request(data, "cross_entropy")
    del msg.data[0].loss_fn_inputs["weights"].shape[:]
    mutate(msg)
    call = _decode(msg.SerializeToString())
    assert call.seq_id == 3 and call.data == []  # envelope readable: the request can still consume seq 3
    assert needle in str(call.error)


def test_image_chunk_rejected_and_garbage_unreadable():
    msg = wire.ForwardBackwardRequestProto(model_id="m", seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().image.SetInParent()
    call = _decode(msg.SerializeToString())
    assert "datum 0: model_input chunk 0 is image" in str(call.error)
    with pytest.raises(UserError, match="not a ForwardBackwardRequest protobuf"):
        _decode(b"\xff\xff\xff garbage")


def test_oversized_requests_fail_alone_before_anything_is_allocated(monkeypatch):
    """The limits (serve.max_chunk_datums, serve.max_datum_tokens) are checked on the declared
    sizes: a sparse tensor declared [1, 10**10] is refused without densifying it (that allocated
    37 GiB before), 1025 datums against a maximum of 1024 are refused (accepted before)."""
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [1, 2, 3], "weights": [1.0, 1.0, 1.0]})
    call = _decode(_sdk_request([datum] * 5, "cross_entropy").SerializeToString(), max_datums=4)
    assert call.data == [] and "5 datums in one request, more than serve.max_chunk_datums=4" in str(call.error)
    assert _decode(_sdk_request([datum] * 4, "cross_entropy").SerializeToString(), max_datums=4).error is None
    long = types.Datum(model_input=types.ModelInput.from_ints(list(range(10, 30))),
                       loss_fn_inputs={"target_tokens": list(range(20)), "weights": [1.0] * 20})
    call = _decode(_sdk_request([datum, long], "cross_entropy").SerializeToString(), max_tokens=16)
    assert "datum 1: model_input has 20 tokens, more than serve.max_datum_tokens=16" in str(call.error)

    msg = _sdk_request([datum], "cross_entropy")
    w = msg.data[0].loss_fn_inputs["weights"]
    w.ClearField("dense")
    del w.shape[:]
    w.shape.extend([1, 10 ** 10])
    w.sparse_csr.crow_indices = np.array([0, 1], dtype="<i8").tobytes()
    w.sparse_csr.col_indices = np.array([5], dtype="<i8").tobytes()
    w.sparse_csr.values = np.array([1.0], dtype="<f4").tobytes()
    allocated = []
    real_zeros = np.zeros
    monkeypatch.setattr(np, "zeros", lambda shape, *a, **k: allocated.append(shape) or real_zeros(shape, *a, **k))
    call = _decode(msg.SerializeToString())
    assert "datum 0: loss_fn_inputs['weights']: shape [1, 10000000000] holds 10000000000 values, more than " \
           "serve.max_datum_tokens=32768" in str(call.error)
    assert allocated == []  # refused from the declared shape


# ------------------------------------------------------------------------------ order, futures, store
def test_sequencer_orders_buffers_and_deduplicates():
    from dsrl.serve.sequencer import Sequencer

    ran = []
    seq = Sequencer(lambda ops: ran.extend(ops))
    seq.open("m")
    ids = iter(f"r{i}" for i in range(100))
    new = lambda: next(ids)  # noqa: E731
    r3, fresh3 = seq.submit("m", 3, new, lambda rid: ("op3", rid))
    r2, _ = seq.submit("m", 2, new, lambda rid: ("op2", rid))
    assert ran == [] and seq.waiting("m") == [2, 3]  # nothing runs before seq 1
    again, fresh = seq.submit("m", 3, new, lambda rid: ("dup", rid))
    assert (again, fresh, fresh3) == (r3, False, True)  # a retry gets the original id
    seq.submit("m", 1, new, lambda rid: ("op1", rid))
    assert [op for op, _ in ran] == ["op1", "op2", "op3"]
    assert seq.submit("m", 2, new, lambda rid: ("late dup", rid)) == (r2, False)
    assert [op for op, _ in ran] == ["op1", "op2", "op3"]
    with pytest.raises(KeyError):
        seq.submit("unknown", 1, new, lambda rid: rid)


def test_executor_merges_without_reordering_a_client():
    import threading

    from dsrl.serve.executor import Executor, Op

    gate, batches = threading.Event(), []

    def run(batch):
        gate.wait(5)
        batches.append([op.request_id for op in batch])

    ex = Executor(run, max_batch_size=100)
    ex.put([Op("x", "blocker", "b0")])  # holds the thread while the queue fills
    ex.put([Op("fwd", "A", "a1", merge_key="k"), Op("fwd", "B", "b1", merge_key="k"),
            Op("step", "A", "a2", merge_key="s"), Op("fwd", "A", "a3", merge_key="k"),
            Op("fwd", "C", "c1", merge_key="k"), Op("step", "B", "b2", merge_key="s")])
    gate.set()
    assert ex.idle(5)
    ex.stop()
    # a3 may not jump over a2 (same client); C's and B's requests may join A's forward.
    assert batches == [["b0"], ["a1", "b1", "c1"], ["a2", "b2"], ["a3"]]


def test_two_queued_optim_steps_of_one_client_are_two_steps():
    """Both optim_steps of client A (each with its own AdamParams) were merged into one batch before,
    and the merged pool step kept one of them: one step, both futures with its metrics."""
    import threading

    from dsrl.serve.executor import Executor, Op

    gate, batches = threading.Event(), []

    def run(batch):
        gate.wait(5)
        batches.append([op.request_id for op in batch])

    ex = Executor(run, max_batch_size=100)
    ex.put([Op("x", "blocker", "b0")])
    key = ("optim", "lora")
    ex.put([Op("optim", "A", "a1", merge_key=key, merges_within_lane=False),
            Op("optim", "A", "a2", merge_key=key, merges_within_lane=False),
            Op("optim", "B", "b1", merge_key=key, merges_within_lane=False)])
    gate.set()
    assert ex.idle(5)
    ex.stop()
    assert batches == [["b0"], ["a1", "b1"], ["a2"]]


def test_future_long_poll_returns_when_set_or_times_out():
    import threading

    from dsrl.serve.futures import FutureStore, JsonReply

    store = FutureStore()
    rid = store.create()
    assert asyncio.run(store.wait(rid, 0.05)) is None  # not ready: the HTTP layer answers try_again
    threading.Timer(0.1, lambda: store.resolve(rid, JsonReply({"ok": 1}))).start()
    assert asyncio.run(store.wait(rid, 5.0)) == JsonReply({"ok": 1})
    assert not store.done(store.create())
    with pytest.raises(KeyError):
        asyncio.run(store.wait("req-unknown", 0.01))


def test_checkpoint_store_paths_and_errors(tmp_path):
    from dsrl.serve.store import CheckpointStore

    store = CheckpointStore(tmp_path)
    ck = store.write("s-1:train:0", "weights", "step1", {"is_lora": True}, lambda d: (d / "x.bin").write_bytes(b"1"))
    assert ck.tinker_path == "tinker://s-1:train:0/weights/step1"
    assert store.resolve(ck.tinker_path).meta == {"is_lora": True, "created_at": ck.meta["created_at"]}
    with pytest.raises(UserError, match="already exists"):
        store.write("s-1:train:0", "weights", "step1", {}, lambda d: None)
    with pytest.raises(UserError, match="does not exist"):
        store.resolve("tinker://s-1:train:0/weights/step2")
    with pytest.raises(UserError, match="needs sampler_weights"):
        store.resolve(ck.tinker_path, "sampler_weights")
    for bad in ("file:///etc/passwd", "tinker://a/b", "tinker://run/weights/../x", "tinker://run/other/x"):
        with pytest.raises(UserError):
            store.resolve(bad)
    with pytest.raises(UserError, match="checkpoint name"):
        store.write("s-1:train:0", "weights", "a/b", {}, lambda d: None)


def test_a_checkpoint_with_a_ttl_expires_is_refused_by_name_and_collected(tmp_path):
    """save_state / save_weights_for_sampler with ttl_seconds (the cookbook's periodic checkpoints:
    604800) were refused ("checkpoints here never expire"); now the checkpoint records its expiry,
    is listed with it, is refused naming the time once past it, and is deleted: when touched, or
    by the sweep (`collect_expired`) when nobody touches it. Its owner may change the expiry."""
    import time as _time

    from dsrl.serve.store import CheckpointStore, check_ttl

    store = CheckpointStore(tmp_path)
    t0 = _time.time()
    keep = store.write("s-1:train:0", "weights", "keep", {"owner": "me"}, lambda d: (d / "x.bin").write_bytes(b"12"),
                       ttl_seconds=604800)
    short = store.write("s-1:train:0", "sampler_weights", "short", {"owner": "me", "user_metadata": {"k": "v"}},
                        lambda d: None, ttl_seconds=1)
    forever = store.write("s-1:train:0", "weights", "forever", {"owner": "me"}, lambda d: None)
    assert abs(keep.meta["expires_at"] - (t0 + 604800)) < 5 and "expires_at" not in forever.meta
    listed = {c["checkpoint_id"]: c for c in store.entries("s-1:train:0", owner="me")}
    assert sorted(listed) == ["sampler_weights/short", "weights/forever", "weights/keep"]
    assert listed["weights/keep"]["expires_at"].startswith(
        _time.strftime("%Y-%m-%dT", _time.gmtime(keep.meta["expires_at"])))
    assert listed["weights/forever"]["expires_at"] is None and listed["weights/keep"]["size_bytes"] > 2
    assert listed["sampler_weights/short"]["checkpoint_type"] == "sampler"
    assert listed["sampler_weights/short"]["user_metadata"] == {"k": "v"}
    assert store.entries("s-1:train:0", owner="someone else") == []
    _time.sleep(max(0.0, short.meta["expires_at"] - _time.time()) + 0.05)
    with pytest.raises(UserError, match=r"checkpoint 'tinker://s-1:train:0/sampler_weights/short' expired at "
                                        r"\d{4}-\d\d-\d\dT.* \(the ttl_seconds it was saved with\) and was deleted"):
        store.resolve(short.tinker_path)
    assert not short.folder.exists()
    # the sweep collects what nobody touched; the owner's set_ttl moves the expiry (None: never)
    assert store.collect_expired(now=keep.meta["expires_at"] + 1) == [keep.tinker_path] and not keep.folder.exists()
    with pytest.raises(UserError, match="only its owner may set the expiry of it"):
        store.set_ttl(forever.tinker_path, "someone else", 60)
    assert store.set_ttl(forever.tinker_path, "me", 60).meta["expires_at"] > t0
    assert store.collect_expired() == []
    assert store.set_ttl(forever.tinker_path, "me", None).meta["expires_at"] is None
    with pytest.raises(UserError, match="only its owner may delete it"):
        store.delete(forever.tinker_path, owner="someone else")
    store.delete(forever.tinker_path, owner="me")
    assert store.entries() == []
    for bad in (0, -5, True, 1.5, "60", 10 * 365 * 86400 + 1):
        with pytest.raises(UserError, match="save_weights: ttl_seconds=.* must be null"):
            check_ttl(bad, "save_weights")


# ------------------------------------------------------------------------------ multi-LoRA pool
@pytest.fixture(scope="module")
def pool(tiny_model_path):
    from dsrl.serve.lora import LoraPool, LoraSpec

    p = LoraPool(str(tiny_model_path), dtype=torch.float32, attn_implementation="eager", micro_batch_size=4, pad_id=0)
    for i, rank in enumerate((2, 4, 8)):
        p.add_slot(f"s{i}", LoraSpec(rank=rank, alpha=8.0, seed=i, train_mlp=(i != 1), train_unembed=(i != 2)))
    return p


def _set_grads(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for name in pool.slots:
        for p in pool.slot_parameters(name).values():
            p.grad = torch.randn(p.shape, generator=g) * (1 + int(name[1:]))


def _params(pool):
    return {name: {k: p.detach().clone() for k, p in pool.slot_parameters(name).items()} for name in pool.slots}


def test_lora_flags_select_layers(pool):
    names = {n: {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in pool.slot_parameters(n)} for n in pool.slots}
    assert names["s0"] == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    assert names["s1"] == {"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"}  # train_mlp=False
    assert "lm_head" not in names["s2"]  # train_unembed=False
    a = next(v for k, v in pool.slot_parameters("s2").items() if "q_proj.lora_A" in k)
    assert a.shape[0] == 8  # rank


def test_k_slot_step_equals_k_single_slot_steps_with_per_slot_clip(pool):
    from dsrl.actor.work_units import AdamParams

    adam = {"s0": AdamParams(learning_rate=1e-2, grad_clip_norm=0.5), "s1": AdamParams(learning_rate=3e-3, beta2=0.9),
            "s2": AdamParams(learning_rate=1e-3, grad_clip_norm=1e9, weight_decay=0.1)}
    single = copy.deepcopy(pool)
    _set_grads(pool, 0)
    _set_grads(single, 0)
    norms = {n: float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in pool.slot_parameters(n).values()])))
             for n in pool.slots}
    merged = pool.step(adam)  # one optimizer step for all three slots
    for name in ("s2", "s0", "s1"):  # three single-slot steps, another order
        assert single.step({name: adam[name]})[name]["grad_norm:mean"] == pytest.approx(norms[name], rel=1e-6)
    a, b = _params(pool), _params(single)
    for name in pool.slots:
        assert merged[name]["grad_norm:mean"] == pytest.approx(norms[name], rel=1e-6)
        for k in a[name]:  # AdamW updates each tensor on its own: the same arithmetic either way
            assert torch.equal(a[name][k], b[name][k]), (name, k)


def test_clip_and_adamw_match_a_hand_reference(pool):
    """Slot s0's update = torch AdamW on its gradients scaled by clip / (norm + 1e-6); slot s1,
    not stepping, keeps its parameters, gradients and optimizer state."""
    from dsrl.actor.work_units import AdamParams

    _set_grads(pool, 1)
    p0 = {k: p.detach().clone() for k, p in pool.slot_parameters("s0").items()}
    g0 = {k: p.grad.clone() for k, p in pool.slot_parameters("s0").items()}
    st0 = {k: copy.deepcopy(pool.optimizer.state.get(p, {})) for k, p in pool.slot_parameters("s0").items()}
    s1_before = {k: (p.detach().clone(), p.grad.clone()) for k, p in pool.slot_parameters("s1").items()}
    s1_state = {k: copy.deepcopy(pool.optimizer.state.get(p, {})) for k, p in pool.slot_parameters("s1").items()}
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in g0.values()])))
    pool.step({"s0": AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, grad_clip_norm=0.25)})
    coef = 0.25 / (norm + 1e-6)
    assert coef < 1
    for k, p in pool.slot_parameters("s0").items():
        ref = torch.nn.Parameter(p0[k].clone())
        ref.grad = g0[k] * coef
        opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.0)
        if st0[k]:
            opt.state[ref] = copy.deepcopy(st0[k])
        opt.step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-7)
        assert p.grad is None
    for k, p in pool.slot_parameters("s1").items():
        assert torch.equal(p.detach(), s1_before[k][0]) and torch.equal(p.grad, s1_before[k][1])
        assert all(torch.equal(a, b) for a, b in zip(pool.optimizer.state.get(p, {}).values(), s1_state[k].values()))


def test_adapters_see_only_their_rows(pool):
    """One forward over rows of two slots: each slot's gradient equals its gradient from a batch
    of its own rows only, and a slot without rows gets none."""
    from dsrl.serve.objectives import ObjectiveTable

    obj = ObjectiveTable().resolve("importance_sampling", None)
    rng = np.random.default_rng(3)

    def data(n):
        return [{"model_input": rng.integers(3, 49152, 6).tolist(),
                 "loss_fn_inputs": {"target_tokens": rng.integers(3, 49152, 6).tolist(),
                                    "logprobs": (-rng.uniform(5, 12, 6)).tolist(),
                                    "advantages": rng.normal(0, 1, 6).tolist()}}
                for _ in range(n)]
    d0, d1 = data(3), data(2)
    sess = pool.session

    def grads_after(items, tags):
        for n in pool.slots:
            for p in pool.slot_parameters(n).values():
                p.grad = None
        sess.run_prepared(items, obj.spec, obj.config, forward_only=False, tags=tags)
        return {n: {k: (None if p.grad is None else p.grad.clone()) for k, p in pool.slot_parameters(n).items()}
                for n in pool.slots}

    p0, p1 = sess.validate(d0, "importance_sampling"), sess.validate(d1, "importance_sampling")
    mixed = grads_after(p1[:1] + p0 + p1[1:], ["s1"] + ["s0"] * 3 + ["s1"])
    alone0 = grads_after(p0, ["s0"] * 3)
    alone1 = grads_after(p1, ["s1"] * 2)
    assert all(g is None for g in mixed["s2"].values())
    for name, alone in (("s0", alone0), ("s1", alone1)):
        for k, g in mixed[name].items():  # fp32, different batch shapes: close relative to the tensor's scale
            ref = alone[name][k]
            assert (g - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-8, (name, k)
    assert all(g is None for g in alone0["s1"].values())
    for n in pool.slots:
        for p in pool.slot_parameters(n).values():
            p.grad = None


def test_sampling_seed_is_checked_and_reaches_vllm():
    from dsrl.serve.sampler import SampleJob, VllmSampler, parse_sampling_params

    job = SampleJob(prompt=[1, 2, 3], num_samples=2, prompt_logprobs=False, prompt_logprobs_last_n=None,
                    **parse_sampling_params({"seed": 7, "max_tokens": 4}))
    sampler = object.__new__(VllmSampler)  # only _params is exercised: no engine
    sampler.max_model_len = 64
    assert sampler._params(job).seed == 7
    greedy = SampleJob(**{**job.__dict__, "temperature": 0.0, "num_samples": 1})
    assert sampler._params(greedy).seed is None
    for bad in ("7", 1.5, True, -1):
        with pytest.raises(UserError, match="sampling_params.seed"):
            parse_sampling_params({"seed": bad})


def test_a_failed_load_frees_the_slot_it_built():
    """create_training_client_from_state whose checkpoint does not fit: the model built for it is
    released (its LoRA slot or DeepSpeed engine freed) and never registered, no longer counted
    against serve.max_lora_slots / max_full_clients; the error is answered. A build that fails
    is not counted either."""
    from types import SimpleNamespace

    from dsrl.serve.errors import UserError
    from dsrl.serve.executor import Op
    from dsrl.serve.service import Service

    released = []
    model = SimpleNamespace(release=lambda: released.append(True))

    def bad_load(m, ckpt, optimizer):
        raise UserError("load_weights: tinker://x holds a full state; this client is LoRA")

    fake = SimpleNamespace(models={}, _build_model=lambda lane, spec: model, _load_into=bad_load,
                           model_meta={"s-1:train:0": {"is_lora": True}, "s-1:train:1": {"is_lora": False}},
                           futures=SimpleNamespace(resolve=lambda *a: pytest.fail("resolved a failed load")))
    with pytest.raises(UserError, match="holds a full state"):
        Service._do_create(fake, [Op("create", "s-1:train:0", "r1", payload=(None, (object(), True)))])
    assert released == [True] and fake.models == {} and fake.model_meta["s-1:train:0"]["released"] is True

    def no_memory(lane, spec):
        raise MemoryError("no room for another engine")

    fake._build_model = no_memory
    with pytest.raises(MemoryError):
        Service._do_create(fake, [Op("create", "s-1:train:1", "r2", payload=(None, None))])
    assert fake.model_meta["s-1:train:1"]["released"] is True and fake.models == {}


def test_finish_session_answers_requests_waiting_for_a_seq_id_that_never_came():
    """A request that arrived early (seq 3 while seq 2 never came) waited in the sequencer; when the
    session finished, close() dropped it and its future was never answered (the SDK polled
    try_again forever). Now it fails, naming the session and the seq_id; queued work still runs."""
    import threading
    from types import SimpleNamespace

    from dsrl.serve.futures import FutureStore
    from dsrl.serve.sequencer import Sequencer
    from dsrl.serve.service import Service, _Session

    put = []
    futures = FutureStore()
    from dsrl.serve.provenance import SampledSequences

    fake = SimpleNamespace(_lock=threading.Lock(), sessions={"s-1": _Session("s-1", owner="k", models=["s-1:train:0"])},
                           futures=futures, executor=SimpleNamespace(put=put.extend), sampled=SampledSequences(4))
    fake.sequencer = Sequencer(put.extend)
    fake.sequencer.open("s-1:train:0")
    r1, _ = fake.sequencer.submit("s-1:train:0", 1, futures.create, lambda rid: SimpleNamespace(request_id=rid))
    r3, _ = fake.sequencer.submit("s-1:train:0", 3, futures.create, lambda rid: SimpleNamespace(request_id=rid))
    assert [op.request_id for op in put] == [r1] and not futures.done(r3)
    Service.finish_session(fake, "s-1")
    assert futures.done(r3)
    body = futures.result(r3, timeout=1).body
    assert body["category"] == "user"
    assert body["error"] == ("s-1:train:0: session s-1 finished while request seq_id 3 waited for an earlier seq_id "
                             "that never arrived; it did not run")
    assert put[-1].kind == "release"
