"""Ray-placed vLLM engines (dsrl.rollout.ray_engines) with REAL Ray and REAL vLLM on the tiny
Llama: two engine actors in a placement group of a private Ray cluster (own /tmp folder).
- a generate call spread over both engines comes back in prompt order, equal to one engine
  doing all the prompts (per-request seeds make sampling engine-independent);
- pushed weight buckets reach every engine: each engine's probe log-probs equal an independent
  transformers forward of the pushed weights;
- a frozen engine (SIGSTOP) is named at the deadline (rollout.timeout_s); an engine actor
  killed mid-generation (SIGKILL) is named as dead at once, not at the deadline.
One pair of engines is shared by the module; the tests run in file order (the last ones break
the engines)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dsrl.rollout.resilient import RolloutEngineError

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [42, 43, 44, 45, 46], [9, 10], [11, 12, 13], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def engines(tiny_model_path, tmp_path_factory):
    from dsrl.distributed.ray_cluster import join
    from dsrl.rollout.ray_engines import RayEngines

    cluster = join("local", leader=True, num_cpus=2)
    try:
        eng = RayEngines.start(cluster, num_engines=2, seed=0, weights_root=str(tmp_path_factory.mktemp("ray_w")),
                               tensor_parallel_size=1, cpus_per_engine=1, timeout_s=300.0, rank=0,
                               worker_kwargs=dict(model_path=str(tiny_model_path), dtype="float32", kv_cache_gib=1,
                                                  max_model_len=512))
    except BaseException:
        cluster.shutdown()
        raise
    yield eng
    eng.close()


def _sampled(groups):
    return [[(c.token_ids, c.logprobs) for c in g] for g in groups]


def test_engines_are_placed_and_named(engines):
    assert [e.name for e in engines.engines] == ["engine-0", "engine-1"]
    assert len({e.pid for e in engines.engines}) == 2 and all(e.pid > 0 for e in engines.engines)
    assert engines.engine_alive()
    assert "Ray actor 'engine-1'" in engines.engines[1].describe() and "node " in engines.engines[1].describe()
    # Both on this node: each got its own share of the cores (2 cores: "0" and "1").
    from dsrl.hardware import cpu_core_range, usable_core_ids

    n = usable_core_ids()
    assert [e.cores for e in engines.engines] == [cpu_core_range(n, 0, 2), cpu_core_range(n, 1, 2)]


def test_generate_spreads_prompts_and_keeps_their_order(engines):
    import ray

    seeds = [100 + 7 * i for i in range(len(PROMPTS))]
    engines.pop_metrics()
    spread = engines.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_tokens=10, seeds=seeds)
    served = engines.pop_metrics()
    # One engine, all prompts in one call: the reference for content and order.
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=10, show_progress=False, seeds=seeds)
    single = ray.get(engines.engines[0].actor.generate.remote(PROMPTS, kw))
    assert _sampled(spread) == _sampled(single)
    assert served["rollout/engine0_prompts"] > 0 and served["rollout/engine1_prompts"] > 0
    assert served["rollout/engine0_prompts"] + served["rollout/engine1_prompts"] == len(PROMPTS)
    assert served["rollout/restarts"] == 0.0


def test_pushed_buckets_reach_every_engine(engines, tiny_model_path):
    """Noisy weights packed in small buckets (several per engine); each engine's probe equals a
    transformers forward of the same weights (tied lm_head: the embedding)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dsrl.rollout.buckets import pack_buckets

    state = load_file(os.path.join(str(tiny_model_path), "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    noisy = {k: (v + 0.5 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v).contiguous()
             for k, v in state.items() if k != "lm_head.weight"}
    tokens = torch.randint(0, 1000, (3, 12), generator=g).tolist()
    before = engines.probe_logprobs(tokens)

    buckets = list(pack_buckets(noisy.items(), 1 << 20))
    assert len(buckets) > 2
    engines.push_weights(buckets, step=1)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(noisy, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    with torch.no_grad():
        ids = torch.tensor(tokens)
        ref = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    after = engines.probe_logprobs(tokens)
    assert len(after) == 2
    for name, lps in after.items():
        diff = (torch.tensor(lps) - ref).abs().max().item()
        assert diff < 1e-3, (name, diff)
        old = (torch.tensor(before[name]) - ref).abs().mean().item()
        assert old > 0.1, (name, old)  # the probe tells old weights from new


def test_frozen_engine_is_named_at_the_deadline(engines):
    victim = engines.engines[0]
    engines.timeout_s = 6.0  # the healthy engine answers 6 prompts x 4 tokens in well under 1 s
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RolloutEngineError) as info:
            engines.generate(PROMPTS, n=1, temperature=0.0, top_p=1.0, max_tokens=4)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        engines.timeout_s = 300.0
    msg = str(info.value)
    assert "no answer within rollout.timeout_s=6 s" in msg and "Ray actor 'engine-0'" in msg, msg
    assert "engine-1" not in msg, msg  # the healthy engine answered


def test_engine_killed_mid_generation_is_named_not_waited_for(engines):
    """SIGKILL engine 1's actor while a long generation runs: the error names it as dead well
    before rollout.timeout_s (the deadline is not what caught it)."""
    victim = engines.engines[1]
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            engines.generate(PROMPTS * 4, n=8, temperature=1.0, top_p=1.0, max_tokens=200)
        except BaseException as e:  # checked below
            box["error"] = e
        box["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(3.0)
    assert thread.is_alive(), "generation finished before the kill: make it longer"
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=engines.timeout_s)
    assert not thread.is_alive(), "generate hung after its engine was killed"
    err = box.get("error")
    assert isinstance(err, RolloutEngineError), err
    msg = str(err)
    assert "died during generate" in msg and "Ray actor 'engine-1'" in msg and victim.ip in msg, msg
    assert box["seconds"] < engines.timeout_s
    print(f"\nkilled engine reported after {box['seconds']:.1f} s of generate: {msg[:200]}")
    assert not engines.engine_alive()
