"""The service under load, bounded to about a minute on 2 cores, loopback only.

One server process (`python -m dsrl.serve`, the tiny model, fp32, no sampler) and, at once:
- eight SDK clients, each in a thread with its own session: five LoRA and three full-parameter
  (ZeRO-0 engines), SFT (cross_entropy) and RL (importance_sampling, advantages and behaviour
  log-probs as a sampler would give them), ROUNDS rounds of forward_backward + optim_step each,
  some with a forward between rounds that the client abandons (never waits for);
- a fuzz thread posting malformed payloads to every route (garbage and truncated protobuf,
  wrong JSON types, huge declared shapes and counts, unknown ids, stale seq_ids, oversized bodies),
  some of them with the connection dropped mid-upload;
- one more client in its own process, killed with SIGKILL while its large forward_backward is
  in flight.

Then every client's weights are compared with a replay of its own requests alone on a fresh
client (same seed), and the report line gives requests served, errors by type and the server's
RSS over time. The fuzz corpus must never get a 5xx."""
from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
from serve_helpers import logprobs, random_batch, server_log, service_client, start_server_process

pytestmark = pytest.mark.slow

KEY = "tml-soak-tests"
ROUNDS = 4
CLIENTS = [  # (name, LoRA rank (0: full-parameter), loss)
    ("lora-sft-0", 4, "cross_entropy"), ("lora-sft-1", 8, "cross_entropy"), ("lora-rl-0", 4, "importance_sampling"),
    ("lora-rl-1", 4, "importance_sampling"), ("lora-rl-2", 2, "importance_sampling"),
    ("full-sft-0", 0, "cross_entropy"), ("full-rl-0", 0, "importance_sampling"), ("full-sft-1", 0, "cross_entropy")]
PROBE = random_batch(2, "cross_entropy", seed=999, vocab=1000)


def _data(name: str, loss: str, rnd: int) -> list:
    return random_batch(3, loss, seed=hash((name, rnd)) % 10_000, vocab=1000)


def _adam(rnd: int):
    from tinker import types

    return types.AdamParams(learning_rate=1e-3 * (1 + rnd % 2))


def _create(sc, rank: int, seed: int):
    if rank:
        return sc.create_lora_training_client("tiny", rank=rank, seed=seed).result()
    return sc.create_lora_training_client("tiny", rank=0).result()


def _train(client, name: str, loss: str, counts, abandon: bool) -> None:
    """ROUNDS rounds of this client's own requests; with ``abandon``, a forward between rounds
    that nobody waits for (it runs in order, changes no weight, its result is never fetched)."""
    for rnd in range(ROUNDS):
        client.forward_backward(_data(name, loss, rnd), loss).result()
        client.optim_step(_adam(rnd)).result()
        counts["served"] += 2
        if abandon:
            client.forward(PROBE, "cross_entropy")
            counts["abandoned"] += 1


def _fuzz(url: str, stop: threading.Event, statuses: collections.Counter, model_id: str) -> None:
    rng = random.Random(0)
    hdr = {"X-API-Key": KEY}
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
    good = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn="cross_entropy"),
        model_id="s-nobody:train:0", seq_id=1))
    huge = type(good)()
    huge.CopyFrom(good)
    huge.data[0].loss_fn_inputs["weights"].shape[:] = [1, 10 ** 10]
    corpus = [
        ("forward_backward", b"\xff" * 64), ("forward_backward", good.SerializeToString()[:-3]),
        ("forward_backward", huge.SerializeToString()), ("forward_backward", good.SerializeToString()),
        ("optim_step", b'{"model_id": 5, "seq_id": "x"}'), ("optim_step", b"[1, 2"),
        ("optim_step", f'{{"model_id": "{model_id}", "seq_id": 0, "adam_params": {{}}}}'.encode()),  # stale seq_id
        ("create_model", b'{"session_id": "s-none", "model_seq_id": -1}'),
        ("asample", b'{"sampling_session_id": "x", "seq_id": 1, "num_samples": 1000000000}'),
        ("get_info", b'{"model_id": "s-x:train:9"}'), ("retrieve_future", b'{"request_id": "req-0"}'),
        ("load_weights", b'{"model_id": "m", "path": "tinker://../../etc/weights/x", "seq_id": 1}'),
        ("save_weights", b'{"model_id": "m", "seq_id": 1, "path": "a/b", "ttl_seconds": 5}'),
        ("create_custom_loss", b"{}"), ("session_heartbeat", b'{"session_id": 7}'),
        ("optim_step", b" " * (17 << 20)),  # over serve.max_json_bytes
    ]
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            route, body = rng.choice(corpus)
            if rng.random() < 0.3:  # and some random bytes flipped
                b = bytearray(body)
                for _ in range(3):
                    if b:
                        b[rng.randrange(len(b))] = rng.randrange(256)
                body = bytes(b)
            if rng.random() < 0.1:  # the connection dropped mid-upload
                try:
                    big = (body * (1 + (4 << 20) // max(1, len(body))))[:4 << 20]  # 4 MiB, cut off mid-upload
                    httpx.post(f"{url}/api/v1/{route}", content=big, headers=hdr, timeout=0.001)
                except httpx.TransportError:
                    statuses[(route, "dropped")] += 1
                continue
            r = http.post(f"/api/v1/{route}", content=body, headers=hdr)
            statuses[(route, r.status_code)] += 1
            time.sleep(0.01)


KILLED_CLIENT = r'''
import sys, numpy as np, tinker
from tinker import types
sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = sc.create_lora_training_client("tiny", rank=4, seed=1).result()
rng = np.random.default_rng(0)
data = [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(3, 1000, 200).tolist()),
                    loss_fn_inputs={"target_tokens": rng.integers(3, 1000, 200).tolist(), "weights": [1.0] * 200})
        for _ in range(64)]
print("sending", flush=True)
tc.forward_backward(data, "cross_entropy").result()
print("finished", flush=True)
'''


def test_eight_clients_fuzz_and_a_killed_client(tmp_path, tiny_model_path):
    # Room for the soak's clients, the killed one and the replay's (nothing expires a dead session).
    proc, url = start_server_process(tmp_path, tiny_model_path, KEY, "actor.micro_batch_size=4",
                                     "serve.max_lora_slots=16", "serve.max_full_clients=8")
    server = psutil.Process(proc.pid)
    rss, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            rss.append(server.memory_info().rss / 2 ** 20)
            time.sleep(0.5)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    counts, statuses = collections.Counter(), collections.Counter()
    try:
        sessions = [service_client(url, KEY) for _ in CLIENTS]
        clients = [_create(sc, rank, seed=i) for i, (sc, (_, rank, _)) in enumerate(zip(sessions, CLIENTS))]
        fuzz = threading.Thread(target=_fuzz, args=(url, stop, statuses, clients[0].model_id), daemon=True)
        fuzz.start()
        killed = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, url, KEY], stdout=subprocess.PIPE, text=True)
        errors = []

        def run(i):
            try:
                name, _, loss = CLIENTS[i]
                _train(clients[i], name, loss, counts, abandon=i % 3 == 0)
            except Exception as e:  # reported below, with the client's name
                errors.append((CLIENTS[i][0], repr(e)))
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CLIENTS))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        assert killed.stdout.readline().strip() == "sending"
        time.sleep(1.0)
        os.kill(killed.pid, signal.SIGKILL)  # mid-request: its forward_backward is queued or running
        killed.wait(timeout=30)
        for t in threads:
            t.join(timeout=600)
        soak_s = time.monotonic() - t0
        stop.set()
        fuzz.join(timeout=60)
        assert not errors, errors
        assert proc.poll() is None, "the server died"

        # Replay: each client's own requests alone, on a fresh client of the same seed. Merged
        # forwards round differently from lone ones and AdamW carries that on, so the check is on
        # how far each client moved: the replay's move, to within 5% of it (another client's
        # gradient leaking in would be a move of the same size).
        replay = service_client(url, KEY)
        for i, (name, rank, loss) in enumerate(CLIENTS):
            fresh = _create(replay, rank, seed=i)
            start = np.concatenate(logprobs(fresh.forward(PROBE, "cross_entropy").result()))
            for rnd in range(ROUNDS):
                fresh.forward_backward(_data(name, loss, rnd), loss).result()
                fresh.optim_step(_adam(rnd)).result()
            got = np.concatenate(logprobs(clients[i].forward(PROBE, "cross_entropy").result()))
            want = np.concatenate(logprobs(fresh.forward(PROBE, "cross_entropy").result()))
            moved = np.abs(want - start).max()
            assert moved > 1e-3, (name, moved)  # it trained
            assert np.abs(got - want).max() <= 0.05 * moved, (name, np.abs(got - want).max(), moved)
        server_errors = {k: v for k, v in statuses.items() if isinstance(k[1], int) and k[1] >= 500}
        by_status = collections.Counter()
        for (_, status), n in statuses.items():
            by_status[status] += n
        print(f"\nsoak: {len(CLIENTS)} clients x {ROUNDS} rounds in {soak_s:.1f} s, {counts['served']} training "
              f"requests served, {counts['abandoned']} abandoned, fuzz requests {sum(statuses.values())} by status "
              f"{dict(sorted(by_status.items(), key=str))}, killed client exit {killed.returncode}, server RSS MiB "
              f"min {min(rss):.0f} max {max(rss):.0f} last {rss[-1]:.0f}")
        assert not server_errors, (server_errors, server_log(tmp_path)[-5000:])
        assert "Traceback" not in server_log(tmp_path), server_log(tmp_path)[-5000:]
        assert killed.returncode == -signal.SIGKILL
        for sc in sessions + [replay]:
            sc.close("success").result()
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=60)
