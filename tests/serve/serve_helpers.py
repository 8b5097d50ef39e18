"""Shared pieces of the service tests: a server on the tiny model in a background thread of the
test process (the SDK talks to it over real HTTP on 127.0.0.1), datum builders, and the five
Tinker loss formulas written out in numpy from the protocol (tinker-protocol §1.2)."""
from __future__ import annotations

import os

import numpy as np

KEY = "tml-serve-tests"
MODEL_NAME = "dsrl-tiny"

os.environ.setdefault("TINKER_TELEMETRY", "0")


def start_server(model_path, checkpoint_dir, **overrides):
    from dsrl.serve.server import ServerThread, build_service
    from dsrl.serve.service import ServiceOptions

    opts = dict(model_path=str(model_path), model_name=MODEL_NAME, checkpoint_dir=str(checkpoint_dir),
                dtype="float32", attn_implementation="eager", micro_batch_size=4, long_poll_seconds=5.0)
    opts.update(overrides)
    return ServerThread(build_service(ServiceOptions(**opts)), [KEY]).start()


# The sampler of a server process with `sampling=True` (tiny model, fp32, small KV cache).
SAMPLER = ["rollout.dtype=float32", "rollout.max_model_len=256", "rollout.kv_cache_gib=1", "rollout.enforce_eager=true"]


def start_server_process(tmp_path, model_path, key, *overrides, sampling=False):
    """``python -m dsrl.serve`` as a user starts it (fp32, no sampler unless ``sampling``), on a free port; returns
    (process, url) once /healthz answers, its output going to ``tmp_path/server.log``
    (`server_log`). The caller terminates the process."""
    import subprocess
    import sys
    import time

    import httpx

    from dsrl.distributed.ports import free_port
    from dsrl.testing import subprocess_env

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port = free_port()
    cmd = [sys.executable, "-m", "dsrl.serve", "+exp=tinker_service", f"model.path={model_path}",
           "model.dtype=float32", f"serve.sampling={str(bool(sampling)).lower()}", f"serve.port={port}", "serve.model_name=tiny",
           f"serve.api_keys=[{key}]", f"hydra.run.dir={tmp_path}", *overrides]
    log = open(os.path.join(str(tmp_path), "server.log"), "w")  # a pipe nobody reads would block its logging
    proc = subprocess.Popen(cmd, cwd=root, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {server_log(tmp_path)[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": key}).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start within 120 s")
        time.sleep(0.5)


def server_log(tmp_path) -> str:
    """What a `start_server_process` server printed so far."""
    with open(os.path.join(str(tmp_path), "server.log")) as f:
        return f.read()


def service_client(url, key=KEY):
    import tinker

    return tinker.ServiceClient(base_url=url, api_key=key)


def datum(tokens, **inputs):
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints([int(t) for t in tokens]),
                       loss_fn_inputs={k: [float(x) if k != "target_tokens" else int(x) for x in v]
                                       for k, v in inputs.items()})


def random_batch(n, loss_fn, seed, vocab=49152, min_len=4, max_len=10):
    """n datums with explicit targets that differ from the next input token."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        N = int(rng.integers(min_len, max_len + 1))
        toks = rng.integers(3, vocab, N)
        inp = {"target_tokens": rng.integers(3, vocab, N)}
        if loss_fn == "cross_entropy":
            inp["weights"] = rng.uniform(-0.5, 1.5, N)
        else:
            inp["logprobs"] = -rng.uniform(4, 12, N)
            inp["advantages"] = rng.normal(0, 1, N)
        out.append(datum(toks, **inp))
    return out


def sft_batch(tokenizer, texts):
    """cross_entropy datums: model_input = tokens[:-1], target = tokens[1:], weights normalized to
    sum 1 per example (the cookbook's reduction="mean")."""
    out = []
    for t in texts:
        ids = tokenizer.encode(t)
        n = len(ids) - 1
        out.append(datum(ids[:-1], target_tokens=ids[1:], weights=[1.0 / n] * n))
    return out


def logprobs(result):
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64) for o in result.loss_fn_outputs]


DEFAULTS = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, "dro": {"beta": 0.05}}


def formula_loss(loss_fn, data, lps, config=None):
    """Σ over datums of the per-datum Tinker loss, from the given per-datum log-probs (float64)."""
    cfg = dict(DEFAULTS.get(loss_fn, {}))
    cfg.update(config or {})
    total = 0.0
    for d, lp in zip(data, lps):
        f = {k: np.asarray(v.to_numpy(), dtype=np.float64) for k, v in d.loss_fn_inputs.items()}
        if loss_fn == "cross_entropy":
            total += float(-(f["weights"] * lp).sum())
            continue
        q, A = f["logprobs"], f["advantages"]
        r = np.exp(lp - q)
        if loss_fn == "importance_sampling":
            tok = -r * A
        elif loss_fn == "ppo":
            tok = -np.minimum(r * A, np.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * A)
        elif loss_fn == "cispo":
            tok = -np.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * lp * A
        else:
            tok = -(lp * A - 0.5 * cfg["beta"] * (lp - q) ** 2)
        total += float(tok.sum())
    return total


def hold_compute(service):
    """Stop the compute thread at a gate op; returns (release, batches): every batch run after
    the gate is recorded as [(kind, client), ...]."""
    import threading

    from dsrl.serve.executor import Op

    gate, release, batches = service.futures.create(), threading.Event(), []
    run = service.executor._run_batch

    def recording(batch):
        if batch[0].request_id == gate:
            release.wait(60)
        else:
            batches.append([(op.kind, op.lane) for op in batch])
        run(batch)

    service.executor._run_batch = recording
    service.executor.put([Op("fail", "gate", gate, payload=ValueError("gate"))])
    return release, batches
